"""Launching ``ddp_rank.py`` for the DDP failure tests: directly (one process per rank, env://)
or under torchrun; following each process's output; reading torchrun's error summary.

Not a test module: ``test_ddp_failures.py`` and ``test_torchrun_restart.py`` import it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from ports import free_port

HERE = Path(__file__).resolve().parent
RANK_MAIN = HERE / "ddp_rank.py"
WORLD = 3
VICTIM = 2
BOUND_S = 5.0
NODE = "node-a"
JOB = r"job j[0-9a-f]{16} comm 0"
DEAD_RANK = (
    rf"{JOB}: rank {VICTIM} \(pid (?P<pid>\d+), node {NODE}\) disconnected without leaving the "
    r"communicator "
    r"\((connection closed|connection error: \[Errno 104\] Connection reset by peer)\); "
    r"its process died or closed its connection"
)


@dataclass
class Proc:
    """A rank (or torchrun) process, its output lines and when each came."""

    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)

    def pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = re.sub(r"^\[rank\d+\]:", "", line)  # torchrun's prefix on a worker's output
            self.lines.append(line.rstrip("\n"))
            if line.startswith("ready "):
                self.ready.set()
        self.ready.set()  # ended: whoever waits must look at the exit status

    def text(self) -> str:
        """All its output so far, to parse (``output`` is cut to a failure message's size)."""
        return "\n".join(self.lines)

    def output(self) -> str:
        """The last 6000 characters of its output, for a failure message."""
        return self.text()[-6000:]


def start(cmd: list[str], env: dict[str, str]) -> Proc:
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
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
        start(
            [sys.executable, str(RANK_MAIN), arg],
            dict(
                env,
                RANK=str(r),
                WORLD_SIZE=str(WORLD),
                LOCAL_RANK=str(r),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            ),
        )
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


def launch_torchrun(env: dict[str, str], out: Path, *extra: str, **spec: Any) -> Proc:
    """torchrun --standalone with WORLD local ranks of ``ddp_rank.py`` (``extra``: more
    torchrun flags, such as ``--max-restarts 1``); its log folder goes under ``out``."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(WORLD),
        # Else torchrun makes /tmp/torchelastic_* for its logs and never removes it.
        "--log-dir",
        str(out / "torchrun-logs"),
        *extra,
        str(RANK_MAIN),
        spec_arg(out, **spec),
    ]
    return start(cmd, env)


def pids(p: Proc, attempt_lines_after: int = 0) -> dict[int, int]:
    """Rank -> pid from the ``pid RANK PID`` lines printed so far (from line
    ``attempt_lines_after``)."""
    found = {}
    for line in p.lines[attempt_lines_after:]:
        m = re.fullmatch(r"pid (\d+) (\d+)", line)
        if m:
            found[int(m[1])] = int(m[2])
    return found


def root_cause(output: str) -> dict[str, str]:
    """The fields of torchrun's "Root Cause (first observed failure)" section."""
    assert "Root Cause (first observed failure):" in output, output
    section = output.split("Root Cause (first observed failure):", 1)[1]
    fields = {}
    for line in section.splitlines()[2:]:
        m = re.match(r"\s+(\w+)\s+: (.*)", line)
        if not m:
            break
        fields[m[1]] = m[2]
    return fields


def failures(output: str) -> dict[int, str]:
    """Rank -> exit code text of every failure torchrun's summary lists (root cause included)."""
    got = {}
    for rank, code in re.findall(
        r"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: (.+)", output
    ):
        got[int(rank)] = code
    return got
