"""DDP training when something fails: every survivor raises, never crashes.

Three ranks train a small MLP with DistributedDataParallel (``ddp_rank.py``), started
directly so that nothing but the error ends the survivors, and then under torchrun. A rank is
SIGKILLed or raises, the system daemon is SIGKILLed or SIGTERMed, or one rank's model or
buckets differ: every survivor must raise a named SmddpBackendError (a DistBackendError)
from ``loss.backward()`` (or DDP's constructor) within BOUND_S of the failure, with the same
message as a plain collective gets, destroy its process group, and exit with status 1, not a
signal. Before, every survivor died of SIGSEGV inside ``backward()``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from ddp_launch import (
    BOUND_S,
    DEAD_RANK,
    JOB,
    NODE,
    VICTIM,
    Proc,
    failures,
    kill_all,
    launch_direct,
    launch_torchrun,
    pids,
    root_cause,
    wait_exit,
    wait_ready,
)

pytestmark = pytest.mark.slow  # every test starts three torch processes (and torchrun)


def survivors(
    procs: list[Proc], ranks: list[int], out: Path, failed_at: float | None, same_after: bool = True
) -> list[dict[str, Any]]:
    """Waits for ``ranks`` to exit; checks status 1 (not a signal), a named DistBackendError
    within BOUND_S of ``failed_at``, a working destroy_process_group and (``same_after``) the
    same message from a plain all_reduce afterwards; returns their records."""
    records = []
    for r in ranks:
        rc = wait_exit(procs[r], f"rank {r}")
        assert rc == 1, f"rank {r} exited with {rc} (negative: a signal):\n{procs[r].output()}"
        path = out / f"rank{r}-a0.json"
        assert path.exists(), f"rank {r} raised no DistBackendError:\n{procs[r].output()}"
        got = json.loads(path.read_text())
        assert got["module"] == "smddp.backend.errors", got
        assert got["destroy_s"] < 5.0, got
        if same_after:
            assert got["after"] == got["message"], got  # a plain collective says the same
        assert f"smddp.backend.errors.{got['type']}: " in procs[r].output(), procs[r].output()
        if failed_at is not None:
            took = got["failed_at"] - failed_at
            assert took < BOUND_S, f"rank {r} raised {took:.2f} s after the failure"
        records.append(got)
    return records


def victim_pid(procs: list[Proc]) -> int:
    return procs[VICTIM].proc.pid


@pytest.fixture
def env(system_daemon: Any, rank_env: Any) -> dict[str, str]:
    return rank_env(system_daemon.socket, NODE)


HOOKS = ["none", "allreduce_hook", "fp16_compress_hook", "builtin"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("hook", [*HOOKS, "funcol", "fsdp1", "fsdp2"])
def test_killed_rank(hook: str, env: dict[str, str], tmp_path: Path) -> None:
    """DDP with each comm hook; ("funcol") functional collectives, whose wait is C++'s; FSDP1
    and FSDP2, whose all_gathers and reduce_scatters run in forward and backward."""
    program = {"program": hook} if hook in ("funcol", "fsdp1", "fsdp2") else {"hook": hook}
    procs = launch_direct(env, tmp_path, **program)
    try:
        wait_ready(procs)
        time.sleep(0.5)  # a few steps in, at no particular point of one
        killed_at = time.time()
        os.kill(victim_pid(procs), signal.SIGKILL)
        got = survivors(procs, [0, 1], tmp_path, killed_at)
    finally:
        kill_all(procs)
    for g in got:
        assert g["type"] == "SmddpRankFailedError", g
        m = re.fullmatch(DEAD_RANK, g["message"])
        assert m and int(m["pid"]) == victim_pid(procs), g["message"]
    print(got[0]["message"], [round(g["failed_at"] - killed_at, 2) for g in got])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("hook", ["none", "builtin"])  # the hooks' error paths: test_killed_rank
def test_raising_rank(hook: str, env: dict[str, str], tmp_path: Path) -> None:
    procs = launch_direct(env, tmp_path, hook=hook, fail="raise", fail_step=3)
    try:
        wait_ready(procs)
        rc = wait_exit(procs[VICTIM], "the raising rank")
        assert rc == 1, (
            f"the raising rank exited with {rc} (negative: a signal):\n{procs[VICTIM].output()}"
        )
        assert "rank 2 fails on purpose at step 3" in procs[VICTIM].output(), procs[VICTIM].output()
        failed_at = next(
            float(line.split()[2]) for line in procs[VICTIM].lines if line.startswith("failing ")
        )
        # The survivors hear of it once its connection closes, as its interpreter shuts down.
        got = survivors(procs, [0, 1], tmp_path, failed_at)
    finally:
        kill_all(procs)
    for g in got:
        assert g["type"] == "SmddpRankFailedError" and re.fullmatch(DEAD_RANK, g["message"]), g
    print("after the raise:", [round(g["failed_at"] - failed_at, 2) for g in got])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_daemon_stops(sig: int, system_daemon: Any, env: dict[str, str], tmp_path: Path) -> None:
    procs = launch_direct(env, tmp_path)
    try:
        wait_ready(procs)
        time.sleep(0.5)
        stopped_at = time.time()
        system_daemon.proc.send_signal(sig)
        # The first error says how the connection ended, later ones that the daemon is gone.
        got = survivors(procs, [0, 1, 2], tmp_path, stopped_at, same_after=False)
    finally:
        kill_all(procs)
    system_daemon.proc.wait(timeout=30)
    for g in got:
        assert g["type"] == "SmddpDaemonLostError", g
        for m in (g["message"], g["after"]):
            # Names the daemon; an op in flight at a SIGTERM hears that the daemon shuts down.
            assert m.startswith(f"smddpd at {system_daemon.socket}") or (
                sig == signal.SIGTERM and re.fullmatch(f"{JOB}: smddpd is shutting down", m)
            ), g
    print([g["message"] for g in got], [round(g["failed_at"] - stopped_at, 2) for g in got])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mismatch", ["model", "hook"])
def test_mismatch(mismatch: str, env: dict[str, str], tmp_path: Path) -> None:
    procs = launch_direct(env, tmp_path, mismatch=mismatch)
    try:
        got = survivors(procs, [0, 1, 2], tmp_path, None)
    finally:
        kill_all(procs)
    for g in got:
        assert g["type"] == "SmddpMismatchError", g
        assert g["message"] == got[0]["message"]
        assert re.fullmatch(
            rf"{JOB}: rank {VICTIM} called .+ as op #\d+ while ranks 0-1 called .+", g["message"]
        ), g
    spread = max(g["failed_at"] for g in got) - min(g["failed_at"] for g in got)
    assert spread < BOUND_S, spread
    print(got[0]["message"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["raise", "SIGKILL"])
def test_under_torchrun(how: str, env: dict[str, str], tmp_path: Path) -> None:
    """torchrun ends the job and its summary names rank VICTIM as the root cause; no rank
    crashes: each survivor raised SmddpRankFailedError or was ended by torchrun's SIGTERM."""
    run = launch_torchrun(env, tmp_path, fail="raise" if how == "raise" else "none", fail_step=3)
    try:
        if how == "SIGKILL":
            wait_ready([run])
            deadline = time.monotonic() + 60
            while len(pids(run)) < 3 or sum(line.startswith("ready ") for line in run.lines) < 3:
                assert time.monotonic() < deadline and run.proc.poll() is None, run.output()
                time.sleep(0.1)
            time.sleep(0.5)
            os.kill(pids(run)[VICTIM], signal.SIGKILL)
        rc = wait_exit(run, "torchrun", timeout_s=120)
    finally:
        kill_all([run])
    out = run.output()
    assert rc == 1, out
    cause = root_cause(out)
    assert cause["rank"] == f"{VICTIM} (local_rank: {VICTIM})", out
    assert cause["exitcode"].startswith("1 " if how == "raise" else "-9 "), out
    assert "Segmentation fault" not in out and "SIGSEGV" not in out, out
    for rank, code in failures(out).items():
        if rank != VICTIM:
            assert code.startswith(("1 ", "-15 ")), f"rank {rank}: {code}\n{out}"
            if code.startswith("1 "):
                got = json.loads((tmp_path / f"rank{rank}-a0.json").read_text())
                assert got["type"] == "SmddpRankFailedError" and re.fullmatch(
                    DEAD_RANK, got["message"]
                ), got
    print(how, {r: c for r, c in failures(out).items()})
