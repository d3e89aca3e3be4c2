"""Jobs that end badly leave the daemon holding nothing of them.

Against a real smddpd, 50 small jobs of two numpy ranks end in every hostile way a rank can
end: SIGKILLed while it waits in an op (in the control region, and at the daemon with an
eager send held there), a decreasing op counter written into its slot of the region just
before it leaves (cleanly, or by SIGKILL without deregistering; the daemon's close of the
communicator used to stop at the metrics it could not add, and kept the region, the arenas
and the data-socket connection), exiting without deregistering, and closing its data socket
in the middle of its attach (with its AttachRequest sent, or before it). Every surviving rank
gets a named error. Afterwards the daemon's file descriptors, memfds, shared memory and
threads must come back to what they were before the jobs.

The ranks are forked from one launcher process that imported the client once, which keeps
100 ranks within seconds on a loaded 2-core machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
from conftest import make_rank_env

pytestmark = pytest.mark.timeout(300)

JOBS = 50
# --attach-timeout-s of the daemon: a rank that connects and sends nothing is dropped then.
ATTACH_TIMEOUT_S = 2.0
# How long the daemon has to release everything once the last job ended.
SETTLE_S = 30.0

# Reads "JOB MODE" lines; for each, forks the job's two ranks, waits for them and prints
# "JOB RC0 RC1" (a rank killed by SIGKILL: -9). A surviving rank exits 0 only after it got a
# named error (an SmddpError naming rank 1 where rank 1 is the one that went).
LAUNCHER = r"""
import dataclasses, os, signal, socket, sys, time, traceback
import grpc
import numpy as np
from smddp.client import connect
from smddp.client.arena import ClientArena
from smddp.client.config import ClientConfig
from smddp.client.errors import SmddpError
from smddp.core.region import C_OPS
from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc
from smddp.core.wire import DATA_SOCKET_SUFFIX, MSG_ATTACH, pack

PATH = sys.argv[1]
ARENA = 1 << 20
SURVIVED = 0
NO_ERROR = 3


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def ops(comm, n=3):
    x = np.ones(1000, dtype=np.float64)
    for _ in range(n):
        comm.all_reduce(x).wait()


def until_error(comm, who):
    # The survivor's ops fail, each naming the rank that went (the first may still complete
    # when the other rank published its part before it died).
    x = np.ones(1000, dtype=np.float64)
    for _ in range(20):
        try:
            comm.all_reduce(x).wait()
        except SmddpError as exc:
            if who not in str(exc):
                print(f"the error does not name {who}: {exc}", file=sys.stderr, flush=True)
                return NO_ERROR
            return SURVIVED
    print("no error after the other rank went", file=sys.stderr, flush=True)
    return NO_ERROR


def bad_counter(comm):
    # The B4 trigger: the op counters of this rank's slot go backwards just before it leaves.
    region = comm._region
    region.shm.view.op_table(region.rank)[:, C_OPS] = -7


def rank_main(job, token, rank, mode):
    if mode == "attach-abort" and rank == 1 or mode == "attach-silent" and rank == 1:
        node = pb_grpc.NodeStub(grpc.insecure_channel("unix:" + PATH))
        reg = node.Register(
            pb.RegisterRequest(
                job_id=job, job_token=token, comm_id="0", rank=1, world_size=2,
                node_id="node-a", pid=os.getpid(), arena_bytes=ARENA, timeout_ms=30000,
            ),
            timeout=10,
        )
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(PATH + DATA_SOCKET_SUFFIX)
        if mode == "attach-abort":
            arena = ClientArena(ARENA)
            req = pb.AttachRequest(session_id=reg.session_id, session_secret=reg.session_secret)
            socket.send_fds(s, [pack(MSG_ATTACH, req.SerializeToString())], [arena.fd])
        s.close()  # before the AttachReply (or before the AttachRequest)
        os._exit(SURVIVED)
    config = ClientConfig.from_env()
    if mode == "kill-daemon":
        config = dataclasses.replace(config, region=False)
    comm = connect(job, token, rank, 2, socket_path=PATH, timeout_s=30, arena_bytes=ARENA,
                   config=config)
    if mode in ("attach-abort", "attach-silent"):
        return until_error(comm, "rank 1")
    ops(comm)
    if mode == "kill-region":
        if rank == 1:
            # Killed with its op published in the region, before rank 0 arrives (killed by a
            # timer while it waited, it finished the op first whenever the timer ran late).
            comm.all_reduce(np.ones(1000))
            die()
        time.sleep(0.3)
        return until_error(comm, "rank 1")
    if mode == "kill-daemon":
        if rank == 1:
            # An eager send the daemon holds for rank 0, then an op the daemon holds too.
            comm.send(np.ones(5000), 0).wait()
            comm.all_reduce(np.ones(1000))
            die()
        time.sleep(0.3)
        return until_error(comm, "rank 1")
    if mode == "bad-counter":
        bad_counter(comm)
        comm.close()
        return SURVIVED
    if mode == "bad-counter-kill":
        bad_counter(comm)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "no-deregister":
        os._exit(SURVIVED)
    raise SystemExit(f"unknown mode {mode}")


for line in sys.stdin:
    job, mode = line.split()
    token = os.urandom(16)
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            code = 2
            try:
                code = rank_main(job, token, rank, mode)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    print(job, *codes, flush=True)
