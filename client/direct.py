"""The direct path: large ops on one node, the ranks moving data between their arenas.

Each rank maps the others' arenas; an op's ``n`` elements per rank are cut into chunks that
fit a buffer (``ClientConfig.direct_chunk_bytes``), which run through DIRECT_BUFFERS buffers
at the same offsets in every rank's arena, one after the other, a chunk's last step beside
the next one's first, with a synchronisation in the control region between steps. Each
collective is a ``Work``: a generator per chunk whose yields are its synchronisation points.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterator

import numpy as np

from smddp.client.errors import SmddpError, progress_bug
from smddp.client.inflight import InFlight
from smddp.client.peer_memory import read, write
from smddp.client.region_ops import reduce_rank_order
from smddp.client.shm import ShmPath
from smddp.core.op import OpKind, OpSpec
from smddp.v1 import smddp_pb2 as pb

# A chunk's buffer is reused DIRECT_BUFFERS chunks later. A chunk's last step (reading the
# others' buffers) runs beside the next chunk's first (writing this rank's), in the same
# step or, across two ops, with no synchronisation between them: two buffers keep those
# apart, and every later write to a buffer comes at least one synchronisation after the
# last read of it.
DIRECT_BUFFERS = 2

# work(a, b, bufs): the steps of the chunk of elements [a, b), given every rank's buffer.
Work = Callable[[int, int, list[np.ndarray]], Iterator[None]]


def all_reduce_work(data: np.ndarray, reduce_op: int, me: int, w: int, native: bool) -> Work:
    """all_reduce: rank r reduces segment r of each chunk from every rank's buffer, in rank
    order (in C where ``native``, ``ClientConfig.native``), then everyone copies the other
    segments from their owners' buffers."""

    def work(a: int, b: int, bufs: list[np.ndarray]) -> Iterator[None]:
        m = b - a
        lo, hi = m * me // w, m * (me + 1) // w
        # Only the others read our buffer, and only their own segments: ours stays home.
        np.copyto(bufs[me][:lo], data[a : a + lo])
        np.copyto(bufs[me][hi:], data[a + hi : b])
        yield
        mine = data[a + lo : a + hi]
        result = bufs[me][lo:hi]  # for the others; it aliases none of the inputs
        reduce_rank_order(
            result, [mine if j == me else x[lo:hi] for j, x in enumerate(bufs)], reduce_op, native
        )
        np.copyto(mine, result)  # still in this core's cache
        yield
        for j in range(w):
            if j != me:
                lo_j, hi_j = m * j // w, m * (j + 1) // w
                np.copyto(data[a + lo_j : a + hi_j], bufs[j][lo_j:hi_j])

    return work


def broadcast_work(data: np.ndarray, root: int, me: int) -> Work:
    """broadcast: the root fills its buffer, the others copy from it."""

    def work(a: int, b: int, bufs: list[np.ndarray]) -> Iterator[None]:
        if me == root:
            np.copyto(bufs[me], data[a:b])
        yield
        if me != root:
            np.copyto(data[a:b], bufs[root])

    return work


def all_gather_work(outs: list[np.ndarray], src: np.ndarray, me: int) -> Work:
    """all_gather: each rank fills its buffer, then copies every other rank's."""

    def work(a: int, b: int, bufs: list[np.ndarray]) -> Iterator[None]:
        np.copyto(bufs[me], src[a:b])
        np.copyto(outs[me][a:b], bufs[me])  # from the cache, not from src again
        yield
        for j, out in enumerate(outs):
            if j != me:
                np.copyto(out[a:b], bufs[j])

    return work


def _overlaps(out: np.ndarray, ins: list[np.ndarray]) -> bool:
    """True when ``out`` may lie over the memory of some input (their bounds meet)."""
    if not out.nbytes:
        return False
    a, b = out.ctypes.data, out.ctypes.data + out.nbytes
    return any(x.nbytes and x.ctypes.data < b and a < x.ctypes.data + x.nbytes for x in ins)


