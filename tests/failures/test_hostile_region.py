"""A rank of a job writes what it likes into its communicator's control region; the daemon
reads the region as untrusted input.

Each test is one break a red team found (issue 31), against a real daemon: a hostile job
holds its region (the memfd the daemon hands its ranks) and attacks it while a victim job
of two numpy ranks runs all_reduces beside it, checking every result. After the attack the
daemon is alive, health says SERVING, ``smddpctl status`` answers, the victim finishes with
right results and a new job runs; the hostile job itself ends in a named error, fast.

- B1: ``ftruncate(region_fd, 0)`` made the daemon's next read a SIGBUS (every job on the node
  lost its daemon). The region is sealed against resizing: the rank is refused (EPERM).
- B5: a slot error kind of 2**40 with an op pending at the daemon raised ``ValueError`` in
  the watchdog thread, which died: later jobs were no longer timed out.
- B6: a slot error length of 2**40 made a log line of the whole region (data buffers
  included) and a reply too large to send, so the waiting rank hung until it gave up.
- B7: a rank that set the header's failed flag and then died left the survivor waiting 35 s
  for "smddpd did not answer in time" instead of the rank-failed error.
- B9: a rank that claimed pid 1 at Register was named pid 1 in timeouts, logs and status.
- B10: a rank that rewrote the header's world size made a peer mapping the region later
  raise a bare ``IndexError``.
- Op words: any sequence number, signature and arrival time in a slot; an arrival time in the
  future used to keep the daemon from ever timing the op out.
- The header's failure words set by a rank, with any kind and length: a waiting rank raises
  an error of a known kind with a message of bounded length (it used to read the length word
  as is: a message of the whole region).
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from test_limits import SERVING, _attach, node_health, pair_all_reduce, register, stub

from smddp.client.arena import ClientArena
from smddp.client.config import ClientConfig
from smddp.client.errors import DaemonLostError, OpError
from smddp.client.shm import ShmPath
from smddp.core.region import (
    DATA_OFFSET,
    ERR_MSG_MAX,
    ERR_MSG_OFFSET,
    FAIL_MSG_MAX,
    G_ARRIVAL,
    G_COUNT,
    G_DTYPE,
    G_KIND,
    G_OP,
    G_ROOT,
    G_SEQ,
    H_ALARM,
    H_FAIL_KIND,
    H_FAIL_LEN,
    H_FAILED,
    H_WORLD,
    HEADER_BYTES,
    S_ERR_KIND,
    S_ERR_LEN,
    S_OPS,
    S_SEQ,
    S_STATE,
    SIG_WORD,
    STATE_FAILED,
    futex_wake,
)
from smddp.core.wire import (
    MAX_MESSAGE_BYTES,
    MSG_OP,
    MSG_OP_REPLY,
    MSG_PEER_ARENAS,
    MSG_PEER_ARENAS_REPLY,
    pack,
    unpack,
)
from smddp.server.control_region import ControlRegion
from smddp.v1 import smddp_pb2 as pb

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
NODE = "limits"  # the node id ``register`` gives the raw ranks
REPLY_S = 30.0  # how long a raw rank waits for a reply the daemon owes it
LONG_MS = 600_000  # a hostile job's timeout: nothing in these tests may wait on it

# A rank of the victim job: small all_reduces (in the control region) and now and then a
# larger one (through the arenas), each result checked, a pause between them (the machine
# is shared), until the stop file appears (the ranks agree on it through an all_reduce).
VICTIM = r"""
import os, sys, time
import numpy as np
from smddp.client import connect
from smddp.v1 import smddp_pb2 as pb
rank, path, stop_file = int(sys.argv[1]), sys.argv[2], sys.argv[4]
token = bytes.fromhex(sys.argv[3])
comm = connect("victim", token, rank, 2, socket_path=path, arena_bytes=8 << 20, timeout_s=60)
step = 0
flag = np.zeros(1)
while True:
    n = 300_000 if step % 8 == 7 else 1 + 97 * (step % 40)
    x = np.arange(n, dtype=np.float64) * (rank + 1) + step
    comm.all_reduce(x).wait()
    assert np.array_equal(x, np.arange(n, dtype=np.float64) * 3 + 2 * step), f"op {step}: wrong"
    step += 1
    if step == 1:
        print("ready", flush=True)
    flag[0] = float(os.path.exists(stop_file))
    comm.all_reduce(flag, pb.MAX).wait()
    if flag[0]:
        break
    time.sleep(0.005)
