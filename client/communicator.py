"""Numpy collectives over a daemon session: cut into chunks, copied through the arena.

Each call numbers its op, cuts it into chunks whose arena footprint fits the daemon's
``chunk_bytes``, copies each chunk's input into a free block of the arena, submits it and
returns a Handle at once. The daemon works on chunk k while this process copies chunk k+1;
when the arena is full the oldest chunk is retired (its reply awaited, its output copied
out). ``Handle.wait`` retires up to the handle's last chunk. All ranks cut an op the same
way, since they share ``chunk_bytes`` and the op's shape.
"""

from __future__ import annotations

import collections
import itertools
import os
import socket
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from smddp.client.arena import ALIGN, RingAllocator
from smddp.client.errors import SmddpError, UnsupportedError, op_error
from smddp.client.progress import ProgressThread
from smddp.client.session import DaemonSession
from smddp.client.shm import ShmPath
from smddp.reduce import _BOOL_UFUNCS, _UFUNCS
from smddp.region import DEFAULT_DATA_BYTES, H_ALARM
from smddp.v1 import smddp_pb2 as pb
from smddp.wire import P2P_KINDS, WIRE_DTYPES, reduce_op_check, socket_candidates

if TYPE_CHECKING:
    from smddp.client.cuda_ops import CudaCollectives

DEFAULT_ARENA_BYTES = 64 << 20
ENV_ARENA_BYTES = "SMDDP_ARENA_BYTES"
# all_reduce of at least this many bytes on a single-node communicator runs "direct": every
# rank reduces its own segment straight from the others' arenas. Must be equal on all ranks.
ENV_DIRECT_MIN_BYTES = "SMDDP_DIRECT_MIN_BYTES"
DEFAULT_DIRECT_MIN_BYTES = 256 << 10
# Direct ops move their data in chunks of this many bytes (per rank): small enough that a
# chunk's buffers stay in the caches (the user's tensors stream from memory once), large
# enough that a chunk's Python work and synchronisation stay small beside its copies. Ranks
# that share cores pay a context switch at every synchronisation, so they take larger
# chunks (measured: 4 ranks on 2 cores, 16 MiB all_reduce, 2 MiB chunks 10-15% faster than
# 1 MiB; 2 ranks, 1 MiB chunks faster than 4 MiB). Must be equal on all ranks: the default
# depends on the node's CPU count, never on a rank's affinity.
ENV_DIRECT_CHUNK_BYTES = "SMDDP_DIRECT_CHUNK_BYTES"
DEFAULT_DIRECT_CHUNK_BYTES = 1 << 20
SHARED_CORES_DIRECT_CHUNK_BYTES = 2 << 20
# A chunk's buffer is reused DIRECT_BUFFERS chunks later: at least the number of steps a
# chunk's work spans (all_reduce: copy in, reduce, copy out), so that no rank overwrites a
# buffer another still reads.
DIRECT_BUFFERS = 3
# SMDDP_REGION=0 sends every op through the daemon (the control region stays unused).
ENV_REGION = "SMDDP_REGION"
# The daemon enforces the op timeout; this is the client's own last resort on top of it.
REPLY_GRACE_S = 30.0


@dataclass(eq=False)
class _Chunk:
    handle: Handle
    request_id: int
    copy_out: list[tuple[np.ndarray, int]]  # (destination, arena offset)
    # A GPU op's chunk holds no arena block; after(ok) runs when its reply is retired.
    after: Callable[[bool], None] | None = None
    recv_bytes: int = 0  # ring bytes a receive holds until its sender's data arrives


@dataclass(eq=False)
class Handle:
    """An op in flight; ``wait`` blocks until its outputs are written."""

    comm: Communicator
    description: str
    pending: int = 0
    error: SmddpError | None = None
    callbacks: list = field(default_factory=list)
    # An op on the shared-memory path that waits for its completion: (seq, step, finish, count).
    shm: tuple | None = None
    # Set once an op that the progress thread runs has finished.
    event: threading.Event | None = None

    def wait(self) -> None:
        """Waits for the op, then raises the daemon's error if it failed."""
        self.comm._retire_through(self)
        if self.error is not None:
            raise self.error

    def done(self) -> bool:
        """True once every chunk has been retired."""
        return self.pending == 0

    def poll(self) -> bool:
        """Retires what has completed without blocking; True once the op is done."""
        return self.comm._poll(self)


