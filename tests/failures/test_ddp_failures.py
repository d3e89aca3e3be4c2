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
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
RANK_MAIN = HERE / "ddp_rank.py"
WORLD = 3
VICTIM = 2
BOUND_S = 5.0
NODE = "node-a"
JOB = r"job j[0-9a-f]{16} comm 0"
DEAD_RANK = (
    rf"{JOB}: rank {VICTIM} \(pid (?P<pid>\d+), node {NODE}\) disconnected without leaving the communicator "
    r"\((connection closed|connection error: \[Errno 104\] Connection reset by peer)\); "
    r"its process died or closed its connection"
)


def free_port() -> int:
    """A TCP port nothing listens on right now, for MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    """A rank (or torchrun) process, its output lines and when each came."""

    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)

    def pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.strip().endswith("ready"):
                self.ready.set()
        self.ready.set()  # ended: whoever waits must look at the exit status

    def output(self) -> str:
        return "\n".join(self.lines)[-6000:]


def start(cmd: list[str], env: dict[str, str]) -> Proc:
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    p = Proc(proc)
    threading.Thread(target=p.pump, daemon=True).start()
    return p


def spec_arg(out: Path, **spec: Any) -> str:
    return json.dumps({"out": str(out), "victim": VICTIM, "fail": "none", "hook": "none", **spec})


def launch_direct(env: dict[str, str], out: Path, **spec: Any) -> list[Proc]:
    """WORLD ranks of ``ddp_rank.py``, each a process of its own, env:// rendezvous."""
    port = str(free_port())
    arg = spec_arg(out, **spec)
    return [
        start([sys.executable, str(RANK_MAIN), arg],
              dict(env, RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port))
        for r in range(WORLD)
    ]


def wait_ready(procs: list[Proc], timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    for i, p in enumerate(procs):
        if not p.ready.wait(max(0.0, deadline - time.monotonic())) or p.proc.poll() is not None:
            kill_all(procs)
            pytest.fail(f"rank {i} never trained a step:\n{p.output()}")


def kill_all(procs: list[Proc]) -> None:
    for p in procs:
        if p.proc.poll() is None:
            os.killpg(p.proc.pid, signal.SIGKILL)
            p.proc.wait()


def wait_exit(p: Proc, what: str, timeout_s: float = 60.0) -> int:
    try:
        return p.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.proc.pid, signal.SIGKILL)
        p.proc.wait()
        pytest.fail(f"{what} did not end within {timeout_s} s:\n{p.output()}")


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
@pytest.mark.parametrize("hook", HOOKS)
def test_killed_rank(hook: str, env: dict[str, str], tmp_path: Path) -> None:
    procs = launch_direct(env, tmp_path, hook=hook)
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
@pytest.mark.parametrize("hook", HOOKS)
def test_raising_rank(hook: str, env: dict[str, str], tmp_path: Path) -> None:
    procs = launch_direct(env, tmp_path, hook=hook, fail="raise", fail_step=3)
    try:
        wait_ready(procs)
        rc = wait_exit(procs[VICTIM], "the raising rank")
        failed_at = time.time()  # the survivors hear of it once its process is gone
        assert rc == 1 and "rank 2 fails on purpose at step 3" in procs[VICTIM].output()
        got = survivors(procs, [0, 1], tmp_path, failed_at)
    finally:
        kill_all(procs)
    for g in got:
        assert g["type"] == "SmddpRankFailedError" and re.fullmatch(DEAD_RANK, g["message"]), g


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
            assert m.startswith(f"smddpd at {system_daemon.socket}"), g  # names the daemon
    print([g["message"] for g in got])


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
        assert re.fullmatch(rf"{JOB}: rank {VICTIM} called .+ as op #\d+ while ranks 0-1 called .+", g["message"]), g
    spread = max(g["failed_at"] for g in got) - min(g["failed_at"] for g in got)
    assert spread < BOUND_S, spread
    print(got[0]["message"])
