"""A job that writes into its own control-region slot cannot break status or metrics.

A rank holds its communicator's control region mapped read-write, so a buggy or hostile
process can write any number into its slot's counters. The red team's breaks, each here
with a hostile job writing into its own slot beside a victim job on one real daemon:

- B2: ``S_OPS = -1`` made ``smddpctl status`` fail for every job (an int64 copied into a
  uint64 proto field: "Value out of range: -1").
- B3: a counter that went backwards made every scrape fail (/metrics: RemoteDisconnected;
  ``smddpctl metrics``: "Counters can only be incremented by non-negative amounts").
- B8: adding 2**62 to one's own counters took node-wide ``smddp_ops_total`` to 4.6e18.

In each, the victim's results are right, status and /metrics answer and show the victim's
real counts, the node-wide totals move by no more than the hostile job really did, and the
hostile job's ranks get an error that says what happened, logged once.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from smddp.client import SmddpError, connect
from smddp.client.communicator import Communicator
from smddp.core.region import C_OPS, DTYPES, S_OPS
from smddp.v1 import smddp_pb2 as pb

VICTIM_OPS = 20
HOSTILE_OPS = 5
NAMED = "metric counters in the control region"
FOREIGN = "the region was written by something other than smddp"

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Series:
    """The daemon's /metrics over HTTP, as (name, labels) -> value; fails on any error."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(series: Series, name: str, **labels: str) -> float:
    return series.get((name, frozenset(labels.items())), 0.0)


def pair(path: str, job: str) -> tuple[Communicator, Communicator]:
    """Both ranks of a two-rank job, in this process."""
    token = secrets.token_bytes(32)
    c0 = connect(job, token, 0, 2, socket_path=path, arena_bytes=1 << 20)
    c1 = connect(job, token, 1, 2, socket_path=path, arena_bytes=1 << 20)
    return c0, c1


def both(c0: Communicator, c1: Communicator, op: Callable[[Communicator, int], Any]) -> list[Any]:
    """Runs ``op(comm, rank)`` on both ranks at once (rank 1 in a thread): the results, or the
    exceptions raised."""
    out: list[Any] = [None, None]

    def run(i: int, c: Communicator) -> None:
        try:
            out[i] = op(c, i)
        except Exception as exc:
            out[i] = exc

    t = threading.Thread(target=run, args=(1, c1))
    t.start()
    run(0, c0)
    t.join(60)
    assert not t.is_alive(), "rank 1 never finished its op"
    return out


def all_reduces(c0: Communicator, c1: Communicator, n: int, dtype: type) -> None:
    """``n`` all_reduces of a few elements (region ops), every result checked."""

    def op(c: Communicator, rank: int) -> None:
        for step in range(n):
            x = np.arange(16, dtype=dtype) * (rank + 1) + step
            c.all_reduce(x).wait()
            want = np.arange(16, dtype=dtype) * 3 + 2 * step
            assert np.array_equal(x, want), f"rank {rank} op {step}: {x} != {want}"

    for result in both(c0, c1, op):
        if isinstance(result, Exception):
            raise result


def victim_status(ctl_status: Callable[[str], dict[str, Any]], path: str, job: str) -> dict:
    """The victim's communicator in ``smddpctl status --json``, which must answer."""
    (comm,) = [c for c in ctl_status(path)["comms"] if c["job_id"] == job]
    return comm


def hostile_errors(h0: Communicator, h1: Communicator) -> list[str]:
    """What each hostile rank's next op raises; fails unless both raise."""

    def op(c: Communicator, rank: int) -> None:
        c.all_reduce(np.ones(16, dtype=np.float64)).wait()

    results = both(h0, h1, op)
    assert all(isinstance(r, SmddpError) for r in results), results
    return [str(r) for r in results]


def slot(comm: Communicator) -> Any:
    """The rank's own slot in the control region (mapped at its first region op), as the
    process can write it: (region view, slot index)."""
    shm = comm._region.shm
    return shm.view, shm.rank