comm.close()
print(f"done {step}", flush=True)
"""

# Rank 0 of a job whose rank 1 is hostile: connects, says so, waits for a line on stdin,
# starts an all_reduce (in the region), says so, waits for it, prints what it raised as JSON
# (the exception's type and message, and the seconds from the start to the raise), and
# stays connected until the next line.
SURVIVOR = r"""
import json, sys, time
import numpy as np
from smddp.client import connect
path, job, token = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
timeout_s = float(sys.argv[4])
comm = connect(job, token, 0, 2, socket_path=path, arena_bytes=1 << 20, timeout_s=timeout_s)
print("connected", flush=True)
sys.stdin.readline()
x = np.ones(16, dtype=np.float32)
start = time.monotonic()
try:
    handle = comm.all_reduce(x)
    print("started", flush=True)
    handle.wait()
    got = {"type": "none", "message": "", "took": time.monotonic() - start}
except BaseException as exc:
    got = {"type": type(exc).__name__, "message": str(exc), "took": time.monotonic() - start,
           "smddp": type(exc).__module__.startswith("smddp")}
print(json.dumps(got), flush=True)
sys.stdin.readline()  # stays connected until told
"""

# Rank 1 of that job, hostile: registers and attaches as the client does, maps the region,
# waits until rank 0 arrived at op #1, sets the header's failed flag (and nothing else),
# says so and waits to be killed.
FLAG_SETTER = r"""
import mmap, os, socket, sys, time
import grpc
import numpy as np
from smddp.client.arena import ClientArena
from smddp.client.errors import DaemonLostError, OpError
from smddp.client.shm import ShmPath
from smddp.server.control_region import ControlRegion
from smddp.core.region import DATA_OFFSET, H_FAILED, HEADER_BYTES, S_SEQ
from smddp.v1 import smddp_pb2 as pb, smddp_pb2_grpc as pb_grpc
from smddp.core.wire import (DATA_SOCKET_SUFFIX, MAX_MESSAGE_BYTES, MSG_ATTACH, MSG_PEER_ARENAS,
                        pack, unpack)
path, job, token = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
timeout_ms = int(sys.argv[4])
node = pb_grpc.NodeStub(grpc.insecure_channel("unix:" + path))
reg = node.Register(pb.RegisterRequest(job_id=job, job_token=token, comm_id="0", rank=1,
    world_size=2, node_id="hostile", pid=os.getpid(), arena_bytes=1 << 20,
    timeout_ms=timeout_ms), timeout=10)
arena = ClientArena(1 << 20)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(path + DATA_SOCKET_SUFFIX)
req = pb.AttachRequest(session_id=reg.session_id, session_secret=reg.session_secret)
socket.send_fds(s, [pack(MSG_ATTACH, req.SerializeToString())], [arena.fd])
assert pb.AttachReply.FromString(unpack(s.recv(MAX_MESSAGE_BYTES))[1]).ok
s.sendall(pack(MSG_PEER_ARENAS, b""))
msg, fds, _, _ = socket.recv_fds(s, MAX_MESSAGE_BYTES, 3)
assert pb.AttachReply.FromString(unpack(msg)[1]).ok, msg
words = np.frombuffer(mmap.mmap(fds[-1], os.fstat(fds[-1]).st_size), dtype=np.int64)
while words[HEADER_BYTES // 8 + S_SEQ] < 1:  # slot 0's op number
    time.sleep(0.001)
words[H_FAILED] = 1
print("written", flush=True)
time.sleep(600)
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def _python(code: str, *args: str, err: Path, stdin: bool = False) -> subprocess.Popen:
    """Runs ``code`` with ``args`` in a new interpreter; its stderr goes to ``err``."""
    with open(err, "wb") as errors:
        return subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=_env(),
        )


