"""In-process unit tests of the daemon's rooms: no daemon process, no rank process.

Op matching and its mismatch messages (``Communicator``), the registry's limits
(``Registry``), and the multi-node algorithms over two in-memory peers (``hierarchical``).
What the processes add (sockets, torch, namespaces) is tested in tests/server/test_daemon.py,
tests/multinode and tests/failures.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Sequence

import numpy as np
import pytest

from smddp.core.region import S_DONE, S_SEQ
from smddp.server import hierarchical
from smddp.server.arena import Arena
from smddp.server.communicator import Communicator, Session
from smddp.server.config import DaemonConfig
from smddp.server.domain import Layout, NodeSpec, Registration, op_signature, request_signature
from smddp.server.errors import (
    FailedPrecondition,
    InvalidRequest,
    LimitExceeded,
    OpMismatch,
    PeerError,
)
from smddp.server.peer_wire import (
    FRAME_DATA,
    HELLO_OK,
    Frame,
    pack_answer,
    pack_header,
    pack_hello,
    parse_address,
    read_answer,
    read_hello,
    token_proof,
    unpack_header,
)
from smddp.server.registry import Registry
from smddp.v1 import smddp_pb2 as pb

pytestmark = pytest.mark.timeout(60)

ARENA_BYTES = 64 << 10
TOKEN = b"k" * 32


def _arena(nbytes: int = ARENA_BYTES, owner: str = "test") -> Arena:
    fd = os.memfd_create("smddp-test", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return Arena(fd, nbytes, owner)


class _Replies:
    """A session's reply channel that keeps what it is sent."""

    def __init__(self) -> None:
        self.replies: list[pb.OpReply] = []

    def send_reply(self, reply: pb.OpReply) -> None:
        self.replies.append(reply)


def _session(comm: Communicator, rank: int) -> tuple[Session, _Replies]:
    channel = _Replies()
    session = Session(
        session_id=f"s{rank}", secret=b"", comm=comm, rank=rank, global_rank=rank, pid=100 + rank,
        node_id="n0", arena_bytes=ARENA_BYTES, arena=_arena(), channel=channel,
    )  # fmt: skip
    comm.add(session)
    return session, channel


def _op(kind: int, count: int = 4, **fields: object) -> pb.OpRequest:
    nbytes = count * 4
    req = pb.OpRequest(
        request_id=1, seq=1, part=0, parts=1, kind=kind, dtype=pb.FLOAT32, count=count,
        input=pb.Region(offset=0, nbytes=nbytes), output=pb.Region(offset=nbytes, nbytes=nbytes),
    )  # fmt: skip
    for name, value in fields.items():
        if isinstance(value, pb.Region):
            getattr(req, name).CopyFrom(value)
        else:
            setattr(req, name, value)
    return req


# -- op matching ------------------------------------------------------------------------------


def test_matching_ranks_run_the_op_and_get_ok():
    comm = Communicator("j", "c", 2, TOKEN, 10.0, 4096)
    ranks = [_session(comm, r) for r in range(2)]
    for session, _ in ranks:
        session.arena.view(pb.Region(offset=0, nbytes=16), np.dtype(np.float32))[:] = (
            session.rank + 1
        )
    for session, _ in ranks:
        comm.submit(session, _op(pb.ALL_REDUCE, reduce_op=pb.SUM))
    for session, channel in ranks:
        assert [r.ok for r in channel.replies] == [True]
        out = session.arena.view(pb.Region(offset=16, nbytes=16), np.dtype(np.float32))
        assert out.tolist() == [3.0] * 4
    assert comm.ops_completed == 1 and comm.failed() is None


def test_a_mismatch_names_the_minority_first_and_fails_every_rank():
    comm = Communicator("j", "c", 3, TOKEN, 10.0, 4096)
    ranks = [_session(comm, r) for r in range(3)]
    comm.submit(ranks[0][0], _op(pb.ALL_REDUCE, reduce_op=pb.SUM))
    comm.submit(ranks[1][0], _op(pb.ALL_REDUCE, reduce_op=pb.MAX))
    comm.submit(ranks[2][0], _op(pb.ALL_REDUCE, reduce_op=pb.SUM))
    expected = (
        "job j comm c: rank 1 called all_reduce(MAX, 4 x float32) as op #1 while ranks 0, 2 "
        "called all_reduce(SUM, 4 x float32)"
    )
    for _, channel in ranks:
        (reply,) = channel.replies
        assert not reply.ok and reply.error_kind == pb.MISMATCH
        assert reply.error == expected
    assert comm.failed() == (pb.MISMATCH, expected)
    # Every later op gets the first cause.
    later = _op(pb.BARRIER, seq=2)
    comm.submit(ranks[0][0], later)
    assert ranks[0][1].replies[-1].error == expected


