"""torchrun SIGKILLed while its ranks run on the job's embedded smddpd.

The ranks outlive torchrun (they are its children, not killed with it); the embedded daemon
watches the launcher (``--launcher-pid``, the parent of the rank that started it), exits once
it is gone, and says so in its log; the ranks, waiting in barriers, then lose their daemon and
end. Before, the daemon and both ranks ran on with nobody to stop them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

STARTED = re.compile(r"started an embedded daemon for this job on (\S+) \(pid (\d+)\)")

# Each rank: joins the smddp world, writes its pid, then barriers until something ends it.
RANK = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import smddp  # noqa: F401  (registers the backend)
torch.set_num_threads(1)
dist.init_process_group("smddp", timeout=timedelta(seconds=60))
rank = dist.get_rank()
with open(os.path.join(sys.argv[1], f"rank{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
while True:
    dist.barrier()
    time.sleep(0.05)
"""


def _gone(pid: int) -> bool:
    """True when ``pid`` has exited (a zombie counts: dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


@pytest.mark.timeout(300)
def test_the_embedded_daemon_and_the_ranks_end_when_torchrun_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    # No daemon answers at SMDDP_SOCKET: local rank 0 starts an embedded one.
    env = dict(os.environ, SMDDP_SOCKET=str(tmp_path / "none.sock"), SMDDP_NODE_ID="node-a")
    env.pop("SMDDP_EMBEDDED", None)
    env["SMDDP_EMBEDDED_LOG_LEVEL"] = "INFO"
    output = tmp_path / "torchrun.log"
    with open(output, "wb") as out:
        torchrun = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                # Else torchrun makes /tmp/torchelastic_* for its logs and never removes it.
                "--log-dir",
                str(tmp_path / "torchrun-logs"),
                str(script),
                str(tmp_path),
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    pids: list[int] = []
    daemon_pid = 0
    try:
        pid_files = [tmp_path / f"rank{r}.pid" for r in range(2)]
        started = _wait(lambda: all(p.exists() and p.read_text() for p in pid_files), 150)
        text = output.read_text(errors="replace")
        assert started and torchrun.poll() is None, text
        pids = [int(p.read_text()) for p in pid_files]
        match = STARTED.search(text)
        assert match, text
        daemon_pid = int(match[2])
        time.sleep(1)  # a few barriers through the daemon
        assert not _gone(daemon_pid) and not any(_gone(p) for p in pids), text

        torchrun.kill()
        torchrun.wait(timeout=30)
        assert _wait(lambda: _gone(daemon_pid), 30), (
            f"the embedded smddpd (pid {daemon_pid}) still runs 30 s after torchrun was "
            f"SIGKILLed:\n{output.read_text(errors='replace')}"
        )
        assert _wait(lambda: all(_gone(p) for p in pids), 60), (
            f"ranks {[p for p in pids if not _gone(p)]} still run 60 s after their embedded "
            f"daemon exited:\n{output.read_text(errors='replace')}"
        )
        text = output.read_text(errors="replace")
        assert (
            f"the launcher (pid {torchrun.pid}) of the job that started this embedded smddpd "
            "has gone; exiting" in text
        ), text
        # Each rank ended on the daemon's loss (the backend's SmddpDaemonLostError).
        lost = set(re.findall(r"^\[rank(\d)\]: \S*DaemonLostError: ", text, re.M))
        assert lost == {"0", "1"}, text
    finally:
        if torchrun.poll() is None:
            torchrun.kill()
            torchrun.wait()
        for pid in [*pids, daemon_pid]:
            if pid and not _gone(pid):
                os.kill(pid, signal.SIGKILL)