def _line(proc: subprocess.Popen, what: str, err: Path) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, f"the process ended before saying {what!r}:\n{err.read_text()[-3000:]}"
    return line


def _result(survivor: subprocess.Popen, err: Path) -> dict[str, Any]:
    """The survivor's JSON line (after "started", when its op got that far)."""
    while True:
        line = _line(survivor, "what its op raised", err)
        if line.startswith("{"):
            return dict(json.loads(line))


class Victim:
    """The victim job: two numpy ranks all_reducing beside the attack."""

    def __init__(self, path: str, folder: Path) -> None:
        self.folder = folder
        self.stop_file = folder / "victim.stop"
        token = secrets.token_hex(16)
        self.ranks = [
            _python(VICTIM, str(r), path, token, str(self.stop_file), err=folder / f"v{r}.err")
            for r in range(2)
        ]
        for r, p in enumerate(self.ranks):
            assert _line(p, "ready", folder / f"v{r}.err") == "ready"

    def running(self) -> None:
        for r, p in enumerate(self.ranks):
            assert p.poll() is None, (
                f"victim rank {r} ended early:\n{(self.folder / f'v{r}.err').read_text()}"
            )

    def finish(self) -> int:
        """Stops the job; returns the ops it completed (each one checked)."""
        self.running()
        self.stop_file.touch()
        done = []
        for r, p in enumerate(self.ranks):
            out, _ = p.communicate(timeout=60)
            err = (self.folder / f"v{r}.err").read_text()
            assert p.returncode == 0, f"victim rank {r} exited {p.returncode}:\n{err}"
            done.append(int(out.split()[-1]))
        return min(done)

    def kill(self) -> None:
        for p in self.ranks:
            if p.poll() is None:
                p.kill()
                p.wait()


