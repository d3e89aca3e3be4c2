"""The daemon's threads survive an exception in one unit of their work, and its release
paths finish whatever raised first (``smddp.server.supervise``).

A real ``Daemon`` runs in this process, with real client ranks on threads beside it, so that
one method of one real communicator can be made to raise: its job's ranks must get a named
error, the exception must be logged once, and the rest of the daemon must not notice (another
job's missing rank is still timed out on time, health stays SERVING, the watchdog ticks).
"""

from __future__ import annotations

import gc
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from smddp.client import connect
from smddp.client.arena import ClientArena
from smddp.client.communicator import Communicator as ClientComm
from smddp.client.errors import OpError, OpTimeoutError
from smddp.core.region import C_OPS
from smddp.core.wire import DATA_SOCKET_SUFFIX, MAX_MESSAGE_BYTES, MSG_ATTACH, pack, unpack
from smddp.server import supervise
from smddp.server.communicator import Communicator, Session
from smddp.server.config import DaemonConfig
from smddp.server.daemon import NODE_SERVICE, Daemon
from smddp.server.domain import Registration
from smddp.server.errors import FailedPrecondition
from smddp.server.registry import Registry
from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

ARENA = 1 << 20
TIMEOUT_S = 2.0  # the group timeout of the job whose missing rank must be timed out
# "On time": the daemon's watchdog times the op out within a tick or two of TIMEOUT_S; a
# rank's own fallback (what is left when the watchdog is gone) waits 30 s longer.
ON_TIME_S = TIMEOUT_S + 10.0
# Long enough for a watchdog that stopped to show: alive() turns False 7 s after its last tick.
HEALTH_WATCH_S = 9.0
RAISED = "Value out of range: 1099511627776"  # what B5's out-of-range error kind raised


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    """A daemon of this process on a private socket, with HTTP on a free port."""
    folder = tempfile.mkdtemp(prefix="smddp-sup-")  # short: a unix socket path has 108 bytes
    cfg = DaemonConfig(
        socket=os.path.join(folder, "smddpd.sock"),
        node_id="n0",
        http_bind="127.0.0.1:0",
        peer_bind="off",
    )
    d = Daemon(cfg)
    d.start()
    yield d
    d.stop(0.5)
    shutil.rmtree(folder, ignore_errors=True)


def pair(path: str, job: str, timeout_s: float = 60.0) -> list[ClientComm]:
    """Both ranks of a two-rank job, connected (registered and attached) from threads."""
    token = secrets.token_bytes(16)
    comms: list[ClientComm | None] = [None, None]

    def join(rank: int) -> None:
        comms[rank] = connect(
            job, token, rank, 2, socket_path=path, timeout_s=timeout_s, arena_bytes=ARENA
        )

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(c is not None for c in comms), f"job {job}: a rank did not connect"
    return [c for c in comms if c is not None]


class Op:
    """An all_reduce on a thread: what it raised, and when it ended."""

    def __init__(self, comm: ClientComm) -> None:
        self.error: BaseException | None = None
        self.ended: float | None = None
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(comm,), daemon=True)
        self._thread.start()

    def _run(self, comm: ClientComm) -> None:
        try:
            comm.all_reduce(np.ones(16, dtype=np.float32)).wait()
        except BaseException as exc:
            self.error = exc
        self.ended = time.monotonic()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


def comm_of(d: Daemon, job: str) -> Communicator:
    (comm,) = [c for c in d.registry.comms() if c.job_id == job]
    return comm


def wait_for(what: str, ok: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.02)


