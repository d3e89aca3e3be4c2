"""A rank's numpy collectives in one communicator: each one checks, picks its path, starts.

Every collective reads the same: check the arguments (``checks``), then take one of three
paths and return a Handle at once:

- the **region** (``region_ops``): on one node, an op whose data fits a slot's buffer runs
  between the ranks in the communicator's control region, no message to the daemon;
- **direct** (``direct``): on one node, a large all_reduce moves between the ranks' arenas,
  pipelined; a large all_gather, broadcast, reduce_scatter, gather or scatter, and every
  all_to_all, read (a broadcast's root also writes) the other ranks' memory in place where
  they all can, else a broadcast or all_gather takes the arenas too; on the communicator's
  progress thread (or in the caller's thread when it waits at once and nothing else is
  queued);
- the **daemon** (``engine``): everything else (all_to_all, point-to-point, ops across
  nodes, GPU ops, every op with ``SMDDP_REGION=0``), cut into chunks through the arena.

All three share one numbering of the communicator's ops (``_seq``), so the daemon and the
region see the same op #k on every rank. ``connect`` registers a rank and builds its
Communicator from a ``ClientConfig``.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from smddp.client.arena import ALIGN, RingAllocator
from smddp.client.checks import (
    check_peer,
    check_reduce,
    check_root,
    code_of,
    flat,
    per_rank,
)
from smddp.client.config import DEFAULT_ARENA_BYTES, ClientConfig
from smddp.client.direct import (
    DirectOps,
    Work,
    all_reduce_work,
    broadcast_work,
)
from smddp.client.discovery import daemon_info, daemon_socket, rendezvous
from smddp.client.engine import DaemonEngine
from smddp.client.errors import SmddpError, UnsupportedError, progress_bug
from smddp.client.failure import Failure, ask_failure, revoke
from smddp.client.inflight import InFlight
from smddp.client.progress import ProgressThread
from smddp.client.region_ops import RegionOps, Steps
from smddp.client.session import DaemonSession
from smddp.client.shm import ShmPath
from smddp.core.op import BARRIER, OpKind, OpSpec, ReduceOp
from smddp.core.wire import P2P_KINDS, op_request
from smddp.v1 import smddp_pb2 as pb

if TYPE_CHECKING:
    from smddp.client.cuda_ops import CudaCollectives


__all__ = [
    "DEFAULT_ARENA_BYTES",
    "Communicator",
    "Handle",
    "connect",
    "daemon_info",
    "rendezvous",
]


class Handle(InFlight):
    """An op in flight; ``wait`` blocks until its outputs are written."""

    __slots__ = ("comm",)

    def __init__(self, comm: Communicator, what: str = "op", seq: int = 0) -> None:
        super().__init__(what, seq)
        self.comm = comm

    def wait(self) -> None:
        """Waits for the op, then raises the daemon's error if it failed."""
        self.comm._retire_through(self)
        if self.error is not None:
            raise self.error

    def poll(self) -> bool:
        """Retires what has completed without blocking; True once the op is done."""
        return self.comm._poll(self)