def test_fields_an_op_does_not_use_do_not_make_a_mismatch():
    # A broadcast's reduce op and an all_reduce's root are not theirs to agree on.
    assert request_signature(_op(pb.BROADCAST, reduce_op=pb.SUM)) == request_signature(
        _op(pb.BROADCAST, reduce_op=pb.MAX)
    )
    assert request_signature(_op(pb.ALL_REDUCE, root=0)) == request_signature(
        _op(pb.ALL_REDUCE, root=1)
    )
    assert request_signature(_op(pb.REDUCE, root=0)) != request_signature(_op(pb.REDUCE, root=1))
    # all_to_all ranks send different totals: their blocks are checked pairwise instead.
    assert op_signature(pb.ALL_TO_ALL, pb.FLOAT32, 8, 0, 0, 1) == op_signature(
        pb.ALL_TO_ALL, pb.FLOAT32, 16, 0, 0, 1
    )


def test_an_out_of_order_chunk_fails_the_communicator_naming_the_rank():
    comm = Communicator("j", "c", 2, TOKEN, 10.0, 4096)
    (s0, c0), (_, c1) = _session(comm, 0), _session(comm, 1)
    comm.submit(s0, _op(pb.ALL_REDUCE, seq=1, part=1, parts=2, reduce_op=pb.SUM))
    (reply,) = c0.replies
    assert not reply.ok and reply.error_kind == pb.INVALID
    assert reply.error.endswith("arrived as op #1 chunk 1, but op #1 chunk 0 was next")
    kind, message = comm.failed() or (0, "")
    assert kind == pb.INVALID and message.startswith(
        "job j comm c: rank 0 (pid 100, node n0) sent an invalid op"
    )
    assert c1.replies == []  # rank 1 hears it at its next op


def test_a_timeout_names_the_rank_that_never_came():
    comm = Communicator("j", "c", 2, TOKEN, 0.5, 4096)
    (s0, c0), _ = _session(comm, 0), _session(comm, 1)
    comm.submit(s0, _op(pb.ALL_REDUCE, reduce_op=pb.SUM))
    comm.check_timeouts(now=1e12)
    (reply,) = c0.replies
    assert not reply.ok and reply.error_kind == pb.TIMEOUT
    assert "rank 1 never arrived (rank 1 (pid 101, node n0)) while rank 0 waited" in reply.error


def test_a_gpu_request_without_gpu_support_is_refused():
    comm = Communicator("j", "c", 1, TOKEN, 10.0, 4096)
    s0, c0 = _session(comm, 0)
    req = _op(pb.ALL_REDUCE, reduce_op=pb.SUM)
    req.cuda.SetInParent()
    comm.submit(s0, req)
    (reply,) = c0.replies
    assert not reply.ok and "was started without GPU support" in reply.error


# -- the registry's limits --------------------------------------------------------------------


def _register(
    registry: Registry,
    job: str = "j",
    rank: int = 0,
    world: int = 2,
    arena_bytes: int = ARENA_BYTES,
) -> Session:
    return registry.register(
        Registration(job, "0", rank, world, TOKEN, arena_bytes, pid=os.getpid(), node_id="n0")
    )


def test_registry_limits():
    registry = Registry(DaemonConfig(node_id="n0", max_ranks_per_job=4, max_arena_bytes=1 << 20))
    with pytest.raises(
        LimitExceeded, match=r"world_size 5 is outside 1\.\.4 \(--max-ranks-per-job\)"
    ):
        _register(registry, world=5)
    with pytest.raises(
        LimitExceeded, match=r"arena_bytes 2097152 is outside .*\(--max-arena-bytes\)"
    ):
        _register(registry, arena_bytes=2 << 20)
    with pytest.raises(InvalidRequest, match="rank 2 is outside a world of 2"):
        _register(registry, rank=2)
    first = _register(registry)
    with pytest.raises(FailedPrecondition, match=r"rank 0 is already registered \(rank 0 \(pid"):
        _register(registry)
    with pytest.raises(
        FailedPrecondition, match="registered with world_size 3 but the communicator has 2"
    ):
        _register(registry, rank=1, world=3)
    assert registry.session_count() == 1 and first.comm.members == {0: first}


def test_registry_max_jobs_counts_attached_jobs():
    registry = Registry(DaemonConfig(node_id="n0", max_jobs=1))
    session = _register(registry, job="a", world=1)
    arena = _arena()
    registry.attach(session, os.dup(arena.fd), os.getuid(), os.getpid())
    with pytest.raises(LimitExceeded, match=r"the daemon already serves 1 jobs \(--max-jobs\)"):
        _register(registry, job="b", world=1)


