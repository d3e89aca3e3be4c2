"""A node's share of a GPU op that spans nodes, laid out chunk by chunk in pinned host memory.

The daemon runs such an op in three phases per chunk (``gpu.GpuOps.execute_across``):
*down*, the node's GPU tensors into a staging buffer (reduced by the GPU kernels for a
reduction, copied side by side, in rank order, for the other kinds); *exchange*, the same
node-to-node algorithms as for host memory (``hierarchical.execute``), which see the staging
buffer as the ranks' arenas (``StagingArena``) through requests whose regions name it; *up*,
the results from the staging buffer into every local rank's GPU tensors. This module is the
plan of those phases (pure arithmetic, no CUDA) and the bounded pool of staging buffers.

What the exchange sees is exactly what the host path hands it, so the bits are the host
path's: an all_reduce, broadcast, reduce or barrier brings the node's share as one request
(the node's partial, reduced on the GPU in rank order with AVG summed, as the control region
combines a node's ranks for ``OpRequest.node_combined``); the other kinds bring one request
per local rank. A reduce_scatter stages every local rank's input: the exchange reduces the
node's ranks itself, as its interface takes no node partial for that kind.

Every node cuts an op into the same chunks, from what every node knows alike (the op's
shape, the layout and the communicator's chunk size), so that their frames meet; an
all_to_all, whose block sizes only their own node knows, first agrees on the largest
node's footprint (its chunk 0, an all_reduce MAX of one int64) and numbers its data chunks
from 1. A chunk's staging stays within about the communicator's chunk size.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from smddp.core.wire import describe_request, numpy_dtype
from smddp.server.arena import Arena
from smddp.server.errors import FailedPrecondition, InvalidRequest
from smddp.v1 import smddp_pb2 as pb

# Regions of a staging buffer start on this boundary: the copies and the vectorised kernels
# (16-byte accesses) stay aligned.
ALIGN = 64
# Staging buffers a communicator keeps: one chunk in the exchange while the next one is
# copied down (its point-to-point ops take turns with its collectives).
POOL_BUFFERS = 2
# Buffers are allocated in multiples of this, so that the chunks of one op share them.
POOL_GRANULE = 64 << 10


@dataclass(frozen=True)
class GpuRef:
    """Bytes of one local rank's GPU buffer: its ``index``-th input (or output), from byte
    ``offset`` of it."""

    rank: int
    index: int
    offset: int


@dataclass(frozen=True)
class Down:
    """``nbytes`` into the staging buffer at ``at``: a copy of one source, or the reduction
    of several (in rank order) of ``count`` elements."""

    at: int
    nbytes: int
    count: int
    sources: tuple[GpuRef, ...]


@dataclass(frozen=True)
class Up:
    """``nbytes`` of the staging buffer at ``at`` into an output of a local rank."""

    at: int
    nbytes: int
    target: GpuRef


@dataclass
class Chunk:
    """One chunk of a node's share: its staging size, what the exchange sees, and the copies
    on either side of it."""

    part: int
    parts: int
    size: int = 0
    reqs: dict[int, pb.OpRequest] = field(default_factory=dict)
    down: list[Down] = field(default_factory=list)
    up: list[Up] = field(default_factory=list)

    def region(self, nbytes: int) -> pb.Region:
        """Reserves ``nbytes`` of the staging buffer (aligned)."""
        region = pb.Region(offset=self.size, nbytes=nbytes)
        self.size += -(-nbytes // ALIGN) * ALIGN
        return region


@dataclass(frozen=True)
class Local:
    """One local rank's op as the plan needs it: the sizes of its GPU buffers (bytes), and
    whether its output is its input (an in-place op)."""

    rank: int
    req: pb.OpRequest
    in_bytes: tuple[int, ...]
    out_bytes: tuple[int, ...]
    in_place: bool = False


class Shape:
    """What every node knows of an op alike: its request's fields, the world and the layout.

    Args:
        req: the op (any local rank's request: they matched).
        local: this node's ranks, in rank order.
        nodes: every node's ranks (the communicator's layout).
        chunk_bytes: the communicator's chunk size.
    """

    def __init__(
        self,
        req: pb.OpRequest,
        local: Sequence[Local],
        nodes: Sequence[Sequence[int]],
        chunk_bytes: int,
    ) -> None:
        self.req = req
        self.local = list(local)
        self.by_rank = {x.rank: x for x in local}
        self.world = sum(len(ranks) for ranks in nodes)
        self.widest = max(len(ranks) for ranks in nodes)
        self.chunk_bytes = max(1, chunk_bytes)
        self.itemsize = numpy_dtype(req.dtype).itemsize if req.kind != pb.BARRIER else 1
        self.who = describe_request(req)

    def request(self, x: Local, part: int, parts: int) -> pb.OpRequest:
        """Rank ``x``'s request for the exchange: its op's fields, no GPU buffers, one chunk."""
        r = pb.OpRequest(
            seq=x.req.seq,
            kind=x.req.kind,
            dtype=x.req.dtype,
            count=x.req.count,
            root=x.req.root,
            reduce_op=x.req.reduce_op,
            tag=x.req.tag,
        )
        r.part, r.parts = part, parts
        return r

    def need(self, x: Local, inputs: int | None, outputs: int | None) -> None:
        """Checks that rank ``x`` names ``inputs`` and ``outputs`` GPU buffers."""
        got = (len(x.in_bytes), len(x.out_bytes))
        want = (got[0] if inputs is None else inputs, got[1] if outputs is None else outputs)
        if got != want:
            raise InvalidRequest(
                f"{self.who}: "
                f"rank {x.rank} names {got[0]} input and {got[1]} output GPU buffers where {want[0]} and {want[1]} were expected"  # noqa: E501
            )

    def sized(self, x: Local, sizes: Sequence[int], elements: int, what: str) -> None:
        """Checks that each of rank ``x``'s buffers ``sizes`` holds ``elements`` elements."""
        for nbytes in sizes:
            if nbytes != elements * self.itemsize:
                raise InvalidRequest(
                    f"{self.who}: "
                    f"rank {x.rank}'s {what} holds {nbytes} bytes where {elements} x {self.itemsize} were expected (tensors of mismatched sizes?)"  # noqa: E501
                )