class Communicator:
    """The numpy collectives of one rank in one communicator."""

    # How many shrink_group calls led to this communicator (``connect``'s ``generation``).
    generation: int = 0
    # Its failure as the daemons agreed on it, once asked (``failure``).
    _failure: Failure | None = None

    def __init__(
        self,
        session: DaemonSession,
        timeout_s: float,
        single_node: bool = True,
        *,
        config: ClientConfig,
    ) -> None:
        """``config``: the rank's configuration, which ``connect`` built or was given."""
        self.session = session
        self.config = config
        self.rank = session.rank
        self.world_size = session.world_size
        self.timeout_s = timeout_s
        self.chunk_bytes = session.chunk_bytes
        self.single_node = single_node
        self._cuda: CudaCollectives | None = None
        # The arena's first half is a ring for chunks the daemon moves; the second half holds
        # the buffers of direct ops, at the same offsets in every rank's arena.
        half = session.arena.nbytes // 2
        self._engine = DaemonEngine(session, half, timeout_s)
        shared = single_node and session.world_size > 1
        chunk = config.direct_chunk(ALIGN, session.world_size)
        self._direct = DirectOps(
            self.rank, half, half, chunk, ALIGN, config.single_copy, native=config.native
        )
        self._direct_min = config.direct_min_bytes if shared else -1
        # The region and direct paths: every collective they can carry, between the ranks.
        self._use_shm = shared and config.region
        # Spanning nodes, the region holds the ranks on this node (one slot each, in rank
        # order), and carries the local phases of the small ops of COMBINED_KINDS.
        local = session.local_ranks
        self._node_phases = (
            not single_node and config.region and len(local) > 1 and session.node_region
        )
        self._region = RegionOps(
            f"job {session.job_id} comm {session.comm_id}",
            local.index(self.rank),
            len(local),
            timeout_s,
            self._open_region,
            # Looked up when the region opens: a session without one need not have them.
            lambda: self.session.alive(),
            lambda: self.session.gone(),
            local,
            native=config.native,
        )
        self._seq = 0
        self._lock = threading.RLock()
        self._closed = False
        # Ops queued on the progress thread, which a blocking wait may run in its own thread.
        self._claims: weakref.WeakKeyDictionary[InFlight, Callable[[], bool]] = (
            weakref.WeakKeyDictionary()
        )
        self._progress = ProgressThread(f"smddp-progress-{session.comm_id}")

    # -- waiting ------------------------------------------------------------------------------

    @property
    def _ring(self) -> RingAllocator:
        """The daemon path's ring allocator (tests check that it empties)."""
        return self._engine.ring

    def _retire_through(self, handle: InFlight) -> None:
        if handle.event is not None:
            claim = self._claims.pop(handle, None)
            if claim is None or not claim():
                handle.event.wait()  # the progress thread runs it; nothing to do here
            return
        with self._lock:
            if handle.region is not None:
                self._region.complete(handle)
            else:
                self._engine.retire_through(handle)

    def _poll(self, handle: InFlight) -> bool:
        if handle.event is not None:
            return handle.event.is_set()
        if handle.pending and self._lock.acquire(blocking=False):
            try:
                if handle.region is None:
                    self._engine.retire_ready(handle)
                elif self._region.ready(handle):
                    self._region.complete(handle)
            finally:
                self._lock.release()
        return handle.done()

    # -- the paths ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SmddpError(
                f"job {self.session.job_id} comm {self.session.comm_id}: "
                f"rank {self.rank}: "
                "the communicator has been destroyed (destroy_process_group); "
                "create a new group"
            )

    def _next(self, what: str = "op") -> Handle:
        """The next op's number and its handle."""
        self._seq += 1
        return Handle(self, what, self._seq)

    def _open_region(self) -> tuple[list[np.ndarray], np.ndarray]:
        self._engine.drain()  # the arenas' reply must be the next message
        return self.session.peer_arenas()

    def _begin_region(self) -> tuple[ShmPath, Handle, int] | Handle:
        """The region, the new op's handle and number; or, when mapping the region failed,
        a handle that carries the error."""
        self._check_open()
        try:
            shm = self._region.begin()
        except SmddpError as exc:
            failed = Handle(self)
            failed.error = exc
            return failed
        return shm, self._next(), self._seq

    def _fits(self, nbytes: int) -> bool:
        return self._use_shm and nbytes <= self._region.max_bytes

    def _goes_direct(self, nbytes: int) -> bool:
        return self._use_shm or 0 <= self._direct_min <= nbytes

    def _in_region(self, spec: OpSpec, nbytes: int, steps: Steps) -> Handle:
        """Starts an op whose data fits a region buffer (``region_ops``); ``Handle.wait``
        completes it. Behind a large op on the progress thread it runs there, in order."""
        with self._lock:
            begun = self._begin_region()
            if isinstance(begun, Handle):
                return begun  # the communicator has failed
            shm, handle, seq = begun
            args = (handle, shm, seq, spec, nbytes, steps)
            if self._progress.busy():
                event = handle.event = threading.Event()
                handle.pending = 1

                def run() -> None:
                    try:
                        if self._region.start(*args):
                            self._region.complete(handle)
                    except Exception as exc:  # a bug must fail the op, not the ops behind it
                        handle.error = progress_bug(self.rank, seq, exc)
                    handle.pending = 0

                self._claims[handle] = self._progress.submit_claimable(run, event)
            elif self._region.start(*args):
                self._region.open = handle
            return handle

    def _spans(self, nbytes: int) -> bool:
        return self._node_phases and nbytes <= self._region.max_bytes

    def _across_nodes(self, spec: OpSpec, data: np.ndarray | None) -> Handle:
        """An all_reduce, broadcast or barrier of a communicator spanning nodes whose data
        fits a region buffer, as a region op (``RegionOps.across_nodes``): the node's ranks
        combine their data in the region, the lowest alone takes the op to the daemon
        (``node_combined``), which exchanges it with the other nodes, and the others copy
        its result in the region.

        Every rank of the node waits in the region while its lowest rank is at the daemon;
        an error there fails the communicator and the daemon writes it into the region, so
        every rank raises the same one. An op through the daemon that follows first
        completes this one, so the daemon gets the ops in order.
        """
        local = self.session.local_ranks
        kind, root = spec.kind, spec.root
        root_slot = local.index(root) if kind == OpKind.BROADCAST and root in local else None
        nbytes = data.nbytes if data is not None else 0

        def leg(seq: int) -> None:
            part = Handle(self, "op", seq)
            req = op_request(spec, seq)
            req.node_combined = True
            if data is None:
                self._engine.barrier(part, req)
            else:
                here = kind == OpKind.ALL_REDUCE or root_slot is not None
                elsewhere = kind == OpKind.ALL_REDUCE or root_slot is None
                self._engine.elementwise(part, req, data, send=here, receive=elsewhere)
            self._engine.retire_through(part)
            if part.error is not None:
                raise part.error

        steps = self._region.across_nodes(spec, data, root_slot, leg)
        return self._in_region(spec, nbytes, steps)

    def _complete_open(self) -> None:
        """Completes the region op still due before an op through the daemon: on a
        communicator spanning nodes it may owe the daemon its leg, which must go first (the
        daemon takes collectives in order), and which the node's other ranks may be waiting
        for before they send what this op would receive (point-to-point)."""
        if self._node_phases and self._region.open is not None:
            self._region.complete(self._region.open)

    def _run_direct(self, spec: OpSpec, data: np.ndarray, work: Work) -> Handle:
        """Starts a large op on the direct path (``direct``), on the progress thread; a
        blocking wait may claim it first and run it in its own thread."""
        return self._submit_direct(
            lambda handle, shm, seq: self._direct.runner(
                handle,
                shm,
                self._region.peer_maps,
                seq,
                spec,
                data.dtype,
                data.size,
                work,
            )
        )

    def _reads_in_place(self) -> bool:
        """Whether the ranks read each other's memory in place (``peer_memory``).

        The first all_gather decides it among them (``DirectOps.gather_runner``); an op
        that asks after one has started waits for it. If none has, the ranks decide now:
        a barrier (every rank has mapped the region and published its probe word), then
        the minimum of their verdicts. Every rank submits its ops in the same order, so
        every rank takes the same way here.
        """
        direct = self._direct
        if direct.in_place is None and direct.decider is not None:
            self._retire_through(direct.decider)
        if direct.in_place is None:
            self.barrier().wait()
            vote = np.array([int(self._region.shm.judge_peers(direct.single_copy))], np.int64)
            self.all_reduce(vote, ReduceOp.MIN).wait()
            direct.in_place = bool(vote[0])
        return direct.in_place

    def _rooted_in_place(
        self, spec: OpSpec, mine: np.ndarray, blocks: list[np.ndarray] | None
    ) -> Handle:
        """A large gather or scatter read in place (``DirectOps.rooted_runner``)."""
        return self._submit_direct(
            lambda handle, shm, seq: self._direct.rooted_runner(
                handle, shm, seq, spec, mine, blocks
            )
        )

    def _gather_direct(self, spec: OpSpec, src: np.ndarray, outs: list[np.ndarray]) -> Handle:
        """A large all_gather on the direct path: the ranks read each other's inputs in
        place where they can (``DirectOps.gather_runner``)."""
        return self._submit_direct(
            lambda handle, shm, seq: self._direct.gather_runner(
                handle, shm, self._region.peer_maps, seq, spec, outs, src
            )
        )

    def _submit_direct(self, build: Callable[[Handle, ShmPath, int], Callable[[], None]]) -> Handle:
        """Numbers a direct op and hands ``build(handle, shm, seq)``, its run, to the
        progress thread."""
        with self._lock:
            begun = self._begin_region()
            if isinstance(begun, Handle):
                return begun  # the communicator has failed
            shm, handle, seq = begun
            event = handle.event = threading.Event()
            handle.pending = 1
            self._claims[handle] = self._progress.submit_claimable(build(handle, shm, seq), event)
            return handle

    def _via_daemon(self, spec: OpSpec, cut: Callable[[Handle, pb.OpRequest], None]) -> Handle:
        """Numbers an op and sends it through the daemon; ``cut`` submits its chunks."""
        with self._lock:
            self._check_open()
            self._complete_open()
            handle = self._next()
            cut(handle, op_request(spec, self._seq))
            return handle

    def submit_gpu(self, req: pb.OpRequest, after: Callable[[bool], None], what: str) -> Handle:
        """Numbers and sends one GPU op (``req.cuda`` set; one part, no arena).

        ``after(ok)`` runs once, when the op's reply is retired (``ok``: it succeeded), in
        order with the other ops. GPU ops are built by ``self.cuda``.
        """
        with self._lock:
            self._check_open()
            self._complete_open()
            if req.kind in P2P_KINDS:
                if req.kind == pb.RECV:
                    self._engine.settle_receives()  # host receives before it get numbers first
                req.seq = self._engine.next_p2p_seq(req.root, req.kind)
            else:
                self._seq += 1
                req.seq = self._seq
            handle = Handle(self, what, req.seq)
            if req.kind == pb.RECV:
                handle.source = req.root
            self._engine.gpu(handle, req, after)
            return handle

    @property
    def cuda(self) -> CudaCollectives:
        """The collectives on GPU memory (CUDA IPC), set up on first use."""
        if self._cuda is None:
            from smddp.client.cuda_ops import CudaCollectives

            self._cuda = CudaCollectives(self)
        return self._cuda

    # The checks under their old names: backend/solo.py (branch lean) calls them.
    # -- collectives --------------------------------------------------------------------------

    def all_reduce(self, array: np.ndarray, reduce_op: ReduceOp | int = ReduceOp.SUM) -> Handle:
        """Reduces ``array`` across ranks in place (rank order, bitwise identical everywhere)."""
        data = flat(array, "all_reduce", writable=True)
        spec = OpSpec(OpKind.ALL_REDUCE, code_of(data.dtype), data.size, 0, reduce_op)
        check_reduce(spec.dtype, reduce_op)
        if self._fits(data.nbytes):
            return self._in_region(spec, data.nbytes, self._region.all_reduce(data, reduce_op))
        if self._spans(data.nbytes):
            return self._across_nodes(spec, data)
        if self._goes_direct(data.nbytes):
            work = all_reduce_work(data, reduce_op, self.rank, self.world_size, self.config.native)
            return self._run_direct(spec, data, work)
        return self._via_daemon(
            spec, lambda h, t: self._engine.elementwise(h, t, data, send=True, receive=True)
        )

    def broadcast(self, array: np.ndarray, root: int) -> Handle:
        """Copies the root's ``array`` into every rank's ``array``."""
        data = flat(array, "broadcast", writable=True)
        check_root(root, self.world_size, "broadcast")
        spec = OpSpec(OpKind.BROADCAST, code_of(data.dtype), data.size, root)
        if self._fits(data.nbytes):
            return self._in_region(spec, data.nbytes, self._region.broadcast(data, root))
        if self._spans(data.nbytes):
            return self._across_nodes(spec, data)
        if self._use_shm and self._reads_in_place():
            return self._submit_direct(
                lambda handle, shm, seq: self._direct.broadcast_runner(handle, shm, seq, spec, data)
            )
        if self._goes_direct(data.nbytes):
            return self._run_direct(spec, data, broadcast_work(data, root, self.rank))
        is_root = self.rank == root
        return self._via_daemon(
            spec,
            lambda h, t: self._engine.elementwise(h, t, data, send=is_root, receive=not is_root),
        )

    def reduce(
        self, array: np.ndarray, root: int, reduce_op: ReduceOp | int = ReduceOp.SUM
    ) -> Handle:
        """Reduces ``array`` across ranks into the root's ``array``."""
        data = flat(array, "reduce", writable=True)
        check_root(root, self.world_size, "reduce")
        spec = OpSpec(OpKind.REDUCE, code_of(data.dtype), data.size, root, reduce_op)
        check_reduce(spec.dtype, reduce_op)
        if self._fits(data.nbytes):
            steps = self._region.reduce(data, root, reduce_op)
            return self._in_region(spec, data.nbytes, steps)
        is_root = self.rank == root
        return self._via_daemon(
            spec, lambda h, t: self._engine.elementwise(h, t, data, send=True, receive=is_root)
        )

    def all_gather(self, outputs: Sequence[np.ndarray], array: np.ndarray) -> Handle:
        """Gathers every rank's ``array`` into ``outputs[r]`` on every rank."""
        return self._gather(OpKind.ALL_GATHER, outputs, array, 0, "all_gather")

    def gather(self, outputs: Sequence[np.ndarray] | None, array: np.ndarray, root: int) -> Handle:
        """Gathers every rank's ``array`` into ``outputs[r]`` on the root (None elsewhere)."""
        check_root(root, self.world_size, "gather")
        return self._gather(
            OpKind.GATHER, outputs if self.rank == root else None, array, root, "gather"
        )

    def _gather(
        self,
        kind: OpKind,
        outputs: Sequence[np.ndarray] | None,
        array: np.ndarray,
        root: int,
        what: str,
    ) -> Handle:
        src = flat(array, what)
        outs = per_rank(outputs, self.world_size, src.size, src.dtype, what, writable=True)
        spec = OpSpec(kind, code_of(src.dtype), src.size, root)
        if self._fits(src.nbytes):
            return self._in_region(spec, src.nbytes, self._region.gather(src, outs))
        if kind == OpKind.ALL_GATHER and outs is not None and self._goes_direct(src.nbytes):
            return self._gather_direct(spec, src, outs)
        if kind == OpKind.GATHER and self._use_shm and self._reads_in_place():
            return self._rooted_in_place(spec, src, outs)
        return self._via_daemon(spec, lambda h, t: self._engine.gathered(h, t, src, outs))

    def reduce_scatter(
        self,
        output: np.ndarray,
        inputs: Sequence[np.ndarray],
        reduce_op: ReduceOp | int = ReduceOp.SUM,
    ) -> Handle:
        """Rank r's ``output`` becomes the reduction over ranks of their ``inputs[r]``."""
        out = flat(output, "reduce_scatter", writable=True)
        check_reduce(code_of(out.dtype), reduce_op)
        spec = OpSpec(OpKind.REDUCE_SCATTER, code_of(out.dtype), out.size, 0, reduce_op)
        return self._scatter(spec, out, inputs, "reduce_scatter")

    def scatter(self, output: np.ndarray, inputs: Sequence[np.ndarray] | None, root: int) -> Handle:
        """Rank r's ``output`` becomes the root's ``inputs[r]`` (``inputs`` None off the root)."""
        out = flat(output, "scatter", writable=True)
        check_root(root, self.world_size, "scatter")
        spec = OpSpec(OpKind.SCATTER, code_of(out.dtype), out.size, root)
        return self._scatter(spec, out, inputs if self.rank == root else None, "scatter")

    def _scatter(
        self,
        spec: OpSpec,
        out: np.ndarray,
        inputs: Sequence[np.ndarray] | None,
        what: str,
    ) -> Handle:
        ins = per_rank(inputs, self.world_size, out.size, out.dtype, what, writable=False)
        w = self.world_size
        kind = spec.kind
        if self._fits(out.nbytes * w):
            steps = self._region.scatter(kind, out, ins, spec.root, spec.reduce_op)
            return self._in_region(spec, out.nbytes * w if ins is not None else 0, steps)
        if kind == OpKind.SCATTER and self._use_shm and self._reads_in_place():
            return self._rooted_in_place(spec, out, ins)
        if (
            kind == OpKind.REDUCE_SCATTER
            and ins is not None
            and self._use_shm
            and self._reads_in_place()
        ):
            return self._submit_direct(
                lambda handle, shm, seq: self._direct.reduce_scatter_runner(
                    handle, shm, seq, spec, out, ins
                )
            )
        return self._via_daemon(spec, lambda h, t: self._engine.scattered(h, t, out, ins))

    def all_to_all(self, outputs: Sequence[np.ndarray], inputs: Sequence[np.ndarray]) -> Handle:
        """Sends ``inputs[d]`` to rank d, receiving rank s's block into ``outputs[s]``.

        Block sizes may differ (uneven splits); rank s's ``inputs[d]`` must match rank d's
        ``outputs[s]`` in size, which the daemon checks.
        """
        w = self.world_size
        if len(inputs) != w or len(outputs) != w:
            raise UnsupportedError(f"all_to_all: expected {w} input and {w} output tensors")
        ins = [flat(x, "all_to_all") for x in inputs]
        outs = [flat(x, "all_to_all", writable=True) for x in outputs]
        dtype = ins[0].dtype
        if any(x.dtype != dtype for x in ins + outs):
            raise UnsupportedError("all_to_all: every input and output must have the same dtype")
        total = sum(x.size for x in ins)
        # Its count is what this rank sends; the ranks' totals may differ, and the
        # signature they agree on leaves it out.
        spec = OpSpec(OpKind.ALL_TO_ALL, code_of(dtype), total)
        if self._use_shm and self._reads_in_place():
            return self._submit_direct(
                lambda handle, shm, seq: self._direct.all_to_all_runner(
                    handle, shm, seq, spec, ins, outs
                )
            )
        need = np.array([(total + sum(x.size for x in outs)) * dtype.itemsize], dtype=np.int64)
        with self._lock:
            # Every rank must cut the blocks into the same number of chunks: agree on the
            # largest footprint first (an op of its own in the sequence).
            self.all_reduce(need, ReduceOp.MAX).wait()
            return self._via_daemon(
                spec, lambda h, t: self._engine.all_to_all(h, t, ins, outs, int(need[0]))
            )

    def barrier(self) -> Handle:
        """Completes once every rank has called it."""
        if self._use_shm:
            return self._in_region(BARRIER, 0, (None, None))
        if self._node_phases:
            return self._across_nodes(BARRIER, None)
        return self._via_daemon(BARRIER, self._engine.barrier)

    def send(self, array: np.ndarray, dst: int, tag: int = 0) -> Handle:
        """Sends ``array`` to rank ``dst``, which must call ``recv`` with the same size."""
        return self._p2p(OpKind.SEND, flat(array, "send"), dst, tag)

    def recv(self, array: np.ndarray, src: int, tag: int = 0) -> Handle:
        """Receives into ``array`` from rank ``src``."""
        return self._p2p(OpKind.RECV, flat(array, "recv", writable=True), src, tag)

    def recv_any(self, array: np.ndarray, tag: int = 0) -> Handle:
        """Receives into ``array`` the first message sent to this rank with ``tag``, from any
        rank (torch's ``recv`` with ``src=None``); ``Handle.source`` names the sender once
        ``wait`` returns.

        Messages from each rank are received in the order it sent them, and a send with
        another tag is left for a receive with that tag. The receives this rank posts after
        this one go to the daemon once it knows the sender.
        """
        data = flat(array, "recv", writable=True)
        if self.world_size < 2:
            raise UnsupportedError(
                f"recv: rank {self.rank} is the only rank of the group, so no rank can send to it"
            )
        return self._p2p(OpKind.RECV, data, -1, tag)

    def _p2p(self, kind: OpKind, data: np.ndarray, peer: int, tag: int) -> Handle:
        """A send or receive (``peer`` -1: a receive from any source), numbered by the engine."""
        what = "send" if kind == OpKind.SEND else "recv"
        if peer != -1:
            check_peer(peer, self.rank, self.world_size, what)
        spec = OpSpec(kind, code_of(data.dtype), data.size, max(peer, 0), tag=tag)
        with self._lock:
            self._check_open()
            self._complete_open()
            handle = Handle(self, what)
            self._engine.point_to_point(handle, op_request(spec), data, any_source=peer == -1)
            return handle

    # -- failure ----------------------------------------------------------------------------

    def failure(self) -> Failure | None:
        """Why the communicator failed, as its daemons agreed: the failed ranks (the same on
        every surviving rank) and the generation; None while it has not failed. Asked of the
        daemon once it has failed, then kept.

        Raises:
            DaemonLostError: the daemon did not answer.
        """
        if self._failure is None and not self._closed:
            self._failure = ask_failure(self.session)
        return self._failure

    def revoke(self, reason: str) -> None:
        """Fails every pending and later op of the communicator on every rank, with
        ``reason`` (shrink_group's SHRINK_ABORT); the rank stays registered until ``close``.

        Raises:
            DaemonLostError: the daemon did not answer.
        """
        if not self._closed:
            revoke(self.session, reason)

    def close(self) -> None:
        """Waits for ops still in flight, then leaves the communicator."""
        with self._lock:
            if self._closed:
                return
            self._progress.stop()
            if self._region.open is not None:
                self._region.complete(self._region.open)
            self._engine.drain()
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
    config: ClientConfig | None = None,
    *,
    parent_comm_id: str = "",
    excluded_ranks: Sequence[int] = (),
    generation: int = 0,
    joined_ranks: Sequence[int] = (),
) -> Communicator:
    """Registers this process as ``rank`` of a communicator with its node daemon.

    Args:
        job_id: the job's identity, the same on every rank.
        job_token: the job's secret (at least 16 bytes), the same on every rank.
        rank: this process's rank in the communicator.
        world_size: number of ranks.
        comm_id: names the communicator inside the job.
        socket_path: the daemon's socket; default ``config.socket`` or the standard paths.
        timeout_s: per-op timeout.
        arena_bytes: size of this rank's shared-memory arena (default ``config.arena_bytes``).
        global_rank: the rank in the job's default communicator, for messages.
        nodes: for a communicator spanning nodes, every node's id, daemon peer address and
            ranks, the same list on every rank (see ``node_layout``).
        config: the client's configuration (default: ``ClientConfig.from_env()``).
        parent_comm_id, excluded_ranks, generation: for shrink_group, the communicator this
            one replaces, its ranks left out (its numbering) and the new generation; every
            rank must pass the same three.
        joined_ranks: for smddp.grow (with ``parent_comm_id`` and ``generation``, no
            ``excluded_ranks``), the ranks of the new communicator that were not in the parent.

    Returns:
        The Communicator, ready for ops.

    Raises:
        ConnectError: no daemon answered or it refused the rank.
    """
    config = config or ClientConfig.from_env()
    if arena_bytes is not None:
        config = replace(config, arena_bytes=arena_bytes)
    path = daemon_socket(socket_path, config)
    register = pb.RegisterRequest(
        job_id=job_id,
        job_token=job_token,
        comm_id=comm_id,
        rank=rank,
        world_size=world_size,
        global_rank=rank if global_rank is None else global_rank,
        node_id=config.node_id,
        pid=os.getpid(),
        arena_bytes=config.arena_bytes,
        timeout_ms=int(timeout_s * 1000),
        nodes=nodes,
        parent_comm_id=parent_comm_id,
        excluded_ranks=sorted(excluded_ranks),
        generation=generation,
        joined_ranks=sorted(joined_ranks),
    )
    session = DaemonSession(path, register, config.op_channel)
    comm = Communicator(session, timeout_s, single_node=len(nodes) <= 1, config=config)
    if generation:
        comm.generation = generation
    return comm
