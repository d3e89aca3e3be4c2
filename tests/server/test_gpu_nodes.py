"""GPU collectives of a communicator spanning nodes (``GpuOps.execute_across``), in process.

Two "nodes", each a ``GpuOps`` on its own fake runtime (``gpu_fakes``: host memory for GPU
memory, the generated kernels interpreted), exchange through two in-memory peers with the
host path's algorithms (``hierarchical.execute``, as the communicator passes it). Every
collective, dtype and reduce op is checked bitwise against the host path on the same
inputs: the same exchange over arenas holding the same values. Chunks are kept small so
that ops cross many of them; the staging stays within its two buffers and is freed with the
communicator; the ranks' done events come after every write to their buffers.

The same path through real daemons and rank processes: tests/multinode/test_multinode_gpu.py.
"""

from __future__ import annotations

import fcntl
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from gpu_fakes import Buffer, FakeRuntime, FakeSession, QueuedFakeRuntime, request

from smddp.core.wire import numpy_dtype, reduce_op_check
from smddp.server import gpu, hierarchical
from smddp.server.arena import Arena
from smddp.server.domain import Layout, NodeSpec
from smddp.server.errors import InvalidRequest, PeerError
from smddp.server.peer_wire import Frame, pack_header, unpack_header
from smddp.v1 import smddp_pb2 as pb

pytestmark = pytest.mark.timeout(120)

TWO_BY_TWO = ((0, 1), (2, 3))
UNEVEN = ((0, 2, 3), (1,))  # interleaved, 3 + 1: the node of rank 0 holds three
DTYPES = [pb.FLOAT16, pb.BFLOAT16, pb.FLOAT32, pb.FLOAT64, pb.INT8, pb.UINT8, pb.INT16,
          pb.INT32, pb.INT64, pb.BOOL]  # fmt: skip
OPS = [pb.SUM, pb.AVG, pb.MIN, pb.MAX, pb.PRODUCT, pb.BAND, pb.BOR, pb.BXOR]


class Wire:
    """The nodes' mailboxes in memory: what ``CommPeers`` carries over sockets."""

    def __init__(self, timeout_s: float = 20.0) -> None:
        self.mail: dict[tuple[int, ...], Frame] = {}
        self.cond = threading.Condition()
        self.timeout_s = timeout_s

    def peers(self, me: int) -> Peers:
        return Peers(self, me)


class Peers:
    def __init__(self, wire: Wire, me: int) -> None:
        self.wire, self.me = wire, me

    def send(
        self, node: int, ftype: int, req: pb.OpRequest | None, round_: int = 0,
        payloads: Sequence[np.ndarray | bytes] = (),
    ) -> None:  # fmt: skip
        r = req or pb.OpRequest()
        data = b"".join(
            np.ascontiguousarray(p).tobytes() if isinstance(p, np.ndarray) else p for p in payloads
        )
        header = pack_header(
            ftype, self.me, len(data), kind=r.kind, dtype=r.dtype, seq=r.seq, part=r.part,
            parts=r.parts, round_=round_, count=r.count, root=r.root, reduce_op=r.reduce_op,
        )  # fmt: skip
        frame, _ = unpack_header(header)
        frame.payload = np.frombuffer(data, dtype=np.uint8)
        with self.wire.cond:
            self.wire.mail[(node, r.seq, r.part, round_, self.me)] = frame
            self.wire.cond.notify_all()

    def recv(self, seq: int, part: int, round_: int, node: int) -> Frame:
        key = (self.me, seq, part, round_, node)
        with self.wire.cond:
            if not self.wire.cond.wait_for(lambda: key in self.wire.mail, self.wire.timeout_s):
                raise PeerError(f"op #{seq}: node {node} sent nothing")
            return self.wire.mail.pop(key)


class Comm:
    """What ``gpu`` needs of a daemon Communicator spanning nodes."""

    def __init__(self, nodes: tuple[tuple[int, ...], ...], me: int, chunk_bytes: int) -> None:
        self.nodes = [list(r) for r in nodes]
        self.my_node = me
        self.chunk_bytes = chunk_bytes
        self.timeout_s = 20.0
        specs = tuple(NodeSpec(f"n{i}", f"10.0.0.{i + 1}:1") for i in range(len(nodes)))
        self.layout = Layout("j", "c", nodes, me, specs)

    def name(self) -> str:
        return f"job j comm c (node n{self.my_node})"

    def failed(self) -> tuple[int, str] | None:
        return None