def _ranges(n: int, per: int) -> list[tuple[int, int]]:
    """``[0, n)`` in ranges of ``per`` elements, as the client cuts host ops (one empty
    range for an empty op, which still meets the other nodes)."""
    return [(a, min(n, a + per)) for a in range(0, n, per)] or [(0, 0)]


def plan(shape: Shape, a2a_parts: int = 0) -> list[Chunk]:
    """The chunks of this node's share of the op, after checking its ranks' buffers.

    Args:
        a2a_parts: an all_to_all's agreed number of data chunks (``a2a_agreement``).

    Raises:
        InvalidRequest: buffers that do not fit the op.
    """
    kind = shape.req.kind
    if kind == pb.BARRIER:
        chunk = Chunk(0, 1)
        lowest = shape.local[0]
        chunk.reqs[lowest.rank] = shape.request(lowest, 0, 1)
        return [chunk]
    planner = _PLANNERS.get(kind)
    if planner is None:
        raise InvalidRequest(f"{shape.who} cannot run as a GPU collective across nodes")
    if kind == pb.ALL_TO_ALL:
        return _all_to_all(shape, a2a_parts)
    return planner(shape)


def _elementwise(shape: Shape) -> list[Chunk]:
    """all_reduce, broadcast, reduce: the node's share is one range of the tensor."""
    req, s, n = shape.req, shape.itemsize, shape.req.count
    kind, root = req.kind, req.root
    for x in shape.local:
        shape.need(x, 1, 1)
        if kind != pb.BROADCAST or x.rank == root:
            shape.sized(x, x.in_bytes, n, "input")
        shape.sized(x, x.out_bytes, n, "output")
    ranks = [x.rank for x in shape.local]
    # The one request the exchange sees: the node's lowest rank's, or for a reduce the
    # root's where it is here (the exchange writes the result to the root's output).
    carrier = shape.by_rank[root] if kind == pb.REDUCE and root in ranks else shape.local[0]
    ranges = _ranges(n, max(1, shape.chunk_bytes // s))
    chunks = []
    for p, (a, b) in enumerate(ranges):
        m = b - a
        c = Chunk(p, len(ranges))
        region = c.region(m * s)
        r = shape.request(carrier, p, len(ranges))
        r.input.CopyFrom(region)
        r.output.CopyFrom(region)
        c.reqs[carrier.rank] = r
        if kind == pb.BROADCAST:
            if root in ranks:
                c.down.append(Down(region.offset, m * s, m, (GpuRef(root, 0, a * s),)))
            targets = [x.rank for x in shape.local if x.rank != root or not x.in_place]
        else:
            sources = tuple(GpuRef(x.rank, 0, a * s) for x in shape.local)
            c.down.append(Down(region.offset, m * s, m, sources))
            targets = ranks if kind == pb.ALL_REDUCE else [root] if root in ranks else []
        c.up.extend(Up(region.offset, m * s, GpuRef(t, 0, a * s)) for t in targets)
        chunks.append(c)
    return chunks


def _gathered(shape: Shape) -> list[Chunk]:
    """all_gather, gather: every local rank's input range, side by side; the world's blocks
    of that range for the ranks that get them."""
    req, s, n, w = shape.req, shape.itemsize, shape.req.count, shape.world
    everywhere = req.kind == pb.ALL_GATHER
    getters = [x for x in shape.local if everywhere or x.rank == req.root]
    for x in shape.local:
        shape.need(x, 1, w if x in getters else 0)
        shape.sized(x, x.in_bytes, n, "input")
        shape.sized(x, x.out_bytes, n, "output")
    ranges = _ranges(n, max(1, shape.chunk_bytes // (s * (1 + w))))
    chunks = []
    for p, (a, b) in enumerate(ranges):
        m = b - a
        c = Chunk(p, len(ranges))
        ins = [c.region(m * s) for _ in shape.local]
        # One output for every rank that gets one: they all get the same blocks.
        out = c.region(w * m * s) if getters else None
        for x, region in zip(shape.local, ins):
            r = shape.request(x, p, len(ranges))
            r.input.CopyFrom(region)
            if out is not None and x in getters:
                r.output.CopyFrom(out)
            c.reqs[x.rank] = r
            c.down.append(Down(region.offset, m * s, m, (GpuRef(x.rank, 0, a * s),)))
        if out is not None:
            c.up.extend(
                Up(out.offset + q * m * s, m * s, GpuRef(x.rank, q, a * s))
                for x in getters
                for q in range(w)
            )
        chunks.append(c)
    return chunks


def _scattered(shape: Shape) -> list[Chunk]:
    """scatter, reduce_scatter: the world's blocks of one range from the ranks that give
    them; every local rank's output range."""
    req, s, n, w = shape.req, shape.itemsize, shape.req.count, shape.world
    reducing = req.kind == pb.REDUCE_SCATTER
    givers = [x for x in shape.local if reducing or x.rank == req.root]
    for x in shape.local:
        shape.need(x, w if x in givers else 0, 1)
        shape.sized(x, x.in_bytes, n, "input")
        shape.sized(x, x.out_bytes, n, "output")
    # A reduce_scatter stages W blocks per local rank: the widest node's ranks bound it.
    wide = (1 + w) * (shape.widest if reducing else 1)
    ranges = _ranges(n, max(1, shape.chunk_bytes // (s * wide)))
    chunks = []
    for p, (a, b) in enumerate(ranges):
        m = b - a
        c = Chunk(p, len(ranges))
        for x in shape.local:
            r = shape.request(x, p, len(ranges))
            if x in givers:
                blocks = c.region(w * m * s)
                r.input.CopyFrom(blocks)
                c.down.extend(
                    Down(blocks.offset + q * m * s, m * s, m, (GpuRef(x.rank, q, a * s),))
                    for q in range(w)
                )
            out = c.region(m * s)
            r.output.CopyFrom(out)
            c.up.append(Up(out.offset, m * s, GpuRef(x.rank, 0, a * s)))
            c.reqs[x.rank] = r
        chunks.append(c)
    return chunks


def a2a_footprint(shape: Shape) -> int:
    """Bytes an all_to_all's blocks take on this node, sent and received, after checking
    that each local rank names W blocks each way, whole elements each."""
    total = 0
    for x in shape.local:
        shape.need(x, shape.world, shape.world)
        for nbytes in (*x.in_bytes, *x.out_bytes):
            if nbytes % shape.itemsize:
                raise InvalidRequest(
                    f"{shape.who}: "
                    f"rank {x.rank} names a block of {nbytes} bytes, not a whole number of {shape.itemsize}-byte elements"  # noqa: E501
                )
            total += nbytes
    return total


def a2a_agreement(shape: Shape, footprint: int) -> tuple[Chunk, np.ndarray]:
    """Chunk 0 of an all_to_all: the nodes' largest footprint, an all_reduce MAX of one
    int64 (returns the chunk and the value to put at its region's start)."""
    lowest = shape.local[0]
    c = Chunk(0, 1)
    r = shape.request(lowest, 0, 1)
    r.kind, r.dtype, r.count, r.reduce_op = pb.ALL_REDUCE, pb.INT64, 1, pb.MAX
    region = c.region(8)
    r.input.CopyFrom(region)
    r.output.CopyFrom(region)
    c.reqs[lowest.rank] = r
    return c, np.array([footprint], dtype=np.int64)


def a2a_parts(largest: int, chunk_bytes: int) -> int:
    """Data chunks of an all_to_all whose largest node moves ``largest`` bytes."""
    return max(1, -(-largest // max(1, chunk_bytes)))


def _all_to_all(shape: Shape, parts: int) -> list[Chunk]:
    """Chunk p of P holds elements [e p / P, e (p + 1) / P) of every block of e elements, as
    the client cuts host all_to_alls; data chunks are numbered from 1 (after the agreement)."""
    s, w = shape.itemsize, shape.world
    chunks = []
    for p in range(parts):
        c = Chunk(p + 1, parts + 1)
        for x in shape.local:
            r = shape.request(x, p + 1, parts + 1)
            for blocks, sizes, down in (
                (r.send_blocks, x.in_bytes, True),
                (r.recv_blocks, x.out_bytes, False),
            ):
                for q in range(w):
                    e = sizes[q] // s
                    a, b = e * p // parts, e * (p + 1) // parts
                    region = c.region((b - a) * s)
                    blocks.append(region)
                    ref = GpuRef(x.rank, q, a * s)
                    if down:
                        c.down.append(Down(region.offset, region.nbytes, b - a, (ref,)))
                    else:
                        c.up.append(Up(region.offset, region.nbytes, ref))
            c.reqs[x.rank] = r
        chunks.append(c)
    return chunks


_PLANNERS: dict[int, Callable[[Shape], list[Chunk]]] = {
    pb.ALL_REDUCE: _elementwise,
    pb.BROADCAST: _elementwise,
    pb.REDUCE: _elementwise,
    pb.ALL_GATHER: _gathered,
    pb.GATHER: _gathered,
    pb.SCATTER: _scattered,
    pb.REDUCE_SCATTER: _scattered,
    pb.ALL_TO_ALL: lambda shape: [],  # planned by _all_to_all once the parts are agreed
}


def p2p_ranges(req: pb.OpRequest, chunk_bytes: int) -> list[tuple[int, int]]:
    """The element ranges of a send or recv's chunks, as the client cuts host ones: the
    frames of a GPU send meet a host recv across nodes and the other way round."""
    return _ranges(req.count, max(1, chunk_bytes // numpy_dtype(req.dtype).itemsize))


# -- the staging buffers ------------------------------------------------------------------------


class StagingArena(Arena):
    """A staging buffer as the exchange sees a rank's arena (``view`` checks the bounds)."""

    def __init__(self, data: np.ndarray, owner: str) -> None:  # no memfd: pinned memory
        self.owner = owner
        self.nbytes = data.nbytes
        self.fd = -1
        self._data = data

    def view(self, region: pb.Region, dtype: np.dtype) -> np.ndarray:
        off, n = region.offset, region.nbytes
        if off + n > self.nbytes or n % dtype.itemsize:
            raise InvalidRequest(
                f"{self.owner}: "
                f"staging region [{off}, {off + n}) does not fit its {self.nbytes} bytes as {dtype}"
            )
        return self._data[off : off + n].view(dtype)

    def close(self) -> None:
        """The pool frees the memory."""


@dataclass(eq=False)
class Staging:
    """One pinned host buffer of a pool: its address for the GPU, its bytes for the host.

    ``events`` (one per GPU, made and recorded by the caller) mark the end of the GPU work
    that reads the buffer; ``pending`` are those recorded since its last use: it is handed
    out again once they have fired.
    """

    address: int = 0
    data: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8))
    events: dict[int, Any] = field(default_factory=dict)
    pending: list[tuple[Any, int]] = field(default_factory=list)
    taken: bool = False

    @property
    def capacity(self) -> int:
        return int(self.data.nbytes)

    def arena(self, owner: str) -> StagingArena:
        """The buffer as the exchange's arena."""
        return StagingArena(self.data, owner)


class StagingPool:
    """A communicator's pinned staging buffers: at most ``POOL_BUFFERS``, reused.

    ``take`` returns a buffer that holds a chunk once the GPU work that read it last has
    finished (``wait`` blocks on its pending events, outside the pool's lock); with every
    buffer taken it waits for one to come back. A buffer too small for a larger chunk is
    freed and allocated anew.

    Args:
        rt: the runtime (``alloc_host``, ``free_host``, ``destroy_event``).
        wait: blocks until the events given have fired (raises past the op's timeout).
    """

    def __init__(
        self,
        rt: Any,
        wait: Callable[[list[tuple[Any, int]]], None],
        limit: int = POOL_BUFFERS,
    ) -> None:
        self.rt = rt
        self._wait = wait
        self._limit = limit
        self._buffers: list[Staging] = []
        self._cond = threading.Condition()
        self._closed = False
        self.allocated = 0  # buffers ever allocated (tests check the reuse)

    @property
    def closed(self) -> bool:
        """True once ``close`` ran."""
        return self._closed

    def take(self, nbytes: int, device: int) -> Staging:
        """A buffer of at least ``nbytes`` (allocated, if need be, with ``device`` current).

        Raises:
            FailedPrecondition: the pool was closed (the communicator is gone).
        """
        replaced: Staging | None = None
        with self._cond:
            while True:
                if self._closed:
                    raise FailedPrecondition("the communicator's GPU staging is closed")
                free = [b for b in self._buffers if not b.taken]
                fits = [b for b in free if b.capacity >= nbytes]
                if fits:
                    buf = min(fits, key=lambda b: b.capacity)
                elif len(self._buffers) < self._limit or free:
                    if len(self._buffers) >= self._limit:
                        replaced = max(free, key=lambda b: b.capacity)
                        self._buffers.remove(replaced)
                    buf = Staging()  # allocated below, outside the lock
                    self._buffers.append(buf)
                else:
                    self._cond.wait()
                    continue
                buf.taken = True
                break
        try:
            if replaced is not None:
                self._wait(replaced.pending)
                self._release(replaced)
            if buf.capacity == 0:
                size = max(POOL_GRANULE, -(-nbytes // POOL_GRANULE) * POOL_GRANULE)
                address, view = self.rt.alloc_host(size, device)
                buf.address, buf.data = address, np.frombuffer(view, np.uint8)
                self.allocated += 1
            else:
                self._wait(buf.pending)
                buf.pending = []
        except BaseException:
            with self._cond:
                if buf.capacity == 0:
                    self._buffers.remove(buf)
                else:
                    buf.taken = False
                self._cond.notify_all()
            raise
        return buf

    def give(self, buf: Staging, pending: list[tuple[Any, int]]) -> None:
        """Returns ``buf``; the GPU work before the ``pending`` events may still read it."""
        with self._cond:
            buf.pending = pending
            buf.taken = False
            closed = self._closed
            if closed and buf in self._buffers:
                self._buffers.remove(buf)
            self._cond.notify_all()
        if closed:  # the communicator closed while this op ran: its buffer goes now
            self._wait(pending)
            self._release(buf)

    def _release(self, buf: Staging) -> None:
        for device, event in buf.events.items():
            self.rt.destroy_event(event, device)
        buf.events, buf.pending = {}, []
        if buf.capacity:
            self.rt.free_host(buf.address)
            buf.data = np.empty(0, np.uint8)

    def close(self) -> None:
        """Frees every buffer not in use (those in use go when given back): the
        communicator's streams have finished their work."""
        with self._cond:
            self._closed = True
            idle = [b for b in self._buffers if not b.taken]
            self._buffers = [b for b in self._buffers if b.taken]
            self._cond.notify_all()
        for buf in idle:
            self._release(buf)