class DirectOps:
    """A rank's direct buffers: where they lie in every arena, and which one is next."""

    def __init__(
        self,
        rank: int,
        base: int,
        area_bytes: int,
        chunk_bytes: int,
        align: int,
        single_copy: bool = True,
        *,
        native: bool,
    ):
        """``single_copy``: False keeps all_gather in the arenas (``SMDDP_SINGLE_COPY=0``),
        here and, through this rank's verdict, on every rank. ``native``: False keeps the
        reductions in numpy (``ClientConfig.native``)."""
        self.rank = rank
        self.native = native
        self.base = base
        self.buffer = max(align, min(chunk_bytes, area_bytes // DIRECT_BUFFERS) // align * align)
        self._count = 0  # chunks run so far: every rank numbers them alike
        self.single_copy = single_copy
        # Whether the ranks read each other's all_gather inputs in place (peer_memory):
        # decided by all of them together at the first all_gather (every rank takes part,
        # whatever its own setting, so that all run the same steps).
        self.in_place: bool | None = None
        self.decider: InFlight | None = None  # the all_gather that decides it, once started

    def runner(
        self,
        op: InFlight,
        shm: ShmPath,
        maps: list[np.ndarray],
        seq: int,
        spec: OpSpec,
        dtype: np.dtype,
        n: int,
        work: Work,
    ) -> Callable[[], None]:
        """The op, ready to run in some thread (``ProgressThread.submit_claimable``, which
        sets ``op.event`` once it is over).

        ``spec``: the op, whose signature the ranks compare. For each chunk,
        ``work(a, b, bufs)`` gets the chunk's element range and every rank's buffer (mapped
        from the peers' arenas, rank order) and runs in steps: the code up to its first
        yield, then up to the next, and so on. After each step every rank waits until all
        have finished it, in the control region (the first time with the op's signature,
        which the ranks compare), so a chunk's step may read what the other ranks wrote in
        its earlier steps. A chunk's last step runs beside the next chunk's first: one
        synchronisation per step of a chunk but its last. Chunks run one after the other,
        not further interleaved: a chunk's steps then find its part of the user's tensor
        still in this core's cache (measured: 10-20% faster than running a chunk's copy-in,
        the previous chunk's reduction and the one before's copy-out in one step, which
        evicts the tensor's lines between a chunk's read and its write). Buffers are used in
        turn: one is written again only after every rank has passed the last step that
        reads it.
        """
        chunks = self._chunks(spec, dtype, n, work)

        def run() -> None:
            parity = shm.next_parity()
            chunks(shm, seq, parity, maps, False)
            shm.done(seq, parity, spec.kind, spec.dtype, n * dtype.itemsize)

        return self._guarded(op, shm, seq, run)

    def gather_runner(
        self,
        op: InFlight,
        shm: ShmPath,
        maps: list[np.ndarray],
        seq: int,
        spec: OpSpec,
        outs: list[np.ndarray],
        src: np.ndarray,
    ) -> Callable[[], None]:
        """An all_gather, as ``runner`` runs one: each rank reads the others' inputs in place
        (``_gather_in_place``) once they have all found that they can, else through the
        arenas (``all_gather_work``).

        The first all_gather decides for the communicator: after its first synchronisation
        each rank tries to read every other one's probe word (``ShmPath.judge_peers``), and
        after a second, all of them read the same verdicts.
        """
        n = src.size
        if self.in_place is None and self.decider is None:
            self.decider = op
        # Numbered now whichever way it runs, as every rank numbers them alike.
        chunks = self._chunks(spec, src.dtype, n, all_gather_work(outs, src, self.rank))

        def run() -> None:
            parity = shm.next_parity()
            shm.offer_source(src.ctypes.data)
            published = self.in_place is None
            if published:
                target = shm.publish(seq, parity, *spec.signature())
                shm.wait(target, seq)
                shm.agree(seq, parity)
                shm.judge_peers(self.single_copy)
                shm.wait(shm.bump(), seq)
                self.in_place = shm.peers_readable()
            if self.in_place:
                self._gather_in_place(shm, seq, parity, spec, published, outs, src)
            else:
                chunks(shm, seq, parity, maps, published)
            shm.done(seq, parity, spec.kind, spec.dtype, n * src.dtype.itemsize)

        return self._guarded(op, shm, seq, run)

    def all_to_all_runner(
        self,
        op: InFlight,
        shm: ShmPath,
        seq: int,
        spec: OpSpec,
        ins: list[np.ndarray],
        outs: list[np.ndarray],
    ) -> Callable[[], None]:
        """An all_to_all, the ranks reading each other's blocks in place (only once
        ``in_place`` holds): each writes where its blocks for every rank lie, and their
        sizes, into its slot's data buffer; after the op's first synchronisation each reads
        its block from every other rank, checking that the sizes agree; a last one keeps
        every input unchanged until all have read it."""
        w = len(ins)
        me = self.rank
        if any(_overlaps(o, ins) for o in outs):
            # Outputs over the inputs: the others would read what this rank has written.
            ins = [x.copy() for x in ins]
        nbytes = sum(x.nbytes for x in ins)

        def run() -> None:
            parity = shm.next_parity()
            table = shm.sized(parity, np.dtype(np.int64), 2 * w)
            table[me][:w] = [x.ctypes.data for x in ins]
            table[me][w:] = [x.size for x in ins]
            if ins[me].size != outs[me].size:
                raise self._split_mismatch(shm, me, ins[me].size, outs[me].size)
            target = shm.publish(seq, parity, *spec.signature())
            np.copyto(outs[me], ins[me])
            shm.wait(target, seq)
            shm.agree(seq, parity)
            for s, out in enumerate(outs):
                if s == me:
                    continue
                size = int(table[s][w + me])
                if size != out.size:
                    raise self._split_mismatch(shm, s, size, out.size)
                if size:
                    self._read(shm, seq, s, out, int(table[s][me]), "all_to_all block")
            shm.wait(shm.bump(), seq)
            shm.done(seq, parity, spec.kind, spec.dtype, nbytes)

        return self._guarded(op, shm, seq, run)

    def broadcast_runner(
        self, op: InFlight, shm: ShmPath, seq: int, spec: OpSpec, data: np.ndarray
    ) -> Callable[[], None]:
        """A broadcast in place (only once ``in_place`` holds), the copying shared by every
        rank: each offers where its ``data`` lies; after the op's first synchronisation each
        other rank reads the first ``n - n // w`` elements from the root's memory while the
        root writes the rest into each of them (``process_vm_writev``), so each of the ``w``
        ranks copies ``(w - 1) / w`` of the data, where through the arenas the root copies
        all of it in and every other rank all of it out. A last synchronisation keeps the
        root's data unchanged until all have read it, and every rank waiting until the
        root has written."""
        root = spec.root
        me = self.rank
        n = data.size
        split = n - n // shm.world
        offset = split * data.dtype.itemsize

        def run() -> None:
            parity = shm.next_parity()
            shm.offer_source(data.ctypes.data)
            target = shm.publish(seq, parity, *spec.signature())
            shm.wait(target, seq)
            shm.agree(seq, parity)
            if me == root:
                tail = data[split:]
                for j in range(shm.world):
                    if j != me and tail.size:
                        there = shm.source_of(j) + offset
                        self._peer_copy(shm, seq, j, tail, there, "broadcast output", True)
            elif split:
                self._read(shm, seq, root, data[:split], shm.source_of(root), "broadcast input")
            shm.wait(shm.bump(), seq)
            shm.done(seq, parity, spec.kind, spec.dtype, data.nbytes)

        return self._guarded(op, shm, seq, run)

    def reduce_scatter_runner(
        self,
        op: InFlight,
        shm: ShmPath,
        seq: int,
        spec: OpSpec,
        out: np.ndarray,
        ins: list[np.ndarray],
    ) -> Callable[[], None]:
        """A reduce_scatter, the ranks reading each other's blocks in place (only once
        ``in_place`` holds): each writes where its inputs for every rank lie into its slot's
        data buffer; after the op's first synchronisation each reads its block from every
        other rank, a chunk at a time into scratch, and reduces the chunk in rank order into
        its output; a last synchronisation keeps every input unchanged until all have read
        it."""
        w = len(ins)
        me = self.rank
        reduce_op = spec.reduce_op
        if _overlaps(out, ins):
            ins = [x.copy() for x in ins]  # the reduction writes none of its inputs
        n = out.size
        s = out.dtype.itemsize
        per = max(1, self.buffer // s)

        def run() -> None:
            parity = shm.next_parity()
            table = shm.sized(parity, np.dtype(np.int64), w)
            table[me][:] = [x.ctypes.data for x in ins]
            target = shm.publish(seq, parity, *spec.signature())
            scratch = [np.empty(min(per, n), out.dtype) for _ in range(w - 1)]
            shm.wait(target, seq)
            shm.agree(seq, parity)
            for a in range(0, n, per):
                b = min(n, a + per)
                parts = []
                for j in range(w):
                    if j == me:
                        parts.append(ins[me][a:b])
                        continue
                    part = scratch[j - (j > me)][: b - a]
                    address = int(table[j][me]) + a * s
                    self._read(shm, seq, j, part, address, "reduce_scatter block")
                    parts.append(part)
                reduce_rank_order(out[a:b], parts, reduce_op, self.native)
            shm.wait(shm.bump(), seq)
            shm.done(seq, parity, spec.kind, spec.dtype, n * w * s)

        return self._guarded(op, shm, seq, run)

    def rooted_runner(
        self,
        op: InFlight,
        shm: ShmPath,
        seq: int,
        spec: OpSpec,
        mine: np.ndarray,
        blocks: list[np.ndarray] | None,
    ) -> Callable[[], None]:
        """A gather or scatter between the root and every rank, reading in place (only once
        ``in_place`` holds). gather: ``mine`` is this rank's input, ``blocks`` the root's
        outputs, which the root reads from each rank. scatter: ``mine`` is this rank's
        output, ``blocks`` the root's inputs, where each rank reads its own. A last
        synchronisation keeps every input unchanged until it has been read."""
        kind, root = spec.kind, spec.root
        me = self.rank
        scatter = kind == OpKind.SCATTER
        if scatter and blocks is not None and _overlaps(mine, blocks):
            blocks = [x.copy() for x in blocks]  # the others would read what the root wrote
        w = shm.world
        nbytes = mine.nbytes * w if blocks is not None else 0

        def run() -> None:
            parity = shm.next_parity()
            table = shm.sized(parity, np.dtype(np.int64), w)
            if blocks is not None and scatter:
                table[me][:] = [x.ctypes.data for x in blocks]
            shm.offer_source(mine.ctypes.data)
            target = shm.publish(seq, parity, *spec.signature())
            if blocks is not None and scatter:  # the root's own block
                np.copyto(mine, blocks[me])
            elif blocks is not None:
                np.copyto(blocks[me], mine)
            shm.wait(target, seq)
            shm.agree(seq, parity)
            if scatter and me != root:
                self._read(shm, seq, root, mine, int(table[root][me]), "scatter input")
            elif not scatter and blocks is not None:
                for j, out in enumerate(blocks):
                    if j != me:
                        self._read(shm, seq, j, out, shm.source_of(j), "gather input")
            shm.wait(shm.bump(), seq)
            shm.done(seq, parity, kind, spec.dtype, nbytes)

        return self._guarded(op, shm, seq, run)

    def _split_mismatch(self, shm: ShmPath, s: int, sends: int, expects: int) -> SmddpError:
        me = self.rank
        return shm.fail(
            pb.INVALID,
            f"{shm.name}: "
            "all_to_all: "
            f"rank {s} sends {sends} elements to rank {me} but rank {me} expects {expects} from rank {s} (input and output split sizes disagree)",  # noqa: E501
        )

    def _read(
        self, shm: ShmPath, seq: int, s: int, out: np.ndarray, address: int, what: str
    ) -> None:
        """Reads rank ``s``'s memory at ``address`` into ``out``."""
        self._peer_copy(shm, seq, s, out, address, what, into_peer=False)

    def _peer_copy(
        self,
        shm: ShmPath,
        seq: int,
        s: int,
        mine: np.ndarray,
        address: int,
        what: str,
        into_peer: bool,
    ) -> None:
        """Copies between ``mine`` and rank ``s``'s memory at ``address``: into it if
        ``into_peer``, else out of it."""
        try:
            pid = shm.pid_of(s)
            if not pid:  # its verdict word said yes, but this rank never reached it
                raise OSError(errno.EPERM, "this rank never reached it")
            (write if into_peer else read)(pid, mine, address)
        except OSError as exc:
            if exc.errno != errno.ESRCH:
                verb = "write" if into_peer else "read"
                raise shm.fail(
                    pb.INVALID,
                    f"{shm.name}: "
                    f"rank {self.rank} could not {verb} rank {s}'s {what} in place in op #{seq} ({exc.strerror}), although every rank could read every other at the communicator's first op in place; "  # noqa: E501
                    "SMDDP_SINGLE_COPY=0 keeps the ops in shared memory",
                ) from None
            # It died: the daemon fails the communicator, the op's next wait raises that.

    def _gather_in_place(
        self,
        shm: ShmPath,
        seq: int,
        parity: int,
        spec: OpSpec,
        published: bool,
        outs: list[np.ndarray],
        src: np.ndarray,
    ) -> None:
        """Copies this rank's input into its own output while the others arrive, then reads
        each other rank's input from its memory into theirs; a last synchronisation keeps
        every input unchanged until all have read it."""
        me = self.rank
        target = 0 if published else shm.publish(seq, parity, *spec.signature())
        np.copyto(outs[me], src)
        if not published:
            shm.wait(target, seq)
            shm.agree(seq, parity)
        for j, out in enumerate(outs):
            if j != me:
                self._read(shm, seq, j, out, shm.source_of(j), "all_gather input")
        shm.wait(shm.bump(), seq)

    def _chunks(
        self, spec: OpSpec, dtype: np.dtype, n: int, work: Work
    ) -> Callable[[ShmPath, int, int, list[np.ndarray], bool], None]:
        """The op's chunks, their buffers numbered now (see ``runner``): ``chunks(shm, seq,
        parity, maps, published)`` runs them, the first synchronisation with the op's
        signature unless ``published`` (the ranks compared it already)."""
        signature = spec.signature()
        s = dtype.itemsize
        size = self.buffer
        per = max(1, size // s)
        total = max(1, -(-n // per))
        # Which buffer each chunk uses, fixed now: every rank numbers them alike.
        first_buffer = self._count
        self._count += total
        area = self.base

        def chunks(
            shm: ShmPath, seq: int, parity: int, maps: list[np.ndarray], published: bool
        ) -> None:
            first = not published
            chunk: Iterator[None] | None = None  # the chunk whose steps run now
            c = 0
            while True:
                if chunk is not None:
                    try:
                        next(chunk)
                    except StopIteration:
                        chunk = None  # its last step ran: the next chunk starts beside it
                if chunk is None:
                    if c == total:
                        break
                    a, b = c * per, min(n, (c + 1) * per)
                    base = area + ((first_buffer + c) % DIRECT_BUFFERS) * size
                    bufs = [pm[base : base + (b - a) * s].view(dtype) for pm in maps]
                    chunk = work(a, b, bufs)
                    c += 1
                    next(chunk)  # its first step (every work yields at least once)
                if first:
                    target = shm.publish(seq, parity, *signature)
                    shm.wait(target, seq)
                    shm.agree(seq, parity)
                    first = False
                else:
                    shm.wait(shm.bump(), seq)

        return chunks

    def _guarded(
        self, op: InFlight, shm: ShmPath, seq: int, body: Callable[[], None]
    ) -> Callable[[], None]:
        """``body`` as the op's run: its error becomes the op's, and the op is over after it."""

        def run() -> None:
            try:
                shm.check()
                body()
            except SmddpError as exc:
                op.error = exc
            except Exception as exc:  # a bug must fail the op, not hang its waiters
                op.error = progress_bug(self.rank, seq, exc)
            finally:
                op.pending = 0

        return run
