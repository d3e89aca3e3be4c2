"""The region path's ops: what each collective copies into its slot and reads back out.

An op whose data fits a slot's buffer runs in the communicator's control region
(``shm.ShmPath``): ``fill(shm, parity)`` copies this rank's input into its buffer, the rank
publishes the op's signature and arrives; completing it waits for the others, checks that
every rank called the same op, then runs ``finish(shm, parity)`` (reduce or copy out, in rank
order). This module holds the region (mapped at the first op that needs it), the one op
whose completion is still due, and each collective's fill and finish.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from smddp.client.errors import DaemonLostError, SmddpError
from smddp.client.inflight import InFlight, RegionWait
from smddp.client.shm import ShmPath, native_reduce
from smddp.core.op import OpKind, OpSpec, ReduceOp
from smddp.core.reduce import _BOOL_UFUNCS, _UFUNCS, reduce_into
from smddp.core.region import G_SEQ, H_ALARM, data_bytes_for
from smddp.v1 import smddp_pb2 as pb

# How long the second synchronisation of an op spanning nodes goes on waiting for the node's
# ranks once the communicator failed (``ShmPath.wait``); within the 2 s in which a rank's
# failure reaches every rank.
NODE_GRACE_S = 1.0

Step = Callable[[ShmPath, int], None]
# (fill, finish), each given the region and the op's parity
Steps = tuple[Step | None, Step | None]


def reduce_rank_order(
    out: np.ndarray, ins: list[np.ndarray], reduce_op: int, native: bool = True
) -> None:
    """Reduces ``ins`` in rank order into ``out`` (``out`` aliases none of them): in C for
    the common dtypes and SUM or AVG (one pass, every input read once) unless ``native`` is
    False (``ClientConfig.native``), else as ``numpy_rank_order`` does; both give the same
    bits."""
    if (
        native
        and (reduce_op == ReduceOp.SUM or reduce_op == ReduceOp.AVG)
        and native_reduce(out, ins, reduce_op == ReduceOp.AVG)
    ):
        return
    numpy_rank_order(out, ins, reduce_op)


def numpy_rank_order(out: np.ndarray, ins: list[np.ndarray], reduce_op: int) -> None:
    """``reduce_rank_order`` with numpy's ufuncs, one input after the other."""
    uf = _BOOL_UFUNCS[reduce_op] if out.dtype == np.bool_ else _UFUNCS[reduce_op]
    uf(ins[0], ins[1], out=out)
    for x in ins[2:]:
        uf(out, x, out=out)
    if reduce_op == ReduceOp.AVG:
        np.divide(out, np.asarray(len(ins), dtype=out.dtype), out=out)