class Region:
    """A two-rank region as a hostile rank maps it: the layout's offsets, the geometry from
    its size (nothing of the code under test)."""

    def __init__(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        data_bytes, rest = divmod(size - HEADER_BYTES - 2 * DATA_OFFSET, 4)
        assert rest == 0, size
        self.slot_bytes = DATA_OFFSET + 2 * data_bytes
        self.data_bytes = data_bytes
        self.buf = np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8)
        self.words = self.buf.view(np.int64)
        self.header = self.words[: HEADER_BYTES // 8]
        self.slot_base = [(HEADER_BYTES + r * self.slot_bytes) // 8 for r in range(2)]

    def data(self, rank: int, parity: int) -> np.ndarray:
        off = HEADER_BYTES + rank * self.slot_bytes + DATA_OFFSET + parity * self.data_bytes
        return self.buf[off : off + self.data_bytes]


class RawJob:
    """A hostile two-rank job of raw sessions in this process: registered and attached as
    the client does it, each rank's data socket at hand, the region's memfd held."""

    def __init__(self, path: str, job: str, timeout_ms: int = LONG_MS, pid: int = 0) -> None:
        self.job = job
        token = secrets.token_bytes(32)
        node = stub(path)
        self.arenas = [ClientArena(1 << 20) for _ in range(2)]
        self.socks = []
        for r in range(2):
            reg = node.Register(
                register(
                    path,
                    job_id=job,
                    job_token=token,
                    rank=r,
                    world_size=2,
                    timeout_ms=timeout_ms,
                    pid=pid or os.getpid(),
                ),
                timeout=10,
            )
            s, reply = _attach(path, reg, self.arenas[r].fd)
            assert reply.ok, reply.error
            s.settimeout(REPLY_S)
            self.socks.append(s)
        self.fd = -1

    def region(self) -> Region:
        """Asks for the peers' arenas (rank 0), keeps the region's memfd and maps it."""
        s = self.socks[0]
        s.sendall(pack(MSG_PEER_ARENAS, b""))
        msg, fds, _flags, _addr = socket.recv_fds(s, MAX_MESSAGE_BYTES, 3)
        kind, payload = unpack(msg)
        assert kind == MSG_PEER_ARENAS_REPLY and pb.AttachReply.FromString(payload).ok, msg
        for fd in fds[:-1]:
            os.close(fd)
        self.fd = fds[-1]
        return Region(self.fd)

    def send(self, rank: int, req: pb.OpRequest) -> None:
        self.socks[rank].sendall(pack(MSG_OP, req.SerializeToString()))

    def reply(self, rank: int) -> pb.OpReply:
        """The next reply to ``rank``; fails the test after REPLY_S without one."""
        try:
            msg = self.socks[rank].recv(MAX_MESSAGE_BYTES)
        except TimeoutError:
            pytest.fail(f"{self.job} rank {rank}: no reply from smddpd within {REPLY_S:.0f} s")
        assert msg, f"{self.job} rank {rank}: smddpd closed the connection"
        kind, payload = unpack(msg)
        assert kind == MSG_OP_REPLY, kind
        return pb.OpReply.FromString(payload)

    def close(self) -> None:
        for s in self.socks:
            s.close()
        if self.fd >= 0:
            os.close(self.fd)
        for a in self.arenas:
            a.close()


def _barrier(seq: int = 1) -> pb.OpRequest:
    return pb.OpRequest(request_id=seq, seq=seq, part=0, parts=1, kind=pb.BARRIER)


def _recv_from_1() -> pb.OpRequest:
    return pb.OpRequest(
        request_id=1,
        seq=1,
        part=0,
        parts=1,
        kind=pb.RECV,
        root=1,
        dtype=pb.FLOAT32,
        count=4,
        output=pb.Region(offset=0, nbytes=16),
    )


def _slot_error(view: Region, rank: int, kind: int, length: int, text: bytes) -> None:
    """Writes an error into ``rank``'s slot the way a hostile rank may: any kind, any length."""
    off = HEADER_BYTES + rank * view.slot_bytes + ERR_MSG_OFFSET
    view.buf[off : off + len(text)] = np.frombuffer(text, np.uint8)
    b = view.slot_base[rank]
    view.words[b + S_ERR_KIND] = kind
    view.words[b + S_ERR_LEN] = length
    view.words[b + S_STATE] = STATE_FAILED
    view.header[H_ALARM] = 1


def _wait_for(check: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.05)


def _comm(ctl_status: Callable[[str], dict], path: str, job: str) -> dict[str, Any] | None:
    return next((c for c in ctl_status(path)["comms"] if c["job_id"] == job), None)


def _node_is_well(d: Any, ctl_status: Callable[[str], dict], victim: Victim) -> None:
    """The daemon lives and serves, status answers, the victim ran on and a new job runs."""
    assert d.proc.poll() is None, f"smddpd died:\n{d.log()[-4000:]}"
    with grpc.insecure_channel("unix:" + d.socket) as channel:
        assert node_health(channel) == SERVING
    assert any(c["job_id"] == "victim" for c in ctl_status(d.socket)["comms"])
    victim.running()
    pair_all_reduce(d.socket, f"after-{secrets.token_hex(3)}")
    done = victim.finish()
    print(f"the victim completed {done} checked ops on every rank")
    assert "Traceback" not in d.log(), d.log()[-4000:]


@pytest.fixture
def victim_of(tmp_path: Path) -> Any:
    started: list[Victim] = []

    def start(path: str) -> Victim:
        v = Victim(path, tmp_path)
        started.append(v)
        return v

    yield start
    for v in started:
        v.kill()


@pytest.mark.timeout(180)
def test_b1_a_rank_cannot_resize_its_region(start_daemon, ctl_status, victim_of):
    d = start_daemon(name="b1")
    victim = victim_of(d.socket)
    job = RawJob(d.socket, "b1-hostile")
    view = job.region()
    size = os.fstat(job.fd).st_size
    for to in (0, size // 2, size * 2):
        with pytest.raises(PermissionError):
            os.ftruncate(job.fd, to)
    with pytest.raises(PermissionError):  # nor can it lift the seals (F_SEAL_SEAL)
        fcntl.fcntl(job.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    assert os.fstat(job.fd).st_size == size
    # The watchdog reads the region five times a second: give it a few passes.
    time.sleep(2)
    assert d.proc.poll() is None, d.log()[-4000:]
    # The hostile job goes on: the region is whole, and a barrier of both ranks completes.
    assert int(view.header[H_WORLD]) == 2
    job.send(0, _barrier())
    job.send(1, _barrier())
    assert job.reply(0).ok and job.reply(1).ok
    _node_is_well(d, ctl_status, victim)
    job.close()


@pytest.mark.timeout(180)
def test_b5_an_unknown_error_kind_in_a_slot_fails_only_its_job(start_daemon, ctl_status, victim_of):
    d = start_daemon(name="b5")
    victim = victim_of(d.socket)
    job = RawJob(d.socket, "b5-hostile")
    view = job.region()
    job.send(0, _recv_from_1())  # pending at the daemon: the failure must answer it
    _wait_for(
        lambda: (_comm(ctl_status, d.socket, job.job) or {}).get("pending"),
        "the recv pending in status",
    )
    _slot_error(view, 1, 1 << 40, 5, b"boom!")
    reply = job.reply(0)
    print(reply.error)
    assert not reply.ok and reply.error_kind == pb.INVALID, reply
    assert reply.error == "job b5-hostile comm 0: a rank recorded in the control region: boom!"
    comm = _comm(ctl_status, d.socket, job.job)
    assert comm is not None and comm["failed"] == reply.error, comm

    # The watchdog lives on: a later job's missing rank is still timed out.
    later = RawJob(d.socket, "b5-later", timeout_ms=2000)
    start = time.monotonic()
    later.send(0, _barrier())
    timed_out = later.reply(0)
    took = time.monotonic() - start
    print(f"{timed_out.error} ({took:.1f} s)")
    assert timed_out.error_kind == pb.TIMEOUT and "rank 1 never arrived" in timed_out.error
    assert took < 20
    _node_is_well(d, ctl_status, victim)
    later.close()
    job.close()


@pytest.mark.timeout(180)
def test_b6_a_huge_error_length_is_capped(start_daemon, ctl_status, victim_of):
    d = start_daemon(name="b6")
    victim = victim_of(d.socket)
    job = RawJob(d.socket, "b6-hostile")
    view = job.region()
    for r in range(2):  # what the job's data buffers hold must stay out of the log
        for p in range(2):
            data = view.data(r, p)
            data[:] = np.frombuffer(b"SECRET-DATA-" * (data.size // 12 + 1), np.uint8)[: data.size]
    job.send(0, _barrier())
    _wait_for(
        lambda: (_comm(ctl_status, d.socket, job.job) or {}).get("pending"),
        "the barrier pending in status",
    )
    start = time.monotonic()
    text = b"rank 1 says so" + b"x" * (ERR_MSG_MAX - 14)  # its whole error area, no more
    _slot_error(view, 1, pb.MISMATCH, 1 << 40, text)
    reply = job.reply(0)
    took = time.monotonic() - start
    print(f"{reply.error[:200]}... ({len(reply.error)} characters, {took:.1f} s)")
    assert not reply.ok and reply.error_kind == pb.MISMATCH
    assert "rank 1 says so" in reply.error
    assert len(reply.error) < ERR_MSG_MAX + 200, len(reply.error)
    assert took < 20
    log = d.log()
    assert max(len(line) for line in log.splitlines()) < 2 * ERR_MSG_MAX, "a huge log line"
    assert "SECRET-DATA" not in log
    _node_is_well(d, ctl_status, victim)
    job.close()


@pytest.mark.timeout(180)
def test_b7_a_failed_flag_set_by_a_dying_rank_still_fails_the_survivor_fast(
    start_daemon, ctl_status, victim_of, tmp_path
):
    d = start_daemon(name="b7")
    victim = victim_of(d.socket)
    token = secrets.token_hex(16)
    # A long timeout: only the rank's death can end the survivor's op early.
    survivor = _python(
        SURVIVOR, d.socket, "b7-hostile", token, "60", stdin=True, err=tmp_path / "s.err"
    )
    hostile = _python(FLAG_SETTER, d.socket, "b7-hostile", token, "60000", err=tmp_path / "h.err")
    try:
        assert _line(survivor, "connected", tmp_path / "s.err") == "connected"
        assert survivor.stdin is not None
        survivor.stdin.write("go\n")
        survivor.stdin.flush()
        assert _line(survivor, "started", tmp_path / "s.err") == "started"
        assert _line(hostile, "written", tmp_path / "h.err") == "written"
        hostile.send_signal(signal.SIGKILL)
        hostile.wait(10)
        got = _result(survivor, tmp_path / "s.err")
    finally:
        for p in (survivor, hostile):
            if p.poll() is None:
                p.kill()
                p.wait()
    print(got)
    assert got["type"] == "RankFailedError", got
    assert f"job b7-hostile comm 0: rank 1 (pid {hostile.pid}, node hostile)" in got["message"]
    assert got["took"] < 20, got
    _node_is_well(d, ctl_status, victim)


@pytest.mark.timeout(180)
def test_b9_ranks_are_named_by_the_kernels_pid(start_daemon, ctl_status, victim_of):
    d = start_daemon(name="b9")
    victim = victim_of(d.socket)
    job = RawJob(d.socket, "b9-hostile", timeout_ms=3000, pid=1)
    comm = _comm(ctl_status, d.socket, job.job)
    assert comm is not None
    assert {r["pid"] for r in comm["ranks"]} == {os.getpid()}, comm
    job.send(0, _barrier())
    reply = job.reply(0)
    print(reply.error)
    assert reply.error_kind == pb.TIMEOUT
    assert f"rank 1 never arrived (rank 1 (pid {os.getpid()}, node {NODE}))" in reply.error
    log = d.log()
    assert "(pid 1," not in log and "(pid 1)" not in log, log[-3000:]
    assert f"registered rank 0 (node {NODE}), which says it is pid 1 (unverified" in log
    _node_is_well(d, ctl_status, victim)
    job.close()


@pytest.mark.timeout(180)
def test_any_op_words_end_only_their_job_and_in_time(start_daemon, ctl_status, victim_of):
    d = start_daemon(name="words")
    victim = victim_of(d.socket)
    job = RawJob(d.socket, "words-hostile", timeout_ms=2000)
    view = job.region()
    # Slot 0 at op #2**62 with a signature of impossible words that arrived in the future;
    # slot 1 at a negative op, its op counter negative too.
    seq = 1 << 62
    sig = view.slot_base[0] + SIG_WORD
    words = {G_SEQ: seq, G_KIND: 1 << 40, G_DTYPE: -1, G_COUNT: 1 << 62, G_ROOT: -7}
    words.update({G_OP: 1 << 50, G_ARRIVAL: 1 << 62})
    for g, value in words.items():
        view.words[sig + g] = value
    view.words[view.slot_base[0] + S_SEQ] = seq
    view.words[view.slot_base[1] + S_SEQ] = -3
    view.words[view.slot_base[1] + S_OPS] = -1
    start = time.monotonic()
    failed = _wait_for(
        lambda: (_comm(ctl_status, d.socket, job.job) or {}).get("failed"), "the job failed"
    )
    took = time.monotonic() - start
    print(f"{failed} ({took:.1f} s)")
    assert failed.startswith(f"job words-hostile comm 0: op #{seq} op#{1 << 40}(") and (
        "timed out: rank 1 never arrived" in failed
    ), failed
    assert took < 20
    _node_is_well(d, ctl_status, victim)
    job.close()


@pytest.mark.timeout(180)
def test_b10_a_rewritten_world_size_is_a_named_error(start_daemon, ctl_status, victim_of, tmp_path):
    d = start_daemon(name="b10")
    victim = victim_of(d.socket)
    # Rank 1 is hostile and raw; rank 0 is the real client, which maps the region at its
    # first op, after rank 1 rewrote the header's world size.
    job_id, token = "b10-hostile", secrets.token_bytes(32)
    reg = stub(d.socket).Register(
        register(d.socket, job_id=job_id, job_token=token, rank=1, world_size=2), timeout=10
    )
    arena = ClientArena(1 << 20)
    s1, reply = _attach(d.socket, reg, arena.fd)
    assert reply.ok, reply.error
    s1.settimeout(REPLY_S)
    survivor = _python(
        SURVIVOR, d.socket, job_id, token.hex(), "60", stdin=True, err=tmp_path / "s.err"
    )
    assert survivor.stdin is not None
    try:
        assert _line(survivor, "connected", tmp_path / "s.err") == "connected"
        s1.sendall(pack(MSG_PEER_ARENAS, b""))
        msg, fds, _flags, _addr = socket.recv_fds(s1, MAX_MESSAGE_BYTES, 3)
        assert pb.AttachReply.FromString(unpack(msg)[1]).ok, msg
        size = os.fstat(fds[-1]).st_size
        region = np.frombuffer(mmap.mmap(fds[-1], size), dtype=np.int64)
        region[H_WORLD] = 1
        survivor.stdin.write("go\n")
        survivor.stdin.flush()
        got = _result(survivor, tmp_path / "s.err")
        print(got)
        assert got["type"] == "OpError" and got["smddp"], got
        assert got["message"] == (
            f"job {job_id} comm 0: rank 0 cannot use the control region: the control region's "
            f"header says 1 ranks, slots of {region[2]} bytes and data buffers of {region[3]} "
            f"bytes, but smddpd made it for 2 ranks on this node in {size} bytes (a rank of "
            "the job wrote over its header)"
        ), got
        # Recorded in rank 0's slot (still connected), the daemon fails the communicator
        # with it: rank 1 hears it.
        failed = _wait_for(
            lambda: (_comm(ctl_status, d.socket, job_id) or {}).get("failed"), "the job failed"
        )
        assert failed == got["message"], failed
        s1.sendall(pack(MSG_OP, _barrier().SerializeToString()))
        answer = pb.OpReply.FromString(unpack(s1.recv(MAX_MESSAGE_BYTES))[1])
        assert not answer.ok and answer.error == got["message"], answer
    finally:
        if survivor.poll() is None:
            survivor.kill()
            survivor.wait()
    _node_is_well(d, ctl_status, victim)
    for fd in fds:
        os.close(fd)
    s1.close()
    arena.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("length", [0, 1 << 40, -5])
def test_failure_words_a_rank_wrote_raise_a_known_kind_and_a_bounded_message(
    native: str, length: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No daemon: ControlRegion is the daemon's own object; rank 0 waits in op #1 for rank 1,
    # which sets the header's failure words itself: an unknown kind, any length.
    monkeypatch.setenv("SMDDP_NATIVE", native)
    region = ControlRegion(2, data_bytes=4096)

    def gone() -> DaemonLostError:
        return DaemonLostError("smddpd at test is gone")

    native_on = ClientConfig.from_env().native  # as connect builds it from SMDDP_NATIVE
    shm = ShmPath("job j comm 0", 0, region.view.buf, 60.0, lambda: True, gone, native=native_on)
    hostile = region.view
    hostile.buf[-4096:] = np.frombuffer(b"DATA" * 1024, np.uint8)  # the last data buffer
    hostile.header[H_FAIL_KIND] = 1 << 40
    hostile.header[H_FAIL_LEN] = length
    hostile.header[H_FAILED] = 1
    hostile.header[H_ALARM] = 1
    futex_wake(hostile.step_address(1))
    start = time.monotonic()
    with pytest.raises(OpError) as info:
        shm.wait(shm.publish(1, shm.next_parity(), pb.BARRIER, 0, 0, 0, 0), 1)
    took = time.monotonic() - start
    err = info.value
    print(f"{type(err).__name__} kind {err.kind}: {str(err)[:160]} ({took:.2f} s)")
    assert err.kind == pb.INVALID and took < 10
    assert 0 < len(str(err)) <= FAIL_MSG_MAX and "DATA" not in str(err)
    # No message was written, whatever the length word says: the error says so.
    assert str(err) == (
        "job j comm 0: the control region says the communicator failed, without a "
        "message (a rank of the job wrote over the region's failure words)"
    )
    # The daemon's own failure still goes in, over the rank's words.
    region.fail(pb.RANK_FAILED, "job j comm 0: rank 1 (pid 7, node n) disconnected")
    assert hostile.failure() == (
        pb.RANK_FAILED,
        "job j comm 0: rank 1 (pid 7, node n) disconnected",
    )
    region.close()