def http_get(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def node_health(path: str) -> int:
    with grpc.insecure_channel("unix:" + path) as channel:
        return int(
            health_pb2_grpc.HealthStub(channel)
            .Check(health_pb2.HealthCheckRequest(service=NODE_SERVICE), timeout=5)
            .status
        )


def test_a_communicator_whose_timeout_check_raises_fails_alone(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    path = daemon.config.socket
    assert daemon.http is not None
    port = daemon.http.port
    victim = pair(path, "victim")
    other = pair(path, "other", timeout_s=TIMEOUT_S)
    # Each job's first op maps its control region (rank 0 and 1 together).
    for comms in (victim, other):
        ops = [Op(c) for c in comms]
        for op in ops:
            op.join(30)
            assert op.error is None, op.error

    def boom(now: float) -> None:
        raise ValueError(RAISED)

    # The victim's rank 0 starts an op without rank 1 (which comes later); the other
    # job's rank 0 waits for its rank 1, which never comes: the watchdog must time it out.
    waiting = Op(victim[0])
    monkeypatch.setattr(comm_of(daemon, "victim"), "check_timeouts", boom)
    missing = Op(other[0])

    # The victim fails on both ranks, with the internal error named.
    waiting.join(15)
    assert isinstance(waiting.error, OpError), waiting.error
    expected = "job victim comm 0: internal error in smddpd while checking its timeouts"
    assert expected in str(waiting.error) and RAISED in str(waiting.error), waiting.error
    late = Op(victim[1])
    late.join(15)
    assert isinstance(late.error, OpError) and expected in str(late.error), late.error

    # The other job's missing rank is timed out on time, naming it.
    missing.join(ON_TIME_S + 5)
    assert isinstance(missing.error, OpTimeoutError), missing.error
    assert "rank 1 never arrived" in str(missing.error), missing.error
    assert missing.ended is not None and missing.ended - missing.started < ON_TIME_S, (
        f"the other job's op timed out after {missing.ended - missing.started:.1f} s "
        f"(timeout {TIMEOUT_S} s)"
    )

    # Health stays SERVING and the watchdog ticks on, long enough for a dead one to show.
    watch_until = time.monotonic() + HEALTH_WATCH_S
    while time.monotonic() < watch_until:
        assert time.monotonic() - daemon.last_tick < 2.0, "the watchdog stopped ticking"
        assert http_get(port, "/healthz") == 200
        assert http_get(port, "/readyz") == 200
        assert node_health(path) == health_pb2.HealthCheckResponse.SERVING
        time.sleep(0.5)

    # Logged once, naming the job, with the traceback.
    lines = [
        r for r in caplog.records if r.name == "smddp.server.supervise" and RAISED in r.getMessage()
    ]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].job == "victim" and lines[0].exc_info is not None  # type: ignore[attr-defined]
    assert (
        lines[0]
        .getMessage()
        .startswith(
            "job victim comm 0: internal error in smddpd while the watchdog checked a "
            "communicator's timeouts: ValueError"
        )
    ), lines[0].getMessage()
    for c in victim + other:
        c.close()


def test_close_releases_everything_when_reading_the_metrics_raises(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = daemon.config.socket
    comms = pair(path, "closing")
    ops = [Op(c) for c in comms]
    for op in ops:
        op.join(30)
        assert op.error is None, op.error
    comm = comm_of(daemon, "closing")
    region = comm.region
    assert region is not None
    region_fd = region.fd
    arena_fds = [s.arena.fd for s in comm.members.values() if s.arena is not None]

    def unreadable() -> None:
        raise ValueError("Counters can only be incremented by non-negative amounts.")

    # What a decreasing counter in the region did (B4): the first step of close() raised.
    monkeypatch.setattr(comm, "drain_metrics", unreadable)
    for c in comms:
        c.close()
    wait_for("the job is forgotten", lambda: not daemon.registry.comms(), 10)
    for fd in [region_fd, *arena_fds]:
        # Closed by the daemon (the number may be reused by now, but not by a memfd of ours).
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:
            continue
        assert "smddp" not in target, f"fd {fd} still open: {target}"
    assert comm.region is None
    assert daemon.registry.session_count() == 0 and daemon.registry.job_count() == 0


def test_counters_gone_backwards_leave_no_mapping_behind(daemon: Daemon) -> None:
    """The communicator that refused a rank's counters unmaps its region when it closes.

    The refusal once kept its exception past the except, in a cycle with its own frame (which
    held the region's views): the region's mapping, and the descriptor Python's mmap keeps of
    it, stayed until the garbage collector ran, in practice for good (50 hostile jobs left the
    daemon holding two regions). The collector is off here, so a cycle would keep it.
    """
    path = daemon.config.socket
    comms = pair(path, "backwards")
    ops = [Op(c) for c in comms]
    for op in ops:
        op.join(30)
        assert op.error is None, op.error
    comm = comm_of(daemon, "backwards")
    region = comm.region
    assert region is not None
    mapping = region._mm
    view = comms[0]._region.shm.view
    view.op_table(0)[:, C_OPS] = -7  # rank 0's op counters go backwards
    gc.disable()
    try:
        comm.drain_metrics()  # what a scrape does
        failed = comm.failed()
        assert failed is not None and "went backwards" in failed[1], failed
        for c in comms:
            c.close()
        wait_for("the job is forgotten", lambda: not daemon.registry.comms(), 10)
        assert mapping.closed, "the region's mapping outlived its communicator"
    finally:
        gc.enable()


def _refuse() -> None:
    raise OSError("no")


def test_a_close_step_that_raises_does_not_stop_the_others() -> None:
    done: list[str] = []
    steps = supervise.Steps("closing", "job j comm c")
    steps.run("first", lambda: done.append("first"))
    steps.run("second", _refuse)
    steps.run("third", lambda: done.append("third"))
    assert done == ["first", "third"]
    with pytest.raises(supervise.Reported, match=r"^job j comm c: closing: second failed"):
        steps.raise_first()
    steps.raise_first()  # raised once


def test_a_request_that_raises_gets_500_and_the_http_server_goes_on(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert daemon.http is not None
    port = daemon.http.port

    def broken() -> Iterator[object]:
        raise ValueError("a collector raised")

    monkeypatch.setattr(daemon.metrics.registry, "collect", broken)
    assert http_get(port, "/metrics") == 500
    assert http_get(port, "/healthz") == 200
    monkeypatch.undo()
    assert http_get(port, "/metrics") == 200


def _attach(path: str, reg: pb.RegisterReply, fd: int) -> tuple[socket.socket, pb.AttachReply]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(path + DATA_SOCKET_SUFFIX)
    req = pb.AttachRequest(session_id=reg.session_id, session_secret=reg.session_secret)
    socket.send_fds(s, [pack(MSG_ATTACH, req.SerializeToString())], [fd])
    return s, pb.AttachReply.FromString(unpack(s.recv(MAX_MESSAGE_BYTES))[1])


def test_a_connection_whose_rank_removal_raises_is_still_closed_and_uncounted(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = daemon.config.socket
    stub = pb_grpc.NodeStub(grpc.insecure_channel("unix:" + path))
    reg = stub.Register(
        pb.RegisterRequest(
            job_id="lost", job_token=b"t" * 16, comm_id="0", rank=0, world_size=1,
            node_id="n0", pid=os.getpid(), arena_bytes=ARENA,
        ),
        timeout=10,
    )  # fmt: skip
    arena = ClientArena(ARENA)
    s, reply = _attach(path, reg, arena.fd)
    assert reply.ok, reply.error
    data = daemon._data
    assert data is not None
    uid = os.getuid()
    assert data._connections.held(uid) == 1

    def broken(session: object, detail: str) -> None:
        raise RuntimeError("removal failed")

    monkeypatch.setattr(daemon.registry, "connection_lost", broken)
    s.close()  # the rank's process died: its connection's reader sees EOF
    # Its teardown (a finally) went on past the raise: forgotten, uncounted, closed.
    wait_for("the connection is given back", lambda: data._connections.held(uid) == 0, 10)
    assert not data._conns
    arena.close()


def test_a_registration_dropped_while_it_attaches_does_not_keep_its_arena() -> None:
    registry = Registry(DaemonConfig(node_id="n0"))
    session = registry.register(
        Registration("race", "0", 0, 2, b"t" * 16, ARENA, pid=os.getpid(), node_id="n0")
    )
    arena = ClientArena(ARENA)
    fd = os.dup(arena.fd)  # the daemon's copy, as SCM_RIGHTS would give it
    inode = os.fstat(fd).st_ino
    bind = registry._bind

    def bind_then_leave(s: Session, uid: int) -> None:
        bind(s, uid)
        registry.deregister(s)  # a Deregister that came in meanwhile

    registry._bind = bind_then_leave  # type: ignore[method-assign]
    with pytest.raises(FailedPrecondition, match="left the communicator while it attached"):
        registry.attach(session, fd, os.getuid(), os.getpid())
    try:
        still = os.fstat(fd).st_ino == inode
    except OSError:
        still = False
    assert not still, "the daemon's descriptor of the arena is still open"
    assert session.arena is None and registry.session_count() == 0
    arena.close()


def test_the_grpc_pool_threads_carry_their_name_in_the_kernel(daemon: Daemon) -> None:
    # An operator's top -H, and the fuzz's count of threads held per job, tell gRPC's pool
    # threads (kept up to the pool's bound, never per job) from the rest by this name.
    with grpc.insecure_channel("unix:" + daemon.config.socket) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue
    assert any(n.startswith("smddp-grpc_") for n in names), names