class RegionOps:
    """One rank's ops in its communicator's control region."""

    def __init__(
        self,
        name: str,
        rank: int,
        world: int,
        timeout_s: float,
        open_region: Callable[[], tuple[list[np.ndarray], np.ndarray]],
        daemon_alive: Callable[[], bool],
        daemon_gone: Callable[[], DaemonLostError],
        ranks: Sequence[int] = (),
        *,
        native: bool,
    ) -> None:
        """``open_region()`` maps the peers' arenas and the region (the daemon hands them).
        ``rank`` is this rank's slot; ``ranks``, the communicator's rank of every slot (see
        ``ShmPath``); ``native``, whether the C part may run the protocol and the
        reductions (``ClientConfig.native``)."""
        self.name = name
        self.native = native
        self.rank = rank
        self.ranks = tuple(ranks)
        self.timeout_s = timeout_s
        self._open_region = open_region
        self._alive = daemon_alive
        self._gone = daemon_gone
        self.world = world
        self._shm: ShmPath | None = None
        # The error of a region this rank could not use (its header was overwritten): every
        # later op raises it too, rather than map the region again.
        self._unusable: SmddpError | None = None
        self.peer_maps: list[np.ndarray] = []
        self.open: InFlight | None = None  # its op whose completion is still due
        # The largest op the region carries (a slot's data buffer): the daemon's choice, read
        # once it is mapped; until then the size it makes for this world.
        self.max_bytes = data_bytes_for(world)

    @property
    def shm(self) -> ShmPath:
        """The control region, mapped at the first op that needs it."""
        if self._shm is None:
            if self._unusable is not None:
                raise self._unusable
            self.peer_maps, region = self._open_region()
            try:
                self._shm = ShmPath(
                    self.name,
                    self.rank,
                    region,
                    self.timeout_s,
                    self._alive,
                    self._gone,
                    self.ranks,
                    self.world,
                    native=self.native,
                )
            except SmddpError as exc:
                self._unusable = exc
                raise
            self.max_bytes = self._shm.data_bytes
        return self._shm

    def begin(self) -> ShmPath:
        """Before a new op: the region, with the previous op's data read.

        Its data must be read before this rank arrives at the next op (double buffering lets
        the others run one op ahead, not two).
        """
        shm = self.shm
        if self.open is not None:
            self.complete(self.open)
        return shm

    def start(
        self,
        op: InFlight,
        shm: ShmPath,
        seq: int,
        spec: OpSpec,
        nbytes: int,
        steps: Steps,
    ) -> bool:
        """Copies this rank's input in and arrives at op ``seq`` of ``spec`` (its signature
        published for the others to compare); False (the error in ``op``) when the
        communicator has failed."""
        fill, finish = steps
        try:
            shm.check()
            parity = shm.next_parity()
            if fill is not None:
                fill(shm, parity)
            target = shm.publish(seq, parity, *spec.signature())
        except SmddpError as exc:
            op.error = exc
            return False
        op.pending = 1
        op.region = RegionWait(seq, parity, target, finish, spec.kind, spec.dtype, nbytes)
        return True

    def complete(self, op: InFlight) -> None:
        """Waits for the others at the op's synchronisation, checks that the ranks agree,
        then runs the op's finish (reduce or copy out)."""
        wait = op.region
        shm = self._shm
        if not op.pending or wait is None or shm is None:
            return
        try:
            shm.wait(wait.target, wait.seq)
            shm.agree(wait.seq, wait.parity)
            if wait.finish is not None:
                wait.finish(shm, wait.parity)
            shm.done(wait.seq, wait.parity, wait.kind, wait.dtype, wait.nbytes)
        except SmddpError as exc:
            op.error = exc
        finally:
            op.pending = 0
            if self.open is op:
                self.open = None

    def ready(self, op: InFlight) -> bool:
        """True when completing ``op`` would not wait (every rank arrived, or an alarm)."""
        wait = op.region
        shm = self._shm
        if wait is None or shm is None:
            return True
        q = shm.q
        return all(q[w] >= wait.target for _, w, _ in shm.others) or bool(q[H_ALARM])

    # -- each collective's fill and finish -----------------------------------------------------

    def all_reduce(self, data: np.ndarray, reduce_op: int) -> Steps:
        """Every rank's buffer in, the reduction of all of them out."""
        me, n, dtype, native = self.rank, data.size, data.dtype, self.native

        def fill(shm: ShmPath, p: int) -> None:
            if shm.native is None or not shm.native.fill(p, data):
                np.copyto(shm.sized(p, dtype, n)[me], data)

        def finish(shm: ShmPath, p: int) -> None:
            # The C part reduces the common dtypes and ops (bitwise numpy's), numpy the rest.
            if shm.native is None or not shm.native.reduce(p, data, reduce_op):
                reduce_rank_order(data, shm.sized(p, dtype, n), reduce_op, native)

        return fill, finish

    def broadcast(self, data: np.ndarray, root: int) -> Steps:
        """The root's buffer in, copied out everywhere else."""
        me, n = self.rank, data.size

        def fill(shm: ShmPath, p: int) -> None:
            if me == root:
                np.copyto(shm.typed(p, data.dtype)[me][:n], data)

        def finish(shm: ShmPath, p: int) -> None:
            if me != root:
                np.copyto(data, shm.typed(p, data.dtype)[root][:n])

        return fill, finish

    def reduce(self, data: np.ndarray, root: int, reduce_op: int) -> Steps:
        """Every rank's buffer in, their reduction out on the root."""
        me, n, native = self.rank, data.size, self.native

        def fill(shm: ShmPath, p: int) -> None:
            np.copyto(shm.typed(p, data.dtype)[me][:n], data)

        def finish(shm: ShmPath, p: int) -> None:
            if me == root:
                bufs = shm.typed(p, data.dtype)
                reduce_rank_order(data, [b[:n] for b in bufs], reduce_op, native)

        return fill, finish

    def gather(self, src: np.ndarray, outs: list[np.ndarray] | None) -> Steps:
        """Every rank's buffer in; out into ``outs`` where there are some (all_gather, gather)."""
        me, n = self.rank, src.size

        def fill(shm: ShmPath, p: int) -> None:
            np.copyto(shm.typed(p, src.dtype)[me][:n], src)

        def finish(shm: ShmPath, p: int) -> None:
            if outs is not None:
                bufs = shm.typed(p, src.dtype)
                for j, o in enumerate(outs):
                    np.copyto(o, src if j == me else bufs[j][:n])

        return fill, finish

    def scatter(
        self,
        kind: int,
        out: np.ndarray,
        ins: list[np.ndarray] | None,
        root: int,
        reduce_op: int,
    ) -> Steps:
        """Each rank's inputs in, one after the other; out: the root's block for this rank
        (scatter), or the reduction of every rank's block for it (reduce_scatter)."""
        me, n, native = self.rank, out.size, self.native

        def fill(shm: ShmPath, p: int) -> None:
            if ins is not None:
                mine = shm.typed(p, out.dtype)[me]
                for j, x in enumerate(ins):
                    np.copyto(mine[j * n : (j + 1) * n], x)

        def finish(shm: ShmPath, p: int) -> None:
            bufs = shm.typed(p, out.dtype)
            if kind == OpKind.SCATTER:
                np.copyto(out, bufs[root][me * n : (me + 1) * n])
            else:
                reduce_rank_order(out, [b[me * n : (me + 1) * n] for b in bufs], reduce_op, native)

        return fill, finish

    def across_nodes(
        self,
        spec: OpSpec,
        data: np.ndarray | None,
        root_slot: int | None,
        leg: Callable[[int], None],
    ) -> Steps:
        """An all_reduce, broadcast or barrier of a communicator spanning nodes: two
        synchronisations in the region around the node's exchange with the others, which
        its lowest rank (slot 0) runs through the daemon, ``leg(seq)``.

        In: slot 0 gets the node's share in its ``data``: the node's ranks' data reduced in
        slot order (all_reduce: as the daemon reduces a node's ranks, ``divisor=1``, so the
        bits are the same), or the root's when the root is on this node (broadcast). Out:
        the others copy slot 0's result. A barrier moves nothing.

        An error of the leg that the daemon did not write into the region (its connection
        broke) slot 0 records there, so that every rank of the node raises it.
        """
        me = self.rank
        kind, reduce_op = spec.kind, spec.reduce_op
        moves = data is not None and kind != OpKind.BARRIER
        buf = data if data is not None else np.empty(0, np.uint8)
        n, dtype = buf.size, buf.dtype

        def give(shm: ShmPath, p: int) -> None:
            np.copyto(shm.sized(p, dtype, n)[me], buf)

        def combine(shm: ShmPath, p: int) -> None:
            bufs = shm.sized(p, dtype, n)
            if kind == OpKind.ALL_REDUCE:
                reduce_into([buf], [buf] + bufs[1:], reduce_op, divisor=1, threads=1)
            elif root_slot is not None and root_slot != 0:  # the root is here, not slot 0
                np.copyto(buf, bufs[root_slot])

        gives_in = moves and me != 0 and (kind == OpKind.ALL_REDUCE or me == root_slot)
        gets_out = moves and me not in (0, root_slot)

        def finish(shm: ShmPath, p: int) -> None:
            sig = shm.view.signature_at(me, p)
            seq = sig[G_SEQ]
            if me == 0:
                if moves:
                    combine(shm, p)
                try:
                    leg(seq)
                except SmddpError as exc:
                    shm.view.set_slot_error(me, getattr(exc, "kind", pb.INVALID), str(exc))
                    raise
            q = shm.next_parity()
            if moves and me == 0:
                give(shm, q)
            target = shm.publish(seq, q, *spec.signature())
            # The exchange succeeded: a failure now (a rank elsewhere that finished and
            # left) fails the next op, not this one, once the node's ranks are here.
            shm.wait(target, seq, NODE_GRACE_S, spin=me == 0)
            shm.agree(seq, q)
            if gets_out:
                np.copyto(buf, shm.sized(q, dtype, n)[0])

        return (give if gives_in else None), finish
