"""torchrun ``--max-restarts 1`` after a rank raised: the restarted job runs.

torchrun keeps its store across attempts; smddp's keys carry the attempt, so the restarted
ranks agree on a new job and start a new embedded daemon instead of looking for the old
one's socket. Before, 0 of 3 runs recovered ("no smddpd socket found (looked at
/tmp/smddp-job-<old>/smddpd.sock)"). Also: folders that SIGKILLed embedded daemons leave
behind are removed by the next embedded start, and nothing else is.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ddp_launch import VICTIM, WORLD, kill_all, launch_torchrun, wait_exit

RUNS = 3
STEPS = 8
STARTED = re.compile(r"started an embedded daemon for this job on (\S+) \(pid (\d+)\)")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # a zombie: dead, not yet reaped
    except FileNotFoundError:
        return True


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_restart_recovers(tmp_path: Path) -> None:
    # No daemon answers at SMDDP_SOCKET: each attempt's local leader starts an embedded one.
    env = dict(os.environ, SMDDP_SOCKET=str(tmp_path / "none.sock"), SMDDP_NODE_ID="node-a")
    env.pop("SMDDP_EMBEDDED", None)
    recovered = []
    for run_no in range(RUNS):
        out = tmp_path / f"run{run_no}"
        out.mkdir()
        run = launch_torchrun(
            env,
            out,
            "--max-restarts",
            "1",
            fail="raise",
            fail_step=3,
            first_attempt_only=True,
            steps=STEPS,
        )
        try:
            rc = wait_exit(run, f"run {run_no}", timeout_s=170)
        finally:
            kill_all([run])
        # All of it: attempt 0's lines (its failure, its daemon) come first, and a long output
        # (warnings, a traceback) would push them out of the last 6000 characters.
        text = run.text()
        assert rc == 0, f"run {run_no} did not recover:\n{run.output()}"
        # Attempt 0 failed on purpose; attempt 1 trained every step on every rank, in step.
        failed_at = [float(m[1]) for m in re.finditer(rf"^failing {VICTIM} ([\d.]+)$", text, re.M)]
        assert len(failed_at) == 1, run.output()
        ready = {
            int(m[1]): float(m[2]) for m in re.finditer(r"^ready (\d+) 1 ([\d.]+)$", text, re.M)
        }
        assert sorted(ready) == list(range(WORLD)), run.output()
        records = [json.loads((out / f"rank{r}-a1.json").read_text()) for r in range(WORLD)]
        for got in records:
            assert got["steps"] == STEPS and "type" not in got, got
            assert got["params"] == records[0]["params"], "the ranks' models differ after training"
        # Each attempt had an embedded daemon of its own; both are gone, folders and all.
        daemons = STARTED.findall(text)
        assert len(daemons) == 2 and daemons[0][0] != daemons[1][0], run.output()
        deadline = time.monotonic() + 30
        while not all(
            _gone(int(pid)) and not os.path.exists(os.path.dirname(path)) for path, pid in daemons
        ):
            assert time.monotonic() < deadline, f"an embedded daemon outlived its job: {daemons}"
            time.sleep(0.2)
        recovered.append(max(ready.values()) - failed_at[0])
    print(
        f"recovered {len(recovered)}/{RUNS}; failure to every rank's first step of attempt 1: "
        + ", ".join(f"{s:.1f} s" for s in recovered)
    )


def _dead_socket(path: Path) -> None:
    """A unix socket file nothing listens on (what a SIGKILLed daemon leaves)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))


@pytest.mark.timeout(60)
def test_stale_folders_cleaned(tmp_path: Path) -> None:
    from smddp.client.embedded import FOLDER_PREFIX, clean_stale_folders

    def folder(name: str) -> Path:
        f = tmp_path / (FOLDER_PREFIX + name)
        f.mkdir(mode=0o700)
        return f

    old = time.time() - 3600
    stale = folder("dead")
    for name in ("smddpd.sock", "smddpd.sock.data"):
        _dead_socket(stale / name)
        os.utime(stale / name, (old, old))
    never_bound = folder("never-bound")
    os.utime(never_bound, (old, old))
    starting = folder("starting")  # young, no socket yet: a daemon may be starting
    young_dead = folder("young")  # refused, but too young to tell from one between bind and listen
    _dead_socket(young_dead / "smddpd.sock")
    live = folder("live")  # its gRPC socket is dead, its data socket still listens
    _dead_socket(live / "smddpd.sock")
    os.utime(live / "smddpd.sock", (old, old))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(live / "smddpd.sock.data"))
    listener.listen()
    crowded = folder("crowded")
    _dead_socket(crowded / "smddpd.sock")
    os.utime(crowded / "smddpd.sock", (old, old))
    (crowded / "notes.txt").write_text("not the daemon's")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / (FOLDER_PREFIX + "link")).symlink_to(target)
    others = []
    if os.getuid() == 0:  # CI runs as root: a folder of another user must survive
        theirs = folder("theirs")
        _dead_socket(theirs / "smddpd.sock")
        os.utime(theirs / "smddpd.sock", (old, old))
        os.chown(theirs, 65534, 65534)
        others.append(theirs)
    try:
        removed = clean_stale_folders(str(tmp_path))
        assert sorted(removed) == sorted([str(stale), str(never_bound)])
        for kept in [starting, young_dead, live, crowded, target, *others]:
            assert kept.exists(), kept
        # Once older than the grace, a refused socket counts as dead; "starting" is still young.
        assert clean_stale_folders(str(tmp_path), now=time.time() + 10) == [str(young_dead)]
        assert starting.exists() and live.exists() and not young_dead.exists()
    finally:
        listener.close()


@pytest.mark.timeout(120)
def test_sigkilled_embedded_daemon_folder_removed(tmp_path: Path) -> None:
    """A real embedded daemon, SIGKILLed: its folder stays until the next clean-up."""
    code = (
        "import os, sys; from smddp.client.embedded import start_embedded_daemon; "
        "print(start_embedded_daemon(), flush=True); sys.stdin.readline()"
    )
    env = dict(os.environ)
    env.pop("SMDDP_SOCKET", None)
    owner = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None
        path = owner.stdout.readline().strip()
        assert path.endswith("/smddpd.sock"), (
            owner.stderr.read() if owner.poll() is not None else path
        )
        m = re.search(rf"on {re.escape(path)} \(pid (\d+)\)", owner.stderr.readline())
        assert m, "the embedded daemon's start was not logged"
        os.kill(int(m[1]), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not _gone(int(m[1])):
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        owner.kill()
        owner.wait()
    folder = os.path.dirname(path)
    assert os.listdir(folder)  # SIGKILL: the daemon could not remove its sockets
    from smddp.client.embedded import _listening, clean_stale_folders

    # A SIGKILLed thread group's leader reads as a zombie while its other threads (gRPC's
    # pool) are still being torn down; their shared fds, the listening sockets among them,
    # close only when the last one is gone. Until then the socket rightly counts as live.
    deadline = time.monotonic() + 30
    while any(_listening(os.path.join(folder, name)) for name in os.listdir(folder)):
        assert time.monotonic() < deadline, "the killed daemon's sockets still accept connections"
        time.sleep(0.1)

    assert folder in clean_stale_folders(now=time.time() + 10)
    assert not os.path.exists(folder)
