"""The daemon path: ops cut into chunks, copied through the arena's ring, run by the daemon.

Each op is cut into chunks whose arena footprint fits the daemon's ``chunk_bytes``; each
chunk's input is copied into a free block of the ring, its request sent, and the caller goes
on. The daemon works on chunk k while this process copies chunk k+1; when the ring is full
the oldest chunk is retired (its reply awaited, its output copied out). All ranks cut an op
the same way, since they share ``chunk_bytes`` and the op's shape. GPU ops travel here too,
as one request without a block, so that they retire in order with the host ops.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from smddp.client.arena import ALIGN, RingAllocator
from smddp.client.errors import SmddpError, op_error
from smddp.client.inflight import InFlight
from smddp.client.session import DaemonSession
from smddp.v1 import smddp_pb2 as pb

# The daemon enforces the op timeout; this is the client's own last resort on top of it.
REPLY_GRACE_S = 30.0
# The numbering slot of a rank's receives from any source (the daemon's ``ANY_SOURCE``).
ANY_SOURCE = -1

Regions = dict[str, tuple[int, int] | list[tuple[int, int]]]
Copies = Sequence[tuple[np.ndarray, int]]  # (array, offset in the chunk's block)


@dataclass(eq=False)
class _Chunk:
    op: InFlight
    request_id: int
    copy_out: list[tuple[np.ndarray, int]]  # (destination, arena offset)
    # A GPU op's chunk holds no arena block; after(ok) runs when its reply is retired.
    after: Callable[[bool], None] | None = None
    recv_bytes: int = 0  # ring bytes a receive holds until its sender's data arrives
    # A receive from any source: its other chunks, sent once the reply names the sender.
    rest: list[_Deferred] | None = None
    message: _Message | None = None


@dataclass(eq=False)
class _Message:
    """A receive's number among the messages from its peer, given when its first chunk
    goes out (``_flush_deferred``): receives behind one from any source wait in the queue,
    and only once its sender is known can theirs be counted."""

    peer: int  # ANY_SOURCE until the daemon names the sender
    seq: int = 0


@dataclass(eq=False)
class _Deferred:
    op: InFlight
    req: pb.OpRequest
    layout: BlockLayout
    copy_out: Copies
    regions: Regions
    message: _Message | None = None
    rest: list[_Deferred] | None = None  # chunk 0 of a receive from any source: the others


class BlockLayout:
    """Offsets of a chunk's regions relative to its block, each aligned."""

    def __init__(self) -> None:
        self.size = 0

    def add(self, nbytes: int) -> int:
        """Reserves ``nbytes``; returns their offset in the block."""
        off = self.size
        self.size += -(-nbytes // ALIGN) * ALIGN
        return off


def _part(template: pb.OpRequest, part: int, parts: int) -> pb.OpRequest:
    """A copy of an op's request template for one of its parts."""
    req = pb.OpRequest()
    req.CopyFrom(template)
    req.part, req.parts = part, parts
    return req


def _ranges(n: int, per: int, parts: int) -> list[tuple[int, int]]:
    """The element ranges of an op's ``parts`` chunks of ``per`` elements out of ``n``."""
    return [(p * per, min(n, (p + 1) * per)) for p in range(parts)]


class DaemonEngine:
    """One rank's chunks on their way through the daemon; the caller holds the lock."""

    def __init__(self, session: DaemonSession, ring_bytes: int, timeout_s: float) -> None:
        self.session = session
        self.timeout_s = timeout_s
        self.chunk_bytes = session.chunk_bytes
        self.world_size = session.world_size
        self.ring = RingAllocator(ring_bytes)
        self._outstanding: collections.deque[_Chunk] = collections.deque()
        # Receives hold their block until the sender's data comes, so they may fill at most
        # half the ring: sends (which the daemon copies out at once) then always find room,
        # and two ranks that both post a large irecv before their isend cannot block each
        # other. Receive chunks past that wait here, in order, and go out as earlier ones
        # retire.
        self._recv_cap = ring_bytes // 2
        self._recv_bytes = 0
        self._deferred: collections.deque[_Deferred] = collections.deque()
        self._flushing = False
        # A receive from any source is out and its sender not yet known: the receives behind
        # it wait in ``_deferred``, since their numbers depend on which rank it took.
        self._any_open = False
        self._p2p_seq: dict[tuple[int, int], int] = {}
        self._ids = itertools.count(1)

    # -- chunks -------------------------------------------------------------------------------

    def busy(self) -> bool:
        """True while a chunk awaits its reply."""
        return bool(self._outstanding)

    def _submit(
        self,
        op: InFlight,
        req: pb.OpRequest,
        layout: BlockLayout,
        copy_in: Copies,
        copy_out: Copies,
        regions: Regions,
        recv_bytes: int = 0,
        deferred: _Deferred | None = None,
    ) -> None:
        """Places one chunk in the ring and sends it; ``regions`` hold relative offsets.

        ``recv_bytes``: the chunk is a receive (``_flush_deferred``), already counted in ``op``;
        ``deferred`` is its queue entry.
        """
        base = self.ring.alloc(layout.size)
        while base is None:
            self.retire_oldest()
            base = self.ring.alloc(layout.size)
        arena = self.session.arena
        for src, off in copy_in:
            np.copyto(arena.view(base + off, src.size, src.dtype), src)
        for name, value in regions.items():
            if isinstance(value, list):
                blocks = getattr(req, name)
                blocks.extend(pb.Region(offset=base + o, nbytes=n) for o, n in value)
            else:
                o, n = value
                getattr(req, name).CopyFrom(pb.Region(offset=base + o, nbytes=n))
        req.request_id = next(self._ids)
        chunk = _Chunk(
            op, req.request_id, [(dst, base + off) for dst, off in copy_out], recv_bytes=recv_bytes
        )
        if deferred is not None and deferred.rest is not None:
            chunk.rest, chunk.message = deferred.rest, deferred.message
        if not recv_bytes:
            op.pending += 1
        self._send(chunk, req)

    def _send(self, chunk: _Chunk, req: pb.OpRequest) -> None:
        self._outstanding.append(chunk)
        try:
            self.session.send(req)
        except SmddpError as exc:
            # Retiring the chunk meets the same broken connection and frees its block.
            chunk.op.error = chunk.op.error or exc

    def _flush_deferred(self) -> None:
        """Sends the waiting receive chunks, in order, while they fit under the cap and no
        receive from any source before them waits for its sender."""
        if self._flushing:
            return  # a submit below retires chunks, which calls here again
        self._flushing = True
        try:
            while self._deferred and not self._any_open:
                d = self._deferred[0]
                size = d.layout.size
                if self._recv_bytes and self._recv_bytes + size > self._recv_cap:
                    return
                self._deferred.popleft()
                self._recv_bytes += size
                message = d.message
                if message is not None:
                    if d.req.part == 0:
                        message.seq = self.next_p2p_seq(message.peer, pb.RECV)
                        d.op.seq = message.seq
                    d.req.seq = message.seq
                if d.req.any_source:
                    self._any_open = True
                self._submit(
                    d.op, d.req, d.layout, [], d.copy_out, d.regions, recv_bytes=size, deferred=d
                )
        finally:
            self._flushing = False

    def _sender_known(self, chunk: _Chunk, source: int | None) -> None:
        """The reply to a receive from any source's first chunk is in: its other chunks go
        out as plain receives from ``source`` (None: it failed, and they never will)."""
        self._any_open = False
        rest = chunk.rest or []
        if source is None:
            chunk.op.pending -= len(rest)
            return
        chunk.op.source = source
        # Numbered as the daemon numbered the first chunk: the next message from source.
        seq = self.next_p2p_seq(source, pb.RECV)
        if chunk.message is not None:
            chunk.message.peer, chunk.message.seq = source, seq
        for d in rest:
            d.req.root = source
        self._deferred.extendleft(reversed(rest))

    def retire_oldest(self) -> None:
        """Waits for the oldest chunk's reply and copies its output out (or records its error)."""
        chunk = self._outstanding.popleft()
        ok = False
        source: int | None = None
        try:
            reply = self.session.wait_reply(chunk.request_id, self.timeout_s + REPLY_GRACE_S)
        except SmddpError as exc:
            chunk.op.error = chunk.op.error or exc
        else:
            if reply.ok:
                ok = True
                source = reply.source_rank
                arena = self.session.arena
                for dst, off in chunk.copy_out:
                    np.copyto(dst, arena.view(off, dst.size, dst.dtype))
            elif chunk.op.error is None:
                chunk.op.error = op_error(reply.error_kind, reply.error)
        finally:
            if chunk.after is None:
                self.ring.free_oldest()
            else:
                chunk.after(ok)
            chunk.op.pending -= 1
            if chunk.rest is not None:
                self._sender_known(chunk, source if ok else None)
            if chunk.recv_bytes:
                self._recv_bytes -= chunk.recv_bytes
                self._flush_deferred()

    def retire_through(self, op: InFlight) -> None:
        """Retires chunks, oldest first, until ``op`` has none left."""
        while op.pending > 0 and self._outstanding:
            self.retire_oldest()

    def retire_ready(self, op: InFlight) -> None:
        """Retires the chunks whose replies are here, oldest first, while ``op`` has some left.

        Nobody else makes progress for a rank: without this, polling ``is_completed()``
        would spin forever.
        """
        while op.pending > 0 and self._outstanding:
            try:
                if not self.session.has_reply(self._outstanding[0].request_id):
                    break
            except SmddpError:
                pass  # retiring the chunk meets the same error and records it
            self.retire_oldest()

    def drain(self) -> None:
        """Retires every chunk still in flight."""
        while self._outstanding:
            self.retire_oldest()

    def settle_receives(self) -> None:
        """Retires chunks until every receive has its number: no receive waits in the queue
        (a GPU receive, numbered at once, must not overtake them)."""
        while (self._deferred or self._any_open) and self._outstanding:
            self.retire_oldest()

    def parts(self, n: int, bytes_per_element: int) -> tuple[int, int]:
        """Elements per chunk and chunks, for ``n`` elements of that footprint."""
        per = max(1, self.chunk_bytes // max(1, bytes_per_element))
        return per, max(1, -(-n // per))

    # -- the ops, cut into chunks --------------------------------------------------------------

    def elementwise(
        self, op: InFlight, template: pb.OpRequest, data: np.ndarray, send: bool, receive: bool
    ) -> None:
        """all_reduce, broadcast, reduce: chunk p holds elements of one range, in and out."""
        s = data.dtype.itemsize
        per, parts = self.parts(data.size, s)
        for p, (a, b) in enumerate(_ranges(data.size, per, parts)):
            layout = BlockLayout()
            off = layout.add((b - a) * s)
            self._submit(
                op,
                _part(template, p, parts),
                layout,
                [(data[a:b], off)] if send else [],
                [(data[a:b], off)] if receive else [],
                {"input": (off, (b - a) * s), "output": (off, (b - a) * s)},
            )

    def gathered(
        self,
        op: InFlight,
        template: pb.OpRequest,
        src: np.ndarray,
        outs: list[np.ndarray] | None,
    ) -> None:
        """all_gather, gather: a chunk's input range, and that range of every rank's output."""
        self._one_and_all(op, template, src, outs, gather=True)

    def scattered(
        self,
        op: InFlight,
        template: pb.OpRequest,
        out: np.ndarray,
        ins: list[np.ndarray] | None,
    ) -> None:
        """reduce_scatter, scatter: that range of every rank's input, and the output range."""
        self._one_and_all(op, template, out, ins, gather=False)

    def _one_and_all(
        self,
        op: InFlight,
        template: pb.OpRequest,
        mine: np.ndarray,
        every: list[np.ndarray] | None,
        gather: bool,
    ) -> None:
        """Chunks of this rank's array ``mine`` beside the same range of one array per rank
        (``every``, None where this rank has none): ``mine`` is the input and ``every`` the
        outputs when ``gather``, the other way round otherwise. The input comes first in a
        chunk's block."""
        s, w = mine.dtype.itemsize, self.world_size
        per, parts = self.parts(mine.size, s * (1 + w))
        for p, (a, b) in enumerate(_ranges(mine.size, per, parts)):
            n = b - a
            wide = n * s * w if every is not None else 0
            layout = BlockLayout()
            if gather:
                first = layout.add(n * s)
                second = layout.add(wide) if every is not None else 0
            else:
                first = layout.add(wide) if every is not None else 0
                second = layout.add(n * s)
            off_mine, off_every = (first, second) if gather else (second, first)
            copies = (
                [(x[a:b], off_every + r * n * s) for r, x in enumerate(every)]
                if every is not None
                else []
            )
            own = [(mine[a:b], off_mine)]
            self._submit(
                op,
                _part(template, p, parts),
                layout,
                own if gather else copies,
                copies if gather else own,
                {
                    "input": (first, n * s if gather else wide),
                    "output": (second, wide if gather else n * s),
                },
            )

    def all_to_all(
        self,
        op: InFlight,
        template: pb.OpRequest,
        ins: list[np.ndarray],
        outs: list[np.ndarray],
        need: int,
    ) -> None:
        """all_to_all in the same number of chunks on every rank: ``need`` is the largest
        footprint of any rank (the caller agreed on it with the others)."""
        s, w = ins[0].dtype.itemsize, self.world_size
        usable = max(self.chunk_bytes - 2 * w * ALIGN, self.chunk_bytes // 2)
        parts = max(1, -(-need // usable))
        for p in range(parts):
            layout = BlockLayout()
            sends: list[tuple[int, int]] = []
            recvs: list[tuple[int, int]] = []
            copy_in: list[tuple[np.ndarray, int]] = []
            copy_out: list[tuple[np.ndarray, int]] = []
            for arrays, blocks, copies in ((ins, sends, copy_in), (outs, recvs, copy_out)):
                for x in arrays:
                    a, b = x.size * p // parts, x.size * (p + 1) // parts
                    off = layout.add((b - a) * s)
                    blocks.append((off, (b - a) * s))
                    copies.append((x[a:b], off))
            self._submit(
                op,
                _part(template, p, parts),
                layout,
                copy_in,
                copy_out,
                {"send_blocks": sends, "recv_blocks": recvs},
            )

    def barrier(self, op: InFlight, template: pb.OpRequest) -> None:
        """A barrier: one part, no data."""
        template.parts = 1
        self._submit(op, template, BlockLayout(), [], [], {})

    def next_p2p_seq(self, peer: int, kind: int) -> int:
        """Point-to-point ops are numbered per peer and direction."""
        seq = self._p2p_seq.get((peer, kind), 0) + 1
        self._p2p_seq[(peer, kind)] = seq
        return seq

    def point_to_point(
        self, op: InFlight, template: pb.OpRequest, data: np.ndarray, any_source: bool = False
    ) -> None:
        """send or recv (``template.kind``) of ``data``, in chunks; from any source when
        ``any_source`` (a receive; ``template.root`` is then unused).

        A send is numbered now. A receive is numbered when its first chunk goes out, and its
        chunks go out in order behind the receives before it, within ``_recv_cap``; a
        receive from any source sends its first chunk alone, and the others once the
        daemon's reply names the sender (``_sender_known``).
        """
        s = data.dtype.itemsize
        per, parts = self.parts(data.size, s)
        if template.kind == pb.SEND:
            template.seq = self.next_p2p_seq(template.root, pb.SEND)
            op.seq = template.seq
        message = _Message(ANY_SOURCE if any_source else template.root)
        chunks: list[_Deferred] = []
        for p, (a, b) in enumerate(_ranges(data.size, per, parts)):
            layout = BlockLayout()
            off = layout.add((b - a) * s)
            req = _part(template, p, parts)
            region = (off, (b - a) * s)
            if template.kind == pb.SEND:
                self._submit(op, req, layout, [(data[a:b], off)], [], {"input": region})
            else:
                chunks.append(
                    _Deferred(op, req, layout, [(data[a:b], off)], {"output": region}, message)
                )
        if not chunks:
            return
        op.pending += len(chunks)
        if any_source:
            first = chunks[0]
            first.req.any_source = True
            first.rest = chunks[1:]
            chunks = [first]
        else:
            op.source = template.root
        self._deferred.extend(chunks)
        self._flush_deferred()

    def gpu(self, op: InFlight, req: pb.OpRequest, after: Callable[[bool], None]) -> None:
        """Sends one numbered GPU op (one part, no block); ``after(ok)`` runs at its retiring."""
        req.part, req.parts = 0, 1
        req.request_id = next(self._ids)
        op.pending += 1
        self._send(_Chunk(op, req.request_id, [], after), req)