def values(dtype: int, n: int, *key: int) -> np.ndarray:
    rng = np.random.default_rng([n, *key])
    dt = numpy_dtype(dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, n).astype(np.bool_)
    if dt.kind in "iu":
        return rng.integers(np.iinfo(dt).min, np.iinfo(dt).max, n, endpoint=True, dtype=dt)
    return (rng.standard_normal(n) * 10).astype(np.float32).astype(dt)


def _arena(nbytes: int) -> Arena:
    fd = os.memfd_create("smddp-test", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, max(64, nbytes))
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return Arena(fd, max(64, nbytes), "test")


class Op:
    """One op's per-rank inputs (lists of arrays) and output sizes (elements)."""

    def __init__(self, kind: int, dtype: int, count: int, root: int = 0, reduce_op: int = 0):
        self.kind, self.dtype, self.count = kind, dtype, count
        self.root, self.reduce_op = root, reduce_op
        self.ins: dict[int, list[np.ndarray]] = {}
        self.out_sizes: dict[int, list[int]] = {}
        self.in_place = kind in (pb.ALL_REDUCE, pb.BROADCAST, pb.REDUCE)


def make_op(kind: int, dtype: int, n: int, world: int, root: int = 0, reduce_op: int = 0) -> Op:
    op = Op(kind, dtype, n, root, reduce_op)
    for r in range(world):
        if kind in (pb.ALL_REDUCE, pb.REDUCE, pb.BROADCAST):
            op.ins[r], op.out_sizes[r] = [values(dtype, n, kind, r)], [n]
        elif kind in (pb.ALL_GATHER, pb.GATHER):
            gets = kind == pb.ALL_GATHER or r == root
            op.ins[r], op.out_sizes[r] = [values(dtype, n, kind, r)], [n] * world if gets else []
        elif kind in (pb.REDUCE_SCATTER, pb.SCATTER):
            gives = kind == pb.REDUCE_SCATTER or r == root
            op.ins[r] = [values(dtype, n, kind, r, q) for q in range(world)] if gives else []
            op.out_sizes[r] = [n]
        elif kind == pb.ALL_TO_ALL:
            size = lambda s, d: (s * 5 + d * 3 + 4) % 7 * n // 6  # noqa: E731 (some are 0)
            op.ins[r] = [values(dtype, size(r, d), kind, r, d) for d in range(world)]
            op.out_sizes[r] = [size(s, r) for s in range(world)]
            op.count = sum(size(r, d) for d in range(world))
        else:  # barrier
            op.ins[r], op.out_sizes[r] = [], []
    return op


def _req(op: Op, rank: int, seq: int) -> pb.OpRequest:
    r = pb.OpRequest(seq=seq, part=0, parts=1, kind=op.kind, dtype=op.dtype, count=op.count)
    r.root, r.reduce_op = op.root, op.reduce_op
    return r