def test_registry_oldest_unattached_makes_room():
    registry = Registry(DaemonConfig(node_id="n0", max_unattached=2))
    old = _register(registry, job="a", world=1)
    _register(registry, job="b", world=1)
    _register(registry, job="c", world=1)
    assert registry.unattached_count() == 2 and old.closed


# -- the multi-node algorithms over two in-memory peers ----------------------------------------


class _Wire:
    """Two nodes' mailboxes in memory: what ``CommPeers`` does over sockets."""

    def __init__(self) -> None:
        self.mail: dict[tuple[int, int, int, int, int], Frame] = {}
        self.cond = threading.Condition()

    def peers(self, me: int) -> _MemoryPeers:
        return _MemoryPeers(self, me)


class _MemoryPeers:
    def __init__(self, wire: _Wire, me: int) -> None:
        self.wire, self.me = wire, me

    def send(
        self, node: int, ftype: int, req: pb.OpRequest | None, round_: int = 0,
        payloads: Sequence[np.ndarray | bytes] = (),
    ) -> None:  # fmt: skip
        r = req or pb.OpRequest()
        data = b"".join(
            np.ascontiguousarray(p).tobytes() if isinstance(p, np.ndarray) else p for p in payloads
        )
        # Through the real header, as the sockets carry it.
        header = pack_header(
            ftype, self.me, len(data), kind=r.kind, dtype=r.dtype, seq=r.seq, part=r.part,
            parts=r.parts, round_=round_, count=r.count, root=r.root, reduce_op=r.reduce_op,
        )  # fmt: skip
        frame, nbytes = unpack_header(header)
        assert nbytes == len(data)
        frame.payload = np.frombuffer(data, dtype=np.uint8)
        with self.wire.cond:
            self.wire.mail[(node, r.seq, r.part, round_, self.me)] = frame
            self.wire.cond.notify_all()

    def recv(self, seq: int, part: int, round_: int, node: int) -> Frame:
        key = (self.me, seq, part, round_, node)
        with self.wire.cond:
            if not self.wire.cond.wait_for(lambda: key in self.wire.mail, timeout=10):
                raise PeerError(f"op #{seq}: node {node} sent nothing")
            return self.wire.mail.pop(key)


NODES = ((0, 1), (2, 3))
SPECS = (NodeSpec("a", "10.0.0.1:1"), NodeSpec("b", "10.0.0.2:1"))