def ctl_metrics(path: str) -> dict[str, Any]:
    """``smddpctl metrics --json`` against the daemon on ``path``, which must answer."""
    proc = subprocess.run(
        [sys.executable, "-m", "smddp.server.ctl", "--json", "--socket", path, "metrics"],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, f"smddpctl metrics failed ({proc.returncode}): {proc.stderr}"
    return json.loads(proc.stdout)


ROW_F64 = pb.ALL_REDUCE * DTYPES + pb.FLOAT64


def _start(start_daemon: Callable[..., Any], name: str, *args: str) -> tuple[Any, int]:
    d = start_daemon(args=("--http-bind", "127.0.0.1:0", *args), name=name)
    return d, d.http_port()


def _expect_named(errors: list[str], job: str, what: str) -> None:
    for e in errors:
        assert re.search(
            rf"job {job} comm 0: rank 0's {NAMED} {what} \(.*\): {FOREIGN} \(rank 0 \(pid \d+, ",
            e,
        ), e


@pytest.mark.timeout(180)
def test_b3_a_counter_going_backwards_fails_its_job_not_the_scrape(start_daemon, ctl_status):
    d, port = _start(start_daemon, "b3")
    v0, v1 = pair(d.socket, "victim")
    h0, h1 = pair(d.socket, "hostile")
    all_reduces(v0, v1, VICTIM_OPS, np.float32)
    all_reduces(h0, h1, HOSTILE_OPS, np.float64)
    before = scrape(port)
    ar64 = {"op": "all_reduce", "dtype": "float64"}
    assert value(before, "smddp_ops_total", **ar64) == HOSTILE_OPS

    # The hostile job's rank 0 takes its op count back below what the daemon has read.
    view, me = slot(h0)
    view.op_table(me)[ROW_F64, C_OPS] = 1

    for _ in range(10):  # every scrape answers (before: 10 of 10 RemoteDisconnected)
        after = scrape(port)
    ar32 = {"op": "all_reduce", "dtype": "float32"}
    assert value(after, "smddp_ops_total", **ar32) == VICTIM_OPS
    assert value(after, "smddp_ops_total", **ar64) == HOSTILE_OPS  # nothing taken, nothing added
    summary = ctl_metrics(d.socket)
    (row,) = [r for r in summary["ops"] if r["op"] == "all_reduce" and r["dtype"] == "float32"]
    assert row["count"] == VICTIM_OPS, summary

    errors = hostile_errors(h0, h1)
    print(errors[0])
    _expect_named(errors, "hostile", "went backwards")
    assert "all_reduce/float64 column 0: 5 -> 1" in errors[0], errors[0]

    # The victim runs on, right; status shows its real count; the cause is logged once.
    all_reduces(v0, v1, VICTIM_OPS, np.float32)
    comm = victim_status(ctl_status, d.socket, "victim")
    assert int(comm["ops_completed"]) == 2 * VICTIM_OPS and comm["failed"] == "", comm
    scrape(port)
    assert value(scrape(port), "smddp_ops_total", **ar32) == 2 * VICTIM_OPS
    assert d.log().count(f"{NAMED} went backwards") == 1, d.log()[-3000:]
    for c in (v0, v1, h0, h1):
        c.close()


@pytest.mark.timeout(180)
def test_b8_an_impossible_count_never_reaches_the_node_totals(start_daemon, ctl_status):
    d, port = _start(start_daemon, "b8", "--metrics-job-labels")
    v0, v1 = pair(d.socket, "victim")
    h0, h1 = pair(d.socket, "hostile")
    all_reduces(v0, v1, VICTIM_OPS, np.float32)
    all_reduces(h0, h1, HOSTILE_OPS, np.float64)

    # Not read by the daemon since the ops: it reads this with the real ones.
    view, me = slot(h0)
    view.op_table(me)[ROW_F64, C_OPS] += 2**62

    after = scrape(port)
    ar32 = {"op": "all_reduce", "dtype": "float32"}
    ar64 = {"op": "all_reduce", "dtype": "float64"}
    print("node-wide all_reduce float64 ops:", value(after, "smddp_ops_total", **ar64))
    assert value(after, "smddp_ops_total", **ar32) == VICTIM_OPS
    assert value(after, "smddp_ops_total", **ar64) <= HOSTILE_OPS  # (before: 4.6e18)
    assert value(after, "smddp_job_ops_total", job="victim", **ar32) == VICTIM_OPS
    assert value(after, "smddp_job_ops_total", job="hostile", **ar64) <= HOSTILE_OPS
    assert sum(v for (name, _), v in after.items() if name == "smddp_ops_total") <= (
        VICTIM_OPS + HOSTILE_OPS
    )

    errors = hostile_errors(h0, h1)
    print(errors[0])
    _expect_named(errors, "hostile", "advanced impossibly")

    all_reduces(v0, v1, VICTIM_OPS, np.float32)
    comm = victim_status(ctl_status, d.socket, "victim")
    assert int(comm["ops_completed"]) == 2 * VICTIM_OPS and comm["failed"] == "", comm
    later = scrape(port)
    assert value(later, "smddp_ops_total", **ar32) == 2 * VICTIM_OPS
    assert value(later, "smddp_ops_total", **ar64) <= HOSTILE_OPS
    assert d.log().count(f"{NAMED} advanced impossibly") == 1, d.log()[-3000:]
    for c in (v0, v1, h0, h1):
        c.close()


@pytest.mark.timeout(180)
def test_b2_a_negative_op_count_leaves_status_answering(start_daemon, ctl_status):
    d, port = _start(start_daemon, "b2")
    v0, v1 = pair(d.socket, "victim")
    h0, h1 = pair(d.socket, "hostile")
    all_reduces(v0, v1, VICTIM_OPS, np.float32)
    all_reduces(h0, h1, HOSTILE_OPS, np.float64)

    view, me = slot(h0)
    view.slots[me, S_OPS] = -1

    # Status answers for every job (before: "Value out of range: -1" for all of them).
    st = ctl_status(d.socket)
    by_job = {c["job_id"]: c for c in st["comms"]}
    assert set(by_job) == {"victim", "hostile"}, st
    victim = by_job["victim"]
    assert int(victim["ops_completed"]) == VICTIM_OPS and victim["failed"] == "", victim
    assert [int(r["ops_completed"]) for r in victim["ranks"]] == [VICTIM_OPS] * 2, victim
    hostile = {int(r["rank"]): int(r["ops_completed"]) for r in by_job["hostile"]["ranks"]}
    assert hostile == {0: 0, 1: HOSTILE_OPS}, by_job["hostile"]  # -1 shown as 0

    # The metrics read the count too: the hostile job fails there, the scrape answers.
    after = scrape(port)
    assert value(after, "smddp_ops_total", op="all_reduce", dtype="float32") == VICTIM_OPS
    errors = hostile_errors(h0, h1)
    print(errors[0])
    _expect_named(errors, "hostile", "went backwards")
    assert "ops it completed" in errors[0], errors[0]

    all_reduces(v0, v1, VICTIM_OPS, np.float32)
    st = ctl_status(d.socket)
    (victim,) = [c for c in st["comms"] if c["job_id"] == "victim"]
    assert int(victim["ops_completed"]) == 2 * VICTIM_OPS, victim
    (hostile_comm,) = [c for c in st["comms"] if c["job_id"] == "hostile"]
    assert FOREIGN in hostile_comm["failed"], hostile_comm
    for c in (v0, v1, h0, h1):
        c.close()


@pytest.mark.timeout(180)
def test_straggler_and_job_series_go_with_their_job(start_daemon):
    """Issue 30: ``smddp_straggler_total`` series stayed after their job ended (9 series for
    5 finished jobs, active_jobs 0); and without --metrics-job-labels no series names a job."""
    d, port = _start(start_daemon, "labels", "--metrics-job-labels")
    for i in range(5):
        c0, c1 = pair(d.socket, f"done-{i}")
        all_reduces(c0, c1, 10, np.float32)
        during = scrape(port)
        assert any(
            name == "smddp_straggler_total" and ("job", f"done-{i}") in labels
            for name, labels in during
        ), sorted(k for k in during if k[0] == "smddp_straggler_total")
        # Ops after the last scrape, read when the job ends: that read brought its straggler
        # series back after they were removed.
        all_reduces(c0, c1, 10, np.float32)
        c0.close()
        c1.close()
    deadline = time.monotonic() + 30
    while True:
        ended = scrape(port)
        named = sorted(k for k in ended if "job" in dict(k[1]))
        if value(ended, "smddp_active_jobs") == 0 and not named:
            break
        assert time.monotonic() < deadline, (value(ended, "smddp_active_jobs"), named)
        time.sleep(0.2)
    assert value(ended, "smddp_ops_total", op="all_reduce", dtype="float32") == 100
    assert ctl_metrics(d.socket)["stragglers"] == []

    # Without the flag, no series carries a job id, straggler series included.
    plain, plain_port = _start(start_daemon, "plain")
    c0, c1 = pair(plain.socket, "secret-job-name")
    all_reduces(c0, c1, 10, np.float32)
    with urllib.request.urlopen(f"http://127.0.0.1:{plain_port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    assert "secret-job-name" not in text and 'job="' not in text, text
    assert value(scrape(plain_port), "smddp_ops_total", op="all_reduce", dtype="float32") == 10
    assert ctl_metrics(plain.socket)["stragglers"] == []
    c0.close()
    c1.close()