def run_gpu(
    op: Op,
    nodes: tuple[tuple[int, ...], ...],
    chunk_bytes: int,
    queued: bool = False,
    seq: int = 1,
    recv_timeout_s: float = 20.0,
) -> tuple[dict[int, list[np.ndarray]], list[Any], list[gpu.GpuOps], list[Comm]]:
    """Runs ``op`` on the GPU path of every node at once; every rank's outputs (its inputs,
    for an in-place op), each node's runtime, ops and communicator."""
    wire = Wire(recv_timeout_s)
    world = sum(len(r) for r in nodes)
    outs: dict[int, list[Buffer]] = {}
    errors: dict[int, BaseException] = {}
    runtimes, opses, comms, calls = [], [], [], []
    for i, ranks in enumerate(nodes):
        rt = QueuedFakeRuntime() if queued else FakeRuntime()
        ops, comm = gpu.GpuOps(rt), Comm(nodes, i, chunk_bytes)
        sessions, reqs = [], []
        for r in sorted(ranks):
            ins = []
            for x in op.ins[r]:
                b = Buffer(rt.allocate(max(1, x.nbytes) + 64), 32, x.size, op.dtype)
                b.array()[...] = x
                ins.append(b)
            if op.in_place:
                outs[r] = ins
            else:
                outs[r] = [
                    Buffer(rt.allocate(max(1, m) * 8 + 64), 16, m, op.dtype)
                    for m in op.out_sizes[r]
                ]
            req = request(op.kind, op.dtype, op.count, r, ins, outs[r], root=op.root,
                          reduce_op=op.reduce_op, seq=seq)  # fmt: skip
            sessions.append(FakeSession(r, f"n{i}"))
            reqs.append(req)
        exchange = _exchange(comm, wire.peers(i))
        calls.append((ops, comm, sorted(ranks), sessions, reqs, exchange))
        runtimes.append(rt)
        opses.append(ops)
        comms.append(comm)

    def node(i: int) -> None:
        ops, comm, ranks, sessions, reqs, exchange = calls[i]
        try:
            ops.execute_across(comm, ranks, sessions, reqs, exchange)  # type: ignore[arg-type]
        except BaseException as exc:
            errors[i] = exc

    threads = [threading.Thread(target=node, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise next(iter(errors.values()))
    if queued:  # the fake GPU runs what was queued
        for rt in runtimes:
            for stream in list(rt._queues):
                rt.synchronize(stream, stream.device)
    got = {r: [b.array().copy() for b in outs[r]] for r in range(world)}
    return got, runtimes, opses, comms


def _exchange(comm: Comm, peers: Peers):
    def exchange(reqs: dict[int, pb.OpRequest], arenas: dict[int, Arena]) -> None:
        hierarchical.execute(comm.layout, peers, reqs, arenas)  # type: ignore[arg-type]

    return exchange


def run_host(op: Op, nodes: tuple[tuple[int, ...], ...]) -> dict[int, list[np.ndarray]]:
    """The host path on the same inputs: one chunk of the exchange over arenas."""
    wire = Wire()
    world = sum(len(r) for r in nodes)
    dt = numpy_dtype(op.dtype) if op.kind != pb.BARRIER else np.dtype(np.uint8)
    arenas, reqs, out_regions = {}, {}, {}
    for r in range(world):
        req = _req(op, r, 1)
        off = 0

        def region(nbytes: int) -> pb.Region:
            nonlocal off
            reg = pb.Region(offset=off, nbytes=nbytes)
            off += -(-nbytes // 64) * 64 + 64
            return reg

        ins = [region(x.nbytes) for x in op.ins[r]]
        outs = [region(m * dt.itemsize) for m in op.out_sizes[r]]
        if op.kind == pb.ALL_TO_ALL:
            req.send_blocks.extend(ins)
            req.recv_blocks.extend(outs)
        elif op.kind in (pb.ALL_REDUCE, pb.REDUCE, pb.BROADCAST):
            req.input.CopyFrom(ins[0])
            req.output.CopyFrom(ins[0])
            outs = ins
        elif op.kind != pb.BARRIER:
            if ins:  # W blocks side by side: one region
                req.input.CopyFrom(pb.Region(offset=ins[0].offset, nbytes=0))
                req.input.nbytes = sum(x.nbytes for x in op.ins[r])
            if outs:
                req.output.CopyFrom(pb.Region(offset=outs[0].offset, nbytes=0))
                req.output.nbytes = sum(m * dt.itemsize for m in op.out_sizes[r])
        arena = _arena(off + 64 * (world + 2) * 8)
        arenas[r], reqs[r] = arena, req
        if op.kind in (pb.ALL_TO_ALL, pb.ALL_REDUCE, pb.REDUCE, pb.BROADCAST):
            for reg, x in zip(ins, op.ins[r]):
                arena.view(reg, dt)[:] = x
            out_regions[r] = outs
        else:
            if op.ins[r]:
                arena.view(req.input, dt)[:] = np.concatenate(op.ins[r])
            n = op.count
            out_regions[r] = [
                pb.Region(offset=req.output.offset + k * n * dt.itemsize, nbytes=n * dt.itemsize)
                for k in range(len(op.out_sizes[r]))
            ]
    errors: list[BaseException] = []

    def node(i: int) -> None:
        comm = Comm(nodes, i, 1 << 20)
        ranks = nodes[i]
        try:
            hierarchical.execute(
                comm.layout,
                wire.peers(i),  # type: ignore[arg-type]
                {r: reqs[r] for r in ranks},
                {r: arenas[r] for r in ranks},
            )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return {r: [arenas[r].view(reg, dt).copy() for reg in out_regions[r]] for r in range(world)}


def assert_same(op: Op, got: dict[int, list[np.ndarray]], want: dict[int, list[np.ndarray]]):
    for r in want:
        if op.kind == pb.REDUCE and r != op.root:
            continue  # only the root's tensor is a result
        assert len(got[r]) == len(want[r]), r
        for k, (g, w) in enumerate(zip(got[r], want[r])):
            assert g.tobytes() == w.tobytes(), (
                f"rank {r} buffer {k}: got {g[:6]} want {w[:6]} ({op.kind}, {op.dtype})"
            )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: pb.DType.Name(d))
def test_all_reduce_with_every_op_is_the_host_path_s_bits(dtype: int) -> None:
    for reduce_op in OPS:
        if reduce_op_check(dtype, reduce_op):
            continue
        op = make_op(pb.ALL_REDUCE, dtype, 37, 4, reduce_op=reduce_op)
        got, *_ = run_gpu(op, TWO_BY_TWO, chunk_bytes=48)  # several chunks
        assert_same(op, got, run_host(op, TWO_BY_TWO))


KINDS = [pb.BROADCAST, pb.REDUCE, pb.ALL_GATHER, pb.GATHER, pb.SCATTER, pb.REDUCE_SCATTER,
         pb.ALL_TO_ALL, pb.BARRIER]  # fmt: skip


@pytest.mark.parametrize("nodes", [TWO_BY_TWO, UNEVEN], ids=["2x2", "3+1-interleaved"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: pb.OpKind.Name(k))
def test_every_collective_is_the_host_path_s_bits(kind: int, nodes) -> None:
    for dtype, reduce_op in ((pb.FLOAT32, pb.SUM), (pb.BFLOAT16, pb.AVG), (pb.INT64, pb.MIN)):
        if kind == pb.BARRIER and dtype != pb.FLOAT32:
            continue
        if reduce_op == pb.AVG and kind not in (pb.REDUCE, pb.REDUCE_SCATTER):
            reduce_op = pb.SUM
        for root in (0, 3) if kind in (pb.BROADCAST, pb.REDUCE, pb.GATHER, pb.SCATTER) else (0,):
            op = make_op(kind, dtype, 23, 4, root=root, reduce_op=reduce_op)
            got, *_ = run_gpu(op, nodes, chunk_bytes=40)
            assert_same(op, got, run_host(op, nodes))


def test_a_large_op_stays_within_two_reused_staging_buffers_freed_with_the_comm() -> None:
    op = make_op(pb.ALL_GATHER, pb.FLOAT32, 20000, 4)
    got, rts, opses, comms = run_gpu(op, TWO_BY_TWO, chunk_bytes=8192)
    assert_same(op, got, run_host(op, TWO_BY_TWO))
    for rt, ops, comm in zip(rts, opses, comms):
        pool = ops._staging(comm)  # type: ignore[arg-type]
        chunks = len([c for c in rt.calls("copy") if c[2] >= 0x2000_0000_0000]) // 2
        assert chunks > 10  # ... down copies into staging, 2 ranks per chunk: many chunks
        assert pool.allocated <= 2 and len(rt.host) <= 2, rt.host
        assert max(rt.host.values()) <= 64 << 10  # a chunk's staging: about chunk_bytes
        ops.release_comm(comm)  # type: ignore[arg-type]
    for rt in rts:
        deadline = threading.Event()
        for _ in range(200):
            if not rt.host:
                break
            deadline.wait(0.05)
        assert not rt.host, f"pinned buffers left after the communicator closed: {rt.host}"


def test_done_events_follow_every_write_and_the_first_work_waits_for_ready() -> None:
    """On streams that run in order (and block, as a GPU's): each rank's done event is
    recorded after the last copy into its buffers, and the first copy out of them waits
    on the gate (the ranks' ready events)."""
    op = make_op(pb.ALL_REDUCE, pb.FLOAT32, 300, 4, reduce_op=pb.SUM)
    got, rts, _, _ = run_gpu(op, TWO_BY_TWO, chunk_bytes=256, queued=True)
    assert_same(op, got, run_host(op, TWO_BY_TWO))
    for rt in rts:
        work = [c for c in rt.log if c[0] in ("wait_flag", "reduce", "copy", "record")]
        first_work = next(i for i, c in enumerate(work) if c[0] in ("reduce", "copy"))
        assert any(c[0] == "wait_flag" for c in work[:first_work]), work[:first_work]
        last_write = max(i for i, c in enumerate(work) if c[0] == "copy")
        dones = [i for i, c in enumerate(work) if c[0] == "record" and "done" in repr(c[1])]
        assert len(dones) == 2 and min(dones) > last_write, work[-8:]


def test_mismatched_buffers_on_one_node_are_named() -> None:
    op = make_op(pb.ALL_GATHER, pb.FLOAT32, 8, 4)
    op.out_sizes[2] = [8] * 3  # rank 2 gives three outputs for a world of four
    with pytest.raises(InvalidRequest, match="rank 2 names 1 input and 3 output GPU buffers"):
        run_gpu(op, TWO_BY_TWO, chunk_bytes=1 << 16, recv_timeout_s=1.0)