class _Layout:
    """Offsets of a chunk's regions relative to its block, each aligned."""

    def __init__(self) -> None:
        self.size = 0

    def add(self, nbytes: int) -> int:
        off = self.size
        self.size += -(-nbytes // ALIGN) * ALIGN
        return off


def _flat(array: np.ndarray, what: str, writable: bool = False) -> np.ndarray:
    if array.dtype not in WIRE_DTYPES:
        raise UnsupportedError(
            f"{what}: dtype {array.dtype} is not supported (float16, bfloat16, float32, float64, "
            "int8, uint8, int16, int32, int64, bool)"
        )
    if writable:
        if not array.flags.c_contiguous:
            raise UnsupportedError(f"{what}: output arrays must be C-contiguous")
        if not array.flags.writeable:
            raise UnsupportedError(f"{what}: output array is read-only")
    return array.reshape(-1)


def _part(template: pb.OpRequest, part: int, parts: int) -> pb.OpRequest:
    """A copy of an op's request template for one of its parts."""
    req = pb.OpRequest()
    req.CopyFrom(template)
    req.part, req.parts = part, parts
    return req


def _direct_chunk_bytes(world_size: int) -> int:
    default = (
        DEFAULT_DIRECT_CHUNK_BYTES
        if world_size <= (os.cpu_count() or 1)
        else SHARED_CORES_DIRECT_CHUNK_BYTES
    )
    return max(ALIGN, int(os.environ.get(ENV_DIRECT_CHUNK_BYTES, default)))


def _ranges(n: int, per: int, parts: int) -> list[tuple[int, int]]:
    """The element ranges of an op's ``parts`` chunks of ``per`` elements out of ``n``."""
    return [(p * per, min(n, (p + 1) * per)) for p in range(parts)]


class Communicator:
    """The numpy collectives of one rank in one communicator."""

    def __init__(self, session: DaemonSession, timeout_s: float, single_node: bool = True) -> None:
        self.session = session
        self.rank = session.rank
        self.world_size = session.world_size
        self.timeout_s = timeout_s
        self.chunk_bytes = session.chunk_bytes
        self.single_node = single_node
        self._cuda: CudaCollectives | None = None
        # The arena's first half is a ring for chunks the daemon moves; the second half holds
        # the buffers of direct ops, at the same offsets in every rank's arena.
        half = session.arena.nbytes // 2
        self._ring = RingAllocator(half)
        # Direct ops' buffers, in the second half: DIRECT_BUFFERS of them, used in turn.
        self._direct_base = half
        self._direct_buffer = max(
            ALIGN,
            min(_direct_chunk_bytes(session.world_size), half // DIRECT_BUFFERS) // ALIGN * ALIGN,
        )
        self._direct_count = 0
        self._direct_min = (
            int(os.environ.get(ENV_DIRECT_MIN_BYTES, DEFAULT_DIRECT_MIN_BYTES))
            if single_node and session.world_size > 1
            else -1
        )
        self._peer_maps: list[np.ndarray] | None = None
        self._outstanding: collections.deque[_Chunk] = collections.deque()
        # Receives hold their block until the sender's data comes, so they may fill at most half
        # the ring: sends (which the daemon copies out at once) then always find room, and two
        # ranks that both post a large irecv before their isend cannot block each other.
        # Receive chunks past that wait here, in order, and go out as earlier ones retire.
        self._recv_cap = half // 2
        self._recv_bytes = 0
        self._deferred: collections.deque[tuple[Handle, pb.OpRequest, _Layout, list, dict]] = (
            collections.deque()
        )
        self._flushing = False
        self._seq = 0
        self._p2p_seq: dict[tuple[int, int], int] = {}
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._closed = False
        # The shared-memory path: every collective it can carry, between the ranks.
        self._use_shm = (
            single_node and session.world_size > 1 and os.environ.get(ENV_REGION, "1") != "0"
        )
        self._shm: ShmPath | None = None
        self._shm_open: Handle | None = None  # its op whose completion is still due
        # Direct ops not yet started, which a blocking wait may run in its own thread.
        self._steal: weakref.WeakKeyDictionary[Handle, Callable[[], bool]] = (
            weakref.WeakKeyDictionary()
        )
        self._progress = ProgressThread(f"smddp-progress-{session.comm_id}")

    # -- the engine ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SmddpError(
                f"job {self.session.job_id} comm {self.session.comm_id}: rank {self.rank}: the "
                "communicator has been destroyed (destroy_process_group); create a new group"
            )

    def _submit(
        self,
        handle: Handle,
        req: pb.OpRequest,
        layout: _Layout,
        copy_in: Sequence[tuple[np.ndarray, int]],
        copy_out: Sequence[tuple[np.ndarray, int]],
        regions: dict[str, int | tuple[int, int] | list[tuple[int, int]]],
        recv_bytes: int = 0,
    ) -> None:
        """Places one chunk in the arena and sends it; ``regions`` hold relative offsets.

        ``recv_bytes``: the chunk is a receive (``_submit_recv``), already counted in its handle.
        """
        base = self._ring.alloc(layout.size)
        while base is None:
            self._retire_oldest()
            base = self._ring.alloc(layout.size)
        arena = self.session.arena
        for src, off in copy_in:
            np.copyto(arena.view(base + off, src.size, src.dtype), src)
        for name, value in regions.items():
            if name in ("send_blocks", "recv_blocks"):
                getattr(req, name).extend(pb.Region(offset=base + o, nbytes=n) for o, n in value)  # type: ignore[union-attr]
            else:
                o, n = value  # type: ignore[misc]
                getattr(req, name).CopyFrom(pb.Region(offset=base + o, nbytes=n))
        req.request_id = next(self._ids)
        chunk = _Chunk(
            handle,
            req.request_id,
            [(dst, base + off) for dst, off in copy_out],
            recv_bytes=recv_bytes,
        )
        if not recv_bytes:
            handle.pending += 1
        self._outstanding.append(chunk)
        try:
            self.session.send(req)
        except SmddpError as exc:
            # Retiring the chunk meets the same broken connection and frees its block.
            handle.error = handle.error or exc

    def _submit_recv(
        self, handle: Handle, req: pb.OpRequest, layout: _Layout, copy_out: list, regions: dict
    ) -> None:
        """Sends a receive chunk now, or once the receives before it leave room (``_recv_cap``)."""
        handle.pending += 1
        self._deferred.append((handle, req, layout, copy_out, regions))
        self._flush_deferred()

    def _flush_deferred(self) -> None:
        """Sends the waiting receive chunks, in order, while they fit under the cap."""
        if self._flushing:
            return  # a submit below retires chunks, which calls here again
        self._flushing = True
        try:
            while self._deferred:
                handle, req, layout, copy_out, regions = self._deferred[0]
                if self._recv_bytes and self._recv_bytes + layout.size > self._recv_cap:
                    return
                self._deferred.popleft()
                self._recv_bytes += layout.size
                self._submit(handle, req, layout, [], copy_out, regions, recv_bytes=layout.size)
        finally:
            self._flushing = False

    def _retire_oldest(self) -> None:
        chunk = self._outstanding.popleft()
        ok = False
        try:
            reply = self.session.wait_reply(chunk.request_id, self.timeout_s + REPLY_GRACE_S)
        except SmddpError as exc:
            chunk.handle.error = chunk.handle.error or exc
        else:
            if reply.ok:
                ok = True
                arena = self.session.arena
                for dst, off in chunk.copy_out:
                    np.copyto(dst, arena.view(off, dst.size, dst.dtype))
            elif chunk.handle.error is None:
                chunk.handle.error = op_error(reply.error_kind, reply.error)
        finally:
            if chunk.after is None:
                self._ring.free_oldest()
            else:
                chunk.after(ok)
            chunk.handle.pending -= 1
            if chunk.handle.pending == 0:
                for cb in chunk.handle.callbacks:
                    cb(chunk.handle)
            if chunk.recv_bytes:
                self._recv_bytes -= chunk.recv_bytes
                self._flush_deferred()

    def _retire_through(self, handle: Handle) -> None:
        if handle.event is not None:
            steal = self._steal.pop(handle, None)
            if steal is None or not steal():
                handle.event.wait()  # the progress thread runs it; nothing to do here
            return
        with self._lock:
            if handle.shm is not None:
                self._complete_shm(handle)
                return
            while handle.pending > 0 and self._outstanding:
                self._retire_oldest()

    def _poll(self, handle: Handle) -> bool:
        if handle.event is not None:
            return handle.event.is_set()
        if handle.shm is not None:
            if handle.pending and self._shm is not None and self._lock.acquire(blocking=False):
                try:
                    q, target = self._shm.q, handle.shm[1]
                    if all(q[w] >= target for _, w, _ in self._shm.others) or q[H_ALARM]:
                        self._complete_shm(handle)
                finally:
                    self._lock.release()
            return handle.done()
        # Nobody else makes progress for a rank: without this, polling is_completed() spins forever.
        if self._lock.acquire(blocking=False):
            try:
                while handle.pending > 0 and self._outstanding:
                    try:
                        if not self.session.has_reply(self._outstanding[0].request_id):
                            break
                    except SmddpError:
                        pass  # retiring the chunk meets the same error and records it
                    self._retire_oldest()
            finally:
                self._lock.release()
        return handle.done()

    # -- the shared-memory path ---------------------------------------------------------------

    def _shm_path(self) -> ShmPath:
        """The control region and the peers' arenas, mapped at the first op that needs them."""
        if self._shm is None:
            while self._outstanding:  # the arenas' reply must be the next message
                self._retire_oldest()
            self._peer_maps, region = self.session.peer_arenas()
            self._shm = ShmPath(
                f"job {self.session.job_id} comm {self.session.comm_id}",
                self.rank,
                region,
                self.timeout_s,
                self.session.alive,
                self.session.gone,
            )
        return self._shm

    def _complete_shm(self, handle: Handle) -> None:
        """Waits for the others at the op's synchronisation, checks that the ranks agree,
        then runs the op's finish (reduce or copy out)."""
        if not handle.pending:
            return
        seq, parity, target, finish, kind, dtype, nbytes = handle.shm  # type: ignore[misc]
        shm = self._shm
        assert shm is not None
        try:
            shm.wait(target, seq)
            shm.agree(seq, parity)
            if finish is not None:
                finish(parity)
            shm.done(seq, parity, kind, dtype, nbytes)
        except SmddpError as exc:
            handle.error = exc
        finally:
            handle.pending = 0
            if self._shm_open is handle:
                self._shm_open = None
            for cb in handle.callbacks:
                cb(handle)

    def _shm_op(
        self,
        kind: int,
        dtype: np.dtype | None,
        count: int,
        root: int,
        reduce_op: int,
        nbytes: int,
        fill: Callable[[int], None] | None,
        finish: Callable[[int], None] | None,
    ) -> Handle:
        """Starts an op whose data fits a region buffer: ``fill(parity)`` copies this rank's
        input in, then the rank arrives; ``Handle.wait`` runs ``finish(parity)``."""
        with self._lock:
            self._check_open()
            try:
                shm = self._shm_path()
            except SmddpError as exc:
                return self._failed_handle(exc)
            if self._shm_open is not None:
                # Its data must be read before this rank arrives at the next op (double
                # buffering lets the others run one op ahead, not two).
                self._complete_shm(self._shm_open)
            self._seq += 1
            seq = self._seq
            handle = Handle(self, f"op #{seq}")
            code = WIRE_DTYPES[dtype] if dtype is not None and kind != pb.BARRIER else 0

            if self._progress.busy():
                # Behind a large op on the progress thread: keep the ranks' order there.
                handle.event = threading.Event()
                handle.pending = 1

                def run() -> None:
                    if self._shm_start(
                        handle, shm, seq, kind, code, count, root, reduce_op, nbytes, fill, finish
                    ):
                        self._complete_shm(handle)
                    handle.pending = 0
                    handle.event.set()  # type: ignore[union-attr]

                self._progress.submit(run)
                return handle
            if self._shm_start(
                handle, shm, seq, kind, code, count, root, reduce_op, nbytes, fill, finish
            ):
                self._shm_open = handle
            return handle

    @staticmethod
    def _shm_start(
        handle: Handle,
        shm: ShmPath,
        seq: int,
        kind: int,
        code: int,
        count: int,
        root: int,
        reduce_op: int,
        nbytes: int,
        fill: Callable[[int], None] | None,
        finish: Callable[[int], None] | None,
    ) -> bool:
        """Copies this rank's input in and arrives at op ``seq``; False (the error in the
        handle) when the communicator has failed."""
        try:
            shm.check()
            parity = shm.next_parity()
            if fill is not None:
                fill(parity)
            target = shm.publish(seq, parity, kind, code, count, root, reduce_op)
        except SmddpError as exc:
            handle.error = exc
            return False
        handle.pending = 1
        handle.shm = (seq, parity, target, finish, kind, code, nbytes)
        return True

    def _failed_handle(self, exc: SmddpError) -> Handle:
        handle = Handle(self, "op")
        handle.error = exc
        return handle

    def _fits(self, nbytes: int) -> bool:
        return self._use_shm and nbytes <= self._shm_data_bytes()

    def _shm_data_bytes(self) -> int:
        return self._shm.data_bytes if self._shm is not None else DEFAULT_DATA_BYTES

    def _shm_reduce(self, out: np.ndarray, ins: list[np.ndarray], reduce_op: int) -> None:
        """Reduces ``ins`` in rank order into ``out`` (``out`` aliases none of them)."""
        uf = _BOOL_UFUNCS[reduce_op] if out.dtype == np.bool_ else _UFUNCS[reduce_op]
        uf(ins[0], ins[1], out=out)
        for x in ins[2:]:
            uf(out, x, out=out)
        if reduce_op == pb.AVG:
            np.divide(out, np.asarray(len(ins), dtype=out.dtype), out=out)

    def _begin(
        self, kind: int, dtype: np.dtype | None, count: int, root: int = 0, reduce_op: int = 0
    ) -> tuple[Handle, pb.OpRequest]:
        self._check_open()
        self._seq += 1
        wire_dtype = WIRE_DTYPES[dtype] if dtype is not None else pb.DTYPE_UNSPECIFIED
        template = pb.OpRequest(
            seq=self._seq, kind=kind, dtype=wire_dtype, count=count, root=root, reduce_op=reduce_op
        )
        return Handle(self, f"op #{self._seq}"), template

    def _parts(self, n: int, bytes_per_element: int) -> tuple[int, int]:
        per = max(1, self.chunk_bytes // max(1, bytes_per_element))
        return per, max(1, -(-n // per))

    def _check_root(self, root: int, what: str) -> None:
        if not 0 <= root < self.world_size:
            raise UnsupportedError(f"{what}: rank {root} is outside a world of {self.world_size}")

    def _check_reduce(self, dtype: np.dtype, reduce_op: int) -> None:
        problem = reduce_op_check(WIRE_DTYPES[dtype], reduce_op)
        if problem:
            raise UnsupportedError(problem)

    def submit_gpu(self, req: pb.OpRequest, after: Callable[[bool], None], what: str) -> Handle:
        """Numbers and sends one GPU op (``req.cuda`` set; one part, no arena).

        ``after(ok)`` runs once, when the op's reply is retired (``ok``: it succeeded), in
        order with the other ops. GPU ops are built by ``self.cuda``.
        """
        with self._lock:
            self._check_open()
            if req.kind in P2P_KINDS:
                slot = (req.root, req.kind)
                req.seq = self._p2p_seq.get(slot, 0) + 1
                self._p2p_seq[slot] = req.seq
            else:
                self._seq += 1
                req.seq = self._seq
            req.part, req.parts = 0, 1
            req.request_id = next(self._ids)
            handle = Handle(self, f"{what} #{req.seq}")
            handle.pending += 1
            self._outstanding.append(_Chunk(handle, req.request_id, [], after))
            try:
                self.session.send(req)
            except SmddpError as exc:
                handle.error = handle.error or exc  # retiring the chunk meets it again
            return handle

    @property
    def cuda(self) -> CudaCollectives:
        """The collectives on GPU memory (CUDA IPC), set up on first use."""
        if self._cuda is None:
            from smddp.client.cuda_ops import CudaCollectives

            self._cuda = CudaCollectives(self)
        return self._cuda

    # -- collectives --------------------------------------------------------------------------

    def all_reduce(self, array: np.ndarray, reduce_op: int = pb.SUM) -> Handle:
        """Reduces ``array`` across ranks in place (rank order, bitwise identical everywhere)."""
        flat = _flat(array, "all_reduce", writable=True)
        self._check_reduce(flat.dtype, reduce_op)
        n = flat.size
        if self._fits(flat.nbytes):
            me = self.rank

            dtype = flat.dtype

            def fill(p: int) -> None:
                np.copyto(self._shm.sized(p, dtype, n)[me], flat)  # type: ignore[union-attr]

            def finish(p: int) -> None:
                self._shm_reduce(flat, self._shm.sized(p, dtype, n), reduce_op)  # type: ignore[union-attr]

            return self._shm_op(pb.ALL_REDUCE, dtype, n, 0, reduce_op, flat.nbytes, fill, finish)
        if self._use_shm or 0 <= self._direct_min <= flat.nbytes:
            return self._direct_all_reduce(flat, reduce_op)
        return self._elementwise(pb.ALL_REDUCE, flat, 0, reduce_op, send=True, receive=True)

    def _direct(
        self,
        kind: int,
        dtype: np.dtype,
        count: int,
        root: int,
        reduce_op: int,
        n: int,
        work: Callable[[int, int, list[np.ndarray]], Iterator[None]],
    ) -> Handle:
        """Runs an op "direct": the ranks move the data between their arenas themselves.

        The op's ``n`` elements per rank are cut into chunks that fit a buffer. For each
        chunk, ``work(a, b, bufs)`` gets the chunk's element range and every rank's buffer
        (mapped from the peers' arenas, rank order) and runs in steps: the code up to its
        first yield, then up to the next, and so on. The chunks are pipelined: step t runs
        chunk t's first step, chunk t-1's second, and so on, and then every rank waits until
        all have finished step t, in the control region (the first time with the op's
        signature, which the ranks compare). So a chunk's step may read what the other ranks
        wrote in its earlier steps, and the op needs one synchronisation per chunk plus one
        per step of a chunk beyond the first two, none after its last step. Buffers are
        used in turn, DIRECT_BUFFERS of them: one is written again only after every rank has
        passed the last step that reads it.

        A blocking call runs the op in the caller's thread when nothing else is queued
        (``wait`` claims it before the progress thread starts it): a thread handoff each way
        costs tens of microseconds on a busy host. Otherwise the progress thread runs it.
        """
        with self._lock:
            self._check_open()
            try:
                shm = self._shm_path()
            except SmddpError as exc:
                return self._failed_handle(exc)
            if self._shm_open is not None:
                self._complete_shm(self._shm_open)
            maps = self._peer_maps
            assert maps is not None
            self._seq += 1
            seq = self._seq
            handle = Handle(self, f"op #{seq}", pending=1, event=threading.Event())
            code = WIRE_DTYPES[dtype]
            s = dtype.itemsize
            size = self._direct_buffer
            per = max(1, size // s)
            chunks = max(1, -(-n // per))
            # Which buffer each chunk uses, fixed now: every rank numbers them alike.
            first_buffer = self._direct_count
            self._direct_count += chunks
            area = self._direct_base
            claim = threading.Lock()

            def run() -> None:
                first = True
                try:
                    shm.check()
                    parity = shm.next_parity()
                    active: collections.deque[Iterator[None]] = collections.deque()
                    c = 0
                    while True:
                        if c < chunks:
                            a, b = c * per, min(n, (c + 1) * per)
                            base = area + ((first_buffer + c) % DIRECT_BUFFERS) * size
                            bufs = [pm[base : base + (b - a) * s].view(dtype) for pm in maps]
                            active.append(work(a, b, bufs))
                            c += 1
                        for _ in range(len(active)):  # oldest chunk first
                            steps = active.popleft()
                            try:
                                next(steps)
                            except StopIteration:
                                continue
                            active.append(steps)
                        if not active and c == chunks:
                            break
                        if first:
                            shm.wait(
                                shm.publish(seq, parity, kind, code, count, root, reduce_op), seq
                            )
                            shm.agree(seq, parity)
                            first = False
                        else:
                            shm.wait(shm.bump(), seq)
                    shm.done(seq, parity, kind, code, count * s)
                except SmddpError as exc:
                    handle.error = exc
                except Exception as exc:  # a bug must fail the op, not hang its waiters
                    handle.error = SmddpError(
                        f"rank {self.rank}: op #{seq} failed in the progress thread: {exc!r}"
                    )
                finally:
                    handle.pending = 0
                    handle.event.set()  # type: ignore[union-attr]

            def queued() -> None:
                if claim.acquire(blocking=False):
                    run()
                else:
                    # The caller runs it: what was queued after it must still wait for it.
                    handle.event.wait()  # type: ignore[union-attr]

            def steal() -> bool:
                # Only when this op is the one thing queued: the ranks' order stays.
                if self._progress.queued == 1 and claim.acquire(blocking=False):
                    run()
                    return True
                return False

            self._progress.submit(queued)
            self._steal[handle] = steal
            return handle

    def _direct_all_reduce(self, flat: np.ndarray, reduce_op: int) -> Handle:
        """all_reduce, direct: rank r reduces segment r of each chunk from every rank's buffer,
        in rank order, then everyone copies the other segments from their owners' buffers."""
        w, me = self.world_size, self.rank

        def work(a: int, b: int, bufs: list[np.ndarray]) -> Iterator[None]:
            m = b - a
            lo, hi = m * me // w, m * (me + 1) // w
            # Only the others read our buffer, and only their own segments: ours stays home.
            np.copyto(bufs[me][:lo], flat[a : a + lo])
            np.copyto(bufs[me][hi:], flat[a + hi : b])
            yield
            mine = flat[a + lo : a + hi]
            result = bufs[me][lo:hi]  # for the others; it aliases none of the inputs
            self._shm_reduce(
                result, [mine if j == me else x[lo:hi] for j, x in enumerate(bufs)], reduce_op
            )
            np.copyto(mine, result)  # still in this core's cache
            yield
            for j in range(w):
                if j != me:
                    lo_j, hi_j = m * j // w, m * (j + 1) // w
                    np.copyto(flat[a + lo_j : a + hi_j], bufs[j][lo_j:hi_j])

        return self._direct(pb.ALL_REDUCE, flat.dtype, flat.size, 0, reduce_op, flat.size, work)

    def _direct_broadcast(self, flat: np.ndarray, root: int) -> Handle:
        """broadcast, direct: the root fills its buffer, the others copy from it."""
        me = self.rank

        def work(a: int, b: int, bufs: list[np.ndarray]) -> Iterator[None]:
            if me == root:
                np.copyto(bufs[me], flat[a:b])
            yield
            if me != root:
                np.copyto(flat[a:b], bufs[root])

        return self._direct(pb.BROADCAST, flat.dtype, flat.size, root, 0, flat.size, work)

    def _direct_all_gather(self, outs: list[np.ndarray], src: np.ndarray) -> Handle:
        """all_gather, direct: each rank fills its buffer, then copies every other rank's."""
        me = self.rank

        def work(a: int, b: int, bufs: list[np.ndarray]) -> Iterator[None]:
            np.copyto(bufs[me], src[a:b])
            np.copyto(outs[me][a:b], bufs[me])  # from the cache, not from src again
            yield
            for j, out in enumerate(outs):
                if j != me:
                    np.copyto(out[a:b], bufs[j])

        return self._direct(pb.ALL_GATHER, src.dtype, src.size, 0, 0, src.size, work)

    def broadcast(self, array: np.ndarray, root: int) -> Handle:
        """Copies the root's ``array`` into every rank's ``array``."""
        flat = _flat(array, "broadcast", writable=True)
        self._check_root(root, "broadcast")
        n, me = flat.size, self.rank
        if self._fits(flat.nbytes):

            def fill(p: int) -> None:
                if me == root:
                    np.copyto(self._shm.typed(p, flat.dtype)[me][:n], flat)  # type: ignore[union-attr]

            def finish(p: int) -> None:
                if me != root:
                    np.copyto(flat, self._shm.typed(p, flat.dtype)[root][:n])  # type: ignore[union-attr]

            return self._shm_op(pb.BROADCAST, flat.dtype, n, root, 0, flat.nbytes, fill, finish)
        if self._use_shm or 0 <= self._direct_min <= flat.nbytes:
            return self._direct_broadcast(flat, root)
        is_root = self.rank == root
        return self._elementwise(pb.BROADCAST, flat, root, 0, send=is_root, receive=not is_root)

    def reduce(self, array: np.ndarray, root: int, reduce_op: int = pb.SUM) -> Handle:
        """Reduces ``array`` across ranks into the root's ``array``."""
        flat = _flat(array, "reduce", writable=True)
        self._check_root(root, "reduce")
        self._check_reduce(flat.dtype, reduce_op)
        n, me = flat.size, self.rank
        if self._fits(flat.nbytes):

            def fill(p: int) -> None:
                np.copyto(self._shm.typed(p, flat.dtype)[me][:n], flat)  # type: ignore[union-attr]

            def finish(p: int) -> None:
                if me == root:
                    self._shm_reduce(
                        flat, [b[:n] for b in self._shm.typed(p, flat.dtype)], reduce_op
                    )  # type: ignore[union-attr]

            return self._shm_op(
                pb.REDUCE, flat.dtype, n, root, reduce_op, flat.nbytes, fill, finish
            )
        return self._elementwise(
            pb.REDUCE, flat, root, reduce_op, send=True, receive=self.rank == root
        )

    def _elementwise(
        self, kind: int, flat: np.ndarray, root: int, reduce_op: int, send: bool, receive: bool
    ) -> Handle:
        with self._lock:
            handle, template = self._begin(kind, flat.dtype, flat.size, root, reduce_op)
            s = flat.dtype.itemsize
            per, parts = self._parts(flat.size, s)
            for p, (a, b) in enumerate(_ranges(flat.size, per, parts)):
                layout = _Layout()
                off = layout.add((b - a) * s)
                req = _part(template, p, parts)
                self._submit(
                    handle,
                    req,
                    layout,
                    [(flat[a:b], off)] if send else [],
                    [(flat[a:b], off)] if receive else [],
                    {"input": (off, (b - a) * s), "output": (off, (b - a) * s)},
                )
            return handle

    def all_gather(self, outputs: Sequence[np.ndarray], array: np.ndarray) -> Handle:
        """Gathers every rank's ``array`` into ``outputs[r]`` on every rank."""
        return self._gather_like(pb.ALL_GATHER, outputs, array, 0, "all_gather")

    def gather(self, outputs: Sequence[np.ndarray] | None, array: np.ndarray, root: int) -> Handle:
        """Gathers every rank's ``array`` into ``outputs[r]`` on the root (None elsewhere)."""
        self._check_root(root, "gather")
        return self._gather_like(
            pb.GATHER, outputs if self.rank == root else None, array, root, "gather"
        )

    def _gather_like(
        self,
        kind: int,
        outputs: Sequence[np.ndarray] | None,
        array: np.ndarray,
        root: int,
        what: str,
    ) -> Handle:
        src = _flat(array, what)
        outs = self._per_rank(outputs, src.size, src.dtype, what, writable=True)
        n, me = src.size, self.rank
        if self._fits(src.nbytes):

            def fill(p: int) -> None:
                np.copyto(self._shm.typed(p, src.dtype)[me][:n], src)  # type: ignore[union-attr]

            def finish(p: int) -> None:
                if outs is not None:
                    bufs = self._shm.typed(p, src.dtype)  # type: ignore[union-attr]
                    for j, o in enumerate(outs):
                        np.copyto(o, src if j == me else bufs[j][:n])

            return self._shm_op(kind, src.dtype, n, root, 0, src.nbytes, fill, finish)
        if (
            kind == pb.ALL_GATHER
            and outs is not None
            and (self._use_shm or 0 <= self._direct_min <= src.nbytes)
        ):
            return self._direct_all_gather(outs, src)
        with self._lock:
            handle, template = self._begin(kind, src.dtype, src.size, root)
            s, w = src.dtype.itemsize, self.world_size
            per, parts = self._parts(src.size, s * (1 + w))
            for p, (a, b) in enumerate(_ranges(src.size, per, parts)):
                n = b - a
                layout = _Layout()
                off_in = layout.add(n * s)
                off_out = layout.add(n * s * w) if outs is not None else 0
                req = _part(template, p, parts)
                copy_out = (
                    [(o[a:b], off_out + r * n * s) for r, o in enumerate(outs)]
                    if outs is not None
                    else []
                )
                self._submit(
                    handle,
                    req,
                    layout,
                    [(src[a:b], off_in)],
                    copy_out,
                    {
                        "input": (off_in, n * s),
                        "output": (off_out, n * s * w if outs is not None else 0),
                    },
                )
            return handle

    def reduce_scatter(
        self, output: np.ndarray, inputs: Sequence[np.ndarray], reduce_op: int = pb.SUM
    ) -> Handle:
        """Rank r's ``output`` becomes the reduction over ranks of their ``inputs[r]``."""
        out = _flat(output, "reduce_scatter", writable=True)
        self._check_reduce(out.dtype, reduce_op)
        return self._scatter_like(pb.REDUCE_SCATTER, out, inputs, 0, reduce_op, "reduce_scatter")

    def scatter(self, output: np.ndarray, inputs: Sequence[np.ndarray] | None, root: int) -> Handle:
        """Rank r's ``output`` becomes the root's ``inputs[r]`` (``inputs`` None off the root)."""
        out = _flat(output, "scatter", writable=True)
        self._check_root(root, "scatter")
        return self._scatter_like(
            pb.SCATTER, out, inputs if self.rank == root else None, root, 0, "scatter"
        )

    def _scatter_like(
        self,
        kind: int,
        out: np.ndarray,
        inputs: Sequence[np.ndarray] | None,
        root: int,
        reduce_op: int,
        what: str,
    ) -> Handle:
        ins = self._per_rank(inputs, out.size, out.dtype, what, writable=False)
        n, me, w = out.size, self.rank, self.world_size
        if self._fits(out.nbytes * w):

            def fill(p: int) -> None:
                if ins is not None:
                    mine = self._shm.typed(p, out.dtype)[me]  # type: ignore[union-attr]
                    for j, x in enumerate(ins):
                        np.copyto(mine[j * n : (j + 1) * n], x)

            def finish(p: int) -> None:
                bufs = self._shm.typed(p, out.dtype)  # type: ignore[union-attr]
                if kind == pb.SCATTER:
                    np.copyto(out, bufs[root][me * n : (me + 1) * n])
                else:
                    self._shm_reduce(out, [b[me * n : (me + 1) * n] for b in bufs], reduce_op)

            return self._shm_op(
                kind,
                out.dtype,
                n,
                root,
                reduce_op,
                out.nbytes * w if ins is not None else 0,
                fill,
                finish,
            )
        with self._lock:
            handle, template = self._begin(kind, out.dtype, out.size, root, reduce_op)
            s, w = out.dtype.itemsize, self.world_size
            per, parts = self._parts(out.size, s * (1 + w))
            for p, (a, b) in enumerate(_ranges(out.size, per, parts)):
                n = b - a
                layout = _Layout()
                off_in = layout.add(n * s * w) if ins is not None else 0
                off_out = layout.add(n * s)
                req = _part(template, p, parts)
                copy_in = (
                    [(x[a:b], off_in + r * n * s) for r, x in enumerate(ins)]
                    if ins is not None
                    else []
                )
                self._submit(
                    handle,
                    req,
                    layout,
                    copy_in,
                    [(out[a:b], off_out)],
                    {
                        "input": (off_in, n * s * w if ins is not None else 0),
                        "output": (off_out, n * s),
                    },
                )
            return handle

    def _per_rank(
        self,
        arrays: Sequence[np.ndarray] | None,
        n: int,
        dtype: np.dtype,
        what: str,
        writable: bool,
    ) -> list[np.ndarray] | None:
        if arrays is None:
            return None
        if len(arrays) != self.world_size:
            raise UnsupportedError(
                f"{what}: expected {self.world_size} tensors (one per rank), got {len(arrays)}"
            )
        flats = [_flat(a, what, writable) for a in arrays]
        for r, f in enumerate(flats):
            if f.dtype != dtype:
                raise UnsupportedError(
                    f"{what}: tensor {r} has dtype {f.dtype} but the op is {dtype}"
                )
            if f.size != n:
                raise UnsupportedError(
                    f"{what}: tensor {r} has {f.size} elements where {n} were expected"
                )
        return flats

    def all_to_all(self, outputs: Sequence[np.ndarray], inputs: Sequence[np.ndarray]) -> Handle:
        """Sends ``inputs[d]`` to rank d, receiving rank s's block into ``outputs[s]``.

        Block sizes may differ (uneven splits); rank s's ``inputs[d]`` must match rank d's
        ``outputs[s]`` in size, which the daemon checks.
        """
        w = self.world_size
        if len(inputs) != w or len(outputs) != w:
            raise UnsupportedError(f"all_to_all: expected {w} input and {w} output tensors")
        ins = [_flat(x, "all_to_all") for x in inputs]
        outs = [_flat(x, "all_to_all", writable=True) for x in outputs]
        dtype = ins[0].dtype
        if any(x.dtype != dtype for x in ins + outs):
            raise UnsupportedError("all_to_all: every input and output must have the same dtype")
        s = dtype.itemsize
        need = np.array(
            [(sum(x.size for x in ins) + sum(x.size for x in outs)) * s], dtype=np.int64
        )
        with self._lock:
            # Every rank must cut the blocks into the same number of chunks: agree on the
            # largest footprint first (an op of its own in the sequence).
            self.all_reduce(need, pb.MAX).wait()
            usable = max(self.chunk_bytes - 2 * w * ALIGN, self.chunk_bytes // 2)
            parts = max(1, -(-int(need[0]) // usable))
            handle, template = self._begin(pb.ALL_TO_ALL, dtype, sum(x.size for x in ins))
            for p in range(parts):
                layout = _Layout()
                sends, recvs, copy_in, copy_out = [], [], [], []
                for x in ins:
                    a, b = x.size * p // parts, x.size * (p + 1) // parts
                    off = layout.add((b - a) * s)
                    sends.append((off, (b - a) * s))
                    copy_in.append((x[a:b], off))
                for x in outs:
                    a, b = x.size * p // parts, x.size * (p + 1) // parts
                    off = layout.add((b - a) * s)
                    recvs.append((off, (b - a) * s))
                    copy_out.append((x[a:b], off))
                req = _part(template, p, parts)
                self._submit(
                    handle,
                    req,
                    layout,
                    copy_in,
                    copy_out,
                    {"send_blocks": sends, "recv_blocks": recvs},
                )
            return handle

    def barrier(self) -> Handle:
        """Completes once every rank has called it."""
        if self._use_shm:
            return self._shm_op(pb.BARRIER, None, 0, 0, 0, 0, None, None)
        with self._lock:
            handle, template = self._begin(pb.BARRIER, None, 0)
            template.parts = 1
            self._submit(handle, template, _Layout(), [], [], {})
            return handle

    def send(self, array: np.ndarray, dst: int, tag: int = 0) -> Handle:
        """Sends ``array`` to rank ``dst``, which must call ``recv`` with the same size."""
        return self._p2p(pb.SEND, _flat(array, "send"), dst, tag)

    def recv(self, array: np.ndarray, src: int, tag: int = 0) -> Handle:
        """Receives into ``array`` from rank ``src``."""
        return self._p2p(pb.RECV, _flat(array, "recv", writable=True), src, tag)

    def _p2p(self, kind: int, flat: np.ndarray, peer: int, tag: int) -> Handle:
        what = "send" if kind == pb.SEND else "recv"
        self._check_root(peer, what)
        if peer == self.rank:
            raise UnsupportedError(f"{what}: rank {peer} cannot {what} to or from itself")
        with self._lock:
            self._check_open()
            seq = self._p2p_seq.get((peer, kind), 0) + 1
            self._p2p_seq[(peer, kind)] = seq
            s = flat.dtype.itemsize
            template = pb.OpRequest(
                seq=seq,
                kind=kind,
                dtype=WIRE_DTYPES[flat.dtype],
                count=flat.size,
                root=peer,
                tag=tag,
            )
            handle = Handle(self, f"{what} #{seq}")
            per, parts = self._parts(flat.size, s)
            for p, (a, b) in enumerate(_ranges(flat.size, per, parts)):
                layout = _Layout()
                off = layout.add((b - a) * s)
                req = _part(template, p, parts)
                region = (off, (b - a) * s)
                if kind == pb.SEND:
                    self._submit(handle, req, layout, [(flat[a:b], off)], [], {"input": region})
                else:
                    self._submit_recv(handle, req, layout, [(flat[a:b], off)], {"output": region})
            return handle

    def close(self) -> None:
        """Waits for ops still in flight, then leaves the communicator."""
        with self._lock:
            if self._closed:
                return
            self._progress.stop()
            if self._shm_open is not None:
                self._complete_shm(self._shm_open)
            while self._outstanding:
                self._retire_oldest()
            self._closed = True
            self.session.close()


def connect(
    job_id: str,
    job_token: bytes,
    rank: int,
    world_size: int,
    comm_id: str = "0",
    socket_path: str | None = None,
    timeout_s: float = 1800.0,
    arena_bytes: int | None = None,
    global_rank: int | None = None,
    nodes: Sequence[pb.NodeSpec] = (),
) -> Communicator:
    """Registers this process as ``rank`` of a communicator with its node daemon.

    Args:
        job_id: the job's identity, the same on every rank.
        job_token: the job's secret (at least 16 bytes), the same on every rank.
        rank: this process's rank in the communicator.
        world_size: number of ranks.
        comm_id: names the communicator inside the job.
        socket_path: the daemon's socket; default ``SMDDP_SOCKET`` or the standard paths.
        timeout_s: per-op timeout.
        arena_bytes: size of this rank's shared-memory arena (default ``SMDDP_ARENA_BYTES`` or 64 MiB).
        global_rank: the rank in the job's default communicator, for messages.
        nodes: for a communicator spanning nodes, every node's id, daemon peer address and
            ranks, the same list on every rank (see ``node_layout``).

    Returns:
        The Communicator, ready for ops.

    Raises:
        ConnectError: no daemon answered or it refused the rank.
    """
    if arena_bytes is None:
        arena_bytes = int(os.environ.get(ENV_ARENA_BYTES, DEFAULT_ARENA_BYTES))
    path = _daemon_socket(socket_path)
    register = pb.RegisterRequest(
        job_id=job_id,
        job_token=job_token,
        comm_id=comm_id,
        rank=rank,
        world_size=world_size,
        global_rank=rank if global_rank is None else global_rank,
        node_id=os.environ.get("SMDDP_NODE_ID") or socket.gethostname(),
        pid=os.getpid(),
        arena_bytes=arena_bytes,
        timeout_ms=int(timeout_s * 1000),
        nodes=nodes,
    )
    return Communicator(DaemonSession(path, register), timeout_s, single_node=len(nodes) <= 1)


def _daemon_socket(socket_path: str | None) -> str:
    """``socket_path``, else the first of the standard paths that exists."""
    from smddp.client.errors import ConnectError

    paths = [socket_path] if socket_path else socket_candidates()
    path = next((p for p in paths if os.path.exists(p)), None)
    if path is None:
        raise ConnectError(
            f"no smddpd socket found (looked at {', '.join(paths)}); start smddpd or set SMDDP_SOCKET"
        )
    return path


def rendezvous(
    job_id: str,
    job_token: bytes,
    rank: int,
    world_size: int,
    root: str = "",
    root_node_id: str = "",
    socket_path: str | None = None,
    timeout_s: float = 300.0,
) -> list[pb.NodeSpec]:
    """Meets every rank of a job through the node daemons; returns the job's node layout.

    For jobs without a store of their own: every rank calls this with the same ``root``, the
    peer address (``HOST:PORT``, what ``smddpctl topology`` shows) of one daemon of the job,
    and passes the result to ``connect(..., nodes=...)``.

    Args:
        root: the daemon that hosts the meeting; "" for this node's (a one-node job, or the
            ranks on the root's own node).
        root_node_id: that daemon's node id; needed where daemons use TLS (its certificate
            must name it).
        timeout_s: how long to wait for the other ranks.

    Raises:
        ConnectError: no daemon answered, or the rendezvous failed (a wrong token, ranks
            missing at the timeout, ...); the message says which.
    """
    import grpc

    from smddp.client.errors import ConnectError
    from smddp.client.session import grpc_channel
    from smddp.v1 import smddp_pb2_grpc as pb_grpc

    path = _daemon_socket(socket_path)
    request = pb.RendezvousRequest(
        job_id=job_id,
        job_token=job_token,
        rank=rank,
        world_size=world_size,
        root=root,
        root_node_id=root_node_id,
        timeout_ms=int(timeout_s * 1000),
    )
    try:
        return list(
            pb_grpc.NodeStub(grpc_channel(path)).Rendezvous(request, timeout=timeout_s + 30).nodes
        )
    except grpc.RpcError as exc:
        raise ConnectError(
            f"smddpd at {path}: rank {rank}: {exc.details() or exc.code()}"
        ) from None


def daemon_info(socket_path: str) -> pb.InfoReply:
    """The node id and peer address of the daemon at ``socket_path``.

    Raises:
        ConnectError: the daemon does not answer.
    """
    import grpc

    from smddp.client.errors import ConnectError
    from smddp.client.session import grpc_channel
    from smddp.v1 import smddp_pb2_grpc as pb_grpc

    try:
        return pb_grpc.NodeStub(grpc_channel(socket_path)).Info(pb.InfoRequest(), timeout=10)
    except grpc.RpcError as exc:
        raise ConnectError(
            f"smddpd at {socket_path} does not answer: {exc.details() or exc.code()}"
        ) from None