"""

# What each mode's ranks exit with: 0 survived (with a named error where one was due),
# -9 killed.
MODES = {
    "kill-region": (0, -9),
    "kill-daemon": (0, -9),
    "bad-counter": (0, 0),
    "bad-counter-kill": (-9, -9),
    "no-deregister": (0, 0),
    "attach-abort": (0, 0),
    "attach-silent": (0, 0),
}
# The order the jobs take their modes in, over and over: the ones that wait (for the kill,
# or for --attach-timeout-s) less often than the rest.
CYCLE = (
    "kill-region",
    "bad-counter-kill",
    "kill-daemon",
    "no-deregister",
    "bad-counter",
    "kill-region",
    "attach-abort",
    "bad-counter-kill",
    "kill-daemon",
    "attach-silent",
)


@dataclass(frozen=True)
class Held:
    """What the daemon holds, from /proc."""

    fds: int
    memfds: int  # descriptors of memfds (arenas, control regions)
    memfd_bytes: int  # the size of every memfd it keeps alive, by descriptor or mapping
    threads: int

    def __str__(self) -> str:
        return (
            f"{self.fds} fds, {self.memfds} memfds, {self.memfd_bytes >> 10} KiB of memfds "
            f"open or mapped, {self.threads} threads"
        )


def held(pid: int) -> Held:
    """The daemon's descriptors, memfds, threads and shared memory now.

    Shared memory is counted as the size of the memfds the daemon keeps alive (the kernel
    frees one once no descriptor and no mapping is left): the ranks touched their pages, so
    that is what the node's Shmem loses. /proc/PID/status RssShmem would count only the
    pages the daemon itself touched, and lags (the kernel updates it in batches).
    """
    fds = memfds = memfd_bytes = 0
    inodes: set[int] = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{name}"
        try:
            target = os.readlink(path)
            st = os.stat(path)
        except FileNotFoundError:
            continue  # closed while we looked
        fds += 1
        if target.startswith("/memfd:"):
            memfds += 1
            if st.st_ino not in inodes:
                inodes.add(st.st_ino)
                memfd_bytes += st.st_size
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/memfd:"):
                inode = int(fields[4])
                if inode not in inodes:  # a mapping whose descriptor was closed
                    inodes.add(inode)
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    memfd_bytes += end - start
    return Held(fds, memfds, memfd_bytes, len(os.listdir(f"/proc/{pid}/task")))


def wait_back(pid: int, ok, timeout_s: float) -> Held:
    """Polls ``held(pid)`` until ``ok`` says it is back, or ``timeout_s`` passed; returns
    the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = held(pid)
        if ok(now) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def run_jobs(launcher: subprocess.Popen, names: list[tuple[str, str]]) -> list[str]:
    """Runs the jobs one after another; returns what went wrong with their ranks' exits."""
    wrong = []
    assert launcher.stdin is not None and launcher.stdout is not None
    for job, mode in names:
        launcher.stdin.write(f"{job} {mode}\n")
        launcher.stdin.flush()
        line = launcher.stdout.readline().split()
        assert line, f"the launcher ended at job {job} ({mode})"
        codes = tuple(int(c) for c in line[1:])
        if line[0] != job or codes != MODES[mode]:
            wrong.append(f"{job} ({mode}): ranks exited {codes}, expected {MODES[mode]}")
    return wrong


def test_fifty_jobs_ending_badly_leave_nothing_held(start_daemon, tmp_path):
    d = start_daemon(args=("--attach-timeout-s", str(ATTACH_TIMEOUT_S)), name="exits")
    pid = d.proc.pid
    before = held(pid)
    with open(tmp_path / "ranks.log", "w") as ranks_stderr:
        launcher = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, d.socket],
            env=make_rank_env(d.socket),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=ranks_stderr,
            text=True,
        )
    try:
        # One job of each kind first: the gRPC server's thread pool grows to what the jobs
        # call at once and keeps its threads (ThreadPoolExecutor never shrinks).
        wrong = run_jobs(launcher, [(f"warm-{i}", mode) for i, mode in enumerate(MODES)])
        warm = wait_back(pid, lambda h: h.memfds == 0, SETTLE_S)
        started = time.monotonic()
        wrong += run_jobs(launcher, [(f"job-{i}", CYCLE[i % len(CYCLE)]) for i in range(JOBS)])
        took = time.monotonic() - started
    finally:
        assert launcher.stdin is not None
        launcher.stdin.close()
        launcher.wait(30)
    ranks_log = (tmp_path / "ranks.log").read_text()
    assert not wrong, "\n".join(wrong) + f"\nranks' stderr:\n{ranks_log[-4000:]}"
    assert d.proc.poll() is None, f"smddpd died:\n{d.log()[-4000:]}"

    def back(h: Held) -> bool:
        return (
            h.fds <= before.fds
            and h.memfds == 0
            and h.memfd_bytes == 0
            and h.threads <= warm.threads
        )

    after = wait_back(pid, back, SETTLE_S)
    assert back(after), (
        f"after {JOBS} jobs ending badly ({took:.0f} s) the daemon holds {after}; before the "
        f"jobs it held {before}, after the first {len(MODES)} {warm}\n{d.log()[-6000:]}"
    )