def _run_nodes(
    reqs_of: dict[int, pb.OpRequest], inputs: dict[int, np.ndarray]
) -> tuple[dict[int, Arena], dict[int, BaseException]]:
    """Runs one chunk on both nodes, a thread each; the arenas and each node's error."""
    arenas = {r: _arena() for r in reqs_of}
    for r, x in inputs.items():
        arenas[r].view(reqs_of[r].input, x.dtype)[:] = x
    wire, errors = _Wire(), {}

    def node(i: int) -> None:
        layout = Layout("j", "c", NODES, i, SPECS)
        local = NODES[i]
        try:
            hierarchical.execute(
                layout, wire.peers(i), {r: reqs_of[r] for r in local}, {r: arenas[r] for r in local}
            )
        except BaseException as exc:
            errors[i] = exc

    threads = [threading.Thread(target=node, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return arenas, errors


def test_all_reduce_across_two_nodes_gives_every_rank_the_same_sum():
    n = 10  # not a multiple of the node count: the segments differ in size
    reqs = {r: _op(pb.ALL_REDUCE, count=n, reduce_op=pb.SUM) for r in range(4)}
    inputs = {r: np.arange(n, dtype=np.float32) * (r + 1) for r in range(4)}
    arenas, errors = _run_nodes(reqs, inputs)
    assert errors == {}
    for r in range(4):
        assert (
            arenas[r].view(reqs[r].output, np.dtype(np.float32)).tolist()
            == (np.arange(n) * 10.0).tolist()
        )


def test_all_gather_across_two_nodes_is_rank_major():
    n = 3
    reqs = {
        r: _op(pb.ALL_GATHER, count=n, output=pb.Region(offset=64, nbytes=4 * n * 4))
        for r in range(4)
    }
    inputs = {r: np.full(n, r, dtype=np.float32) for r in range(4)}
    arenas, errors = _run_nodes(reqs, inputs)
    assert errors == {}
    for r in range(4):
        assert arenas[r].view(reqs[r].output, np.dtype(np.float32)).tolist() == [
            float(k // n) for k in range(4 * n)
        ]


def test_a_mismatch_across_nodes_names_both_nodes():
    reqs = {r: _op(pb.ALL_REDUCE, reduce_op=pb.SUM if r < 2 else pb.MAX) for r in range(4)}
    _, errors = _run_nodes(reqs, {})
    assert isinstance(errors[0], OpMismatch)
    assert str(errors[0]) == (
        "job j comm c: ranks 2-3 (node b) called all_reduce(MAX, 4 x float32) as op #1 while "
        "ranks 0-1 (node a) called all_reduce(SUM, 4 x float32)"
    )


def test_a_chunk_of_the_wrong_size_from_a_node_is_named():
    # Node b's tensors hold 6 elements where node a's hold 8: its segment is one short.
    reqs = {r: _op(pb.ALL_REDUCE, count=8 if r < 2 else 6, reduce_op=pb.SUM) for r in range(4)}
    for r in (2, 3):
        reqs[r].count = 8
    _, errors = _run_nodes(reqs, {})
    assert isinstance(errors[0], InvalidRequest)
    assert str(errors[0]) == (
        "all_reduce(SUM, 8 x float32): node b sent 3 elements where this node expected 4 "
        "(tensors of mismatched sizes?)"
    )


# -- the wire format --------------------------------------------------------------------------


class _Pipe:
    """A byte stream in memory with a data connection's calls."""

    def __init__(self, data: bytes = b"") -> None:
        self.data, self.sent = bytearray(data), bytearray()

    def settimeout(self, seconds: float | None) -> None:
        pass

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        self.sent += data

    def recv_into(self, view: memoryview) -> int:
        n = min(len(view), len(self.data))
        view[:n] = self.data[:n]
        del self.data[:n]
        return n

    def shutdown(self, how: int) -> None:
        pass

    def close(self) -> None:
        pass


def test_hello_and_header_round_trip():
    proof = token_proof(TOKEN, "j", "c")
    hello = read_hello(_Pipe(pack_hello("j", "c", 1, proof)))
    assert (hello.job_id, hello.comm_id, hello.node, hello.proof) == ("j", "c", 1, proof)
    assert read_answer(_Pipe(pack_answer(HELLO_OK, "fine"))) == (HELLO_OK, "fine")
    frame, nbytes = unpack_header(
        pack_header(FRAME_DATA, 3, 40, kind=pb.ALL_REDUCE, seq=7, round_=1)
    )
    assert (frame.ftype, frame.src_node, nbytes, frame.kind, frame.seq, frame.round) == (
        FRAME_DATA, 3, 40, pb.ALL_REDUCE, 7, 1,
    )  # fmt: skip
    with pytest.raises(ConnectionError, match="malformed frame header"):
        unpack_header(b"XXXX" + pack_header(FRAME_DATA, 0)[4:])
    with pytest.raises(ConnectionError, match="not an smddp peer"):
        read_hello(_Pipe(b"\x16\x03" + bytes(30)))
    assert parse_address("[::1]:5000") == ("::1", 5000)


@pytest.mark.parametrize(
    ("other_seq", "other_done", "level"),
    [
        # Rank 1 is still marking done the op that rank 0 finished before it left: it waits for
        # nothing of rank 0, so the clean leave stays at INFO.
        (6, 5, logging.INFO),
        # Rank 1 is inside op 7, which rank 0 never entered: the leave fails it mid-op.
        (7, 6, logging.WARNING),
    ],
    ids=["finishing-the-same-op", "waiting-in-a-later-op"],
)
def test_a_clean_leave_warns_only_when_a_rank_in_the_region_waits_for_it(
    other_seq, other_done, level, caplog
):
    comm = Communicator("j", "c", 2, TOKEN, 10.0, 4096)
    (s0, _), _ = _session(comm, 0), _session(comm, 1)
    assert len(comm.arena_fds()) == 3  # both attached: the control region now exists
    region = comm.region
    assert region is not None
    region.view.slots[0, S_SEQ] = region.view.slots[0, S_DONE] = 6
    region.view.slots[1, S_SEQ] = other_seq
    region.view.slots[1, S_DONE] = other_done
    why = (
        "job j comm c: rank 0 (pid 100, node n0) has left the communicator (destroy_process_group)"
    )
    with caplog.at_level(logging.INFO, logger="smddp.server.communicator"):
        comm.remove(s0, why, pb.RANK_FAILED, logging.INFO)
    (record,) = [r for r in caplog.records if r.getMessage() == why]
    assert record.levelno == level, record.levelname
