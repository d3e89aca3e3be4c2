"""Who sees which jobs in ``smddpctl status`` and ``metrics``, and in /metrics.

gRPC on a unix socket does not tell the daemon who calls; its data socket does
(SO_PEERCRED), so smddpctl asks there. A user sees their own jobs only; root, the daemon's
own uid and members of ``--admin-group`` see every job. With ``--socket-group`` other users
reach the gRPC socket too, so gRPC Status is refused there and gRPC Metrics leaves out every
job's series. /metrics, which the operator binds where they like, names jobs only with
``--metrics-job-labels``.

Before: any user of the socket group saw every job's id, ranks, pids and node in
``smddpctl status``, and /metrics named every job in its straggler labels.
"""

from __future__ import annotations

import json
import secrets
import threading
import urllib.request
from typing import Any

import grpc
import numpy as np
import pytest
from test_security import GROUP, as_nobody, open_dir, other_user, stub

from smddp.client import connect
from smddp.server.ctl import ask_status
from smddp.v1 import smddp_pb2 as pb

__all__ = ["open_dir", "other_user"]  # fixtures, used by name

# Run as uid 65534: a two-rank job of its own, then what smddpctl status --json and
# smddpctl metrics --raw print for it, one JSON string a line.
NOBODY_LOOKS = r"""
import contextlib, io, json, secrets, sys, threading
import numpy as np
from smddp.client import connect
from smddp.server import ctl
path = sys.argv[1]
token = secrets.token_bytes(32)
c0 = connect("nobodyjob", token, 0, 2, socket_path=path, arena_bytes=1 << 20)
c1 = connect("nobodyjob", token, 1, 2, socket_path=path, arena_bytes=1 << 20)
for _ in range(3):
    a, b = np.ones(8), np.ones(8)
    t = threading.Thread(target=lambda: c1.all_reduce(b).wait())
    t.start()
    c0.all_reduce(a).wait()
    t.join()
for args in (["--json", "--socket", path, "status"], ["metrics", "--raw", "--socket", path]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ctl.main(args)
    print(json.dumps(out.getvalue()))
c0.close()
c1.close()
"""


def nobody_looks(path: str) -> tuple[list[str], str]:
    """Runs NOBODY_LOOKS: the job ids its status lists and its metrics text."""
    proc = as_nobody(NOBODY_LOOKS, path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status_text, metrics_text = (json.loads(line) for line in proc.stdout.splitlines())
    return [c["job_id"] for c in json.loads(status_text)["comms"]], metrics_text


def root_job(path: str) -> tuple[Any, Any]:
    """A two-rank job of root's, after three all_reduces."""
    token = secrets.token_bytes(32)
    c0 = connect("rootjob", token, 0, 2, socket_path=path, arena_bytes=1 << 20)
    c1 = connect("rootjob", token, 1, 2, socket_path=path, arena_bytes=1 << 20)
    for _ in range(3):
        a, b = np.ones(8), np.ones(8)
        t = threading.Thread(target=lambda x=b: c1.all_reduce(x).wait())
        t.start()
        c0.all_reduce(a).wait()
        t.join(30)
    return c0, c1


def http_metrics(d: Any) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.http_port()}/metrics", timeout=30) as r:
        return r.read().decode()


@pytest.mark.timeout(120)
def test_a_user_sees_only_their_own_jobs(daemon_at, open_dir, other_user):
    path = str(open_dir / "run" / "smddpd.sock")
    d = daemon_at(
        path,
        ("--socket-group", GROUP, "--metrics-job-labels", "--http-bind", "127.0.0.1:0"),
    )
    c0, c1 = root_job(path)

    jobs, metrics = nobody_looks(path)
    print("uid 65534 sees", jobs)
    assert jobs == ["nobodyjob"], jobs
    assert 'job="nobodyjob"' in metrics and "rootjob" not in metrics, metrics
    assert 'smddp_ops_total{dtype="float64",op="all_reduce"}' in metrics, metrics

    # Root asks the same way; the nobody job has ended by now, so root's job alone shows.
    assert [c.job_id for c in ask_status(path).comms] == ["rootjob"]
    # gRPC cannot tell who calls: with the socket shared, it shows nobody any job.
    with pytest.raises(grpc.RpcError) as info:
        stub(path).Status(pb.StatusRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value
    assert "data socket" in (info.value.details() or ""), info.value.details()
    grpc_metrics = stub(path).Metrics(pb.MetricsRequest(), timeout=10).exposition
    assert 'job="' not in grpc_metrics and "smddp_ops_total" in grpc_metrics, grpc_metrics
    # /metrics is the operator's (bound where they say, loopback by default), and they asked
    # for job labels: it names both.
    text = http_metrics(d)
    assert 'job="rootjob"' in text and 'job="nobodyjob"' not in text  # nobodyjob ended
    c0.close()
    c1.close()


@pytest.mark.timeout(120)
def test_the_admin_group_sees_every_job(daemon_at, open_dir, other_user):
    path = str(open_dir / "run" / "smddpd.sock")
    daemon_at(path, ("--socket-group", GROUP, "--admin-group", GROUP, "--metrics-job-labels"))
    c0, c1 = root_job(path)
    jobs, metrics = nobody_looks(path)
    print("uid 65534 in the admin group sees", jobs)
    assert sorted(jobs) == ["nobodyjob", "rootjob"], jobs
    assert 'job="rootjob"' in metrics and 'job="nobodyjob"' in metrics, metrics
    c0.close()
    c1.close()
