"""The daemon's side of a communicator's control region: it creates it and supervises.

The communicator's ranks on this node run their collectives through the region (see
``smddp.core.region``); the daemon takes no part in them, beyond the exchange with other nodes
that a communicator spanning nodes asks of it (``OpRequest.node_combined``). Slot i is the
communicator's ``local_ranks[i]``. It marks the communicator failed there (every waiting rank
wakes and raises the same error), finds ops that waited past the timeout, shows in-flight
ops to ``smddpctl status`` and reads the ranks' counters into its metrics.

Every rank of the communicator maps the region read-write and may write anything into it,
as a buggy or hostile process can: the daemon reads it as untrusted input. The memfd is
sealed against resizing (a shrunk region would make the daemon's next read a SIGBUS); the
geometry is the daemon's own, never the header's; whether the communicator failed is the
daemon's own state, not the header's flag; every length is capped, every error kind mapped
onto the known ones, and sequence numbers, steps, signatures and times, whatever they
are, only ever end the region's own job, with a named error.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass

import numpy as np

from smddp.core.memfd import sealed_memfd
from smddp.core.region import (
    C_BYTES,
    C_DUR_BUCKET,
    C_DUR_SUM,
    C_OPS,
    DTYPES,
    G_ARRIVAL,
    G_SEQ,
    H_ALARM,
    K_BUCKET,
    K_COUNT,
    K_SUM,
    S_DONE,
    S_LAST,
    S_OPS,
    S_SEQ,
    S_STEP,
    RegionView,
    data_bytes_for,
    init_header,
    published_op,
    region_bytes,
)
from smddp.core.wire import KIND_NAMES, describe, dtype_name
from smddp.v1 import smddp_pb2 as pb

# What a communicator's counters can have reached since its region was made: its ranks count
# only what they did, so a value beyond these was written by something else (a process of
# the job writing into its slot). The bounds count from the region's creation, not from the
# last read: an op counted now may have started, and moved its bytes, long before that read.
# Each is far above what any host does, so a real rank never comes near one.
MAX_OPS_PER_S = 100_000_000  # the fastest region op takes ~1 us (4-byte all_reduce): 100x that
# A rank's counted bytes of a second (its inputs): 4 TiB/s is 4x the whole memory bandwidth
# of the largest hosts (HBM-attached CPUs give ~1 TiB/s in all).
MAX_BYTES_PER_S = 4 << 40
# Op durations and arrival skews add up to more than the wall time when ops overlap: a rank
# runs at most one region op ahead of the slowest, so at most two of a communicator's ops are
# in flight at once; the bound allows (this + the world size) times the region's age.
MAX_OPS_IN_FLIGHT = 4
# Added to every bound: an op of the first microseconds, and clock granularity.
COUNT_SLACK = 1024
BYTES_SLACK = 1 << 30
NS_SLACK = 1_000_000_000


class ImpossibleCounters(ValueError):
    """A slot's metric counters went backwards or beyond what the region's age allows."""

    def __init__(self, slot: int, problem: str) -> None:
        """``slot``: the region slot whose counters; ``problem``: ``went backwards (...)`` or
        ``advanced impossibly (...)``, what the message says after "counters ... ".
        """
        super().__init__(problem)
        self.slot = slot
        self.problem = problem


RegionCounts = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _row_name(row: int) -> str:
    kind, dtype = divmod(row, DTYPES)
    return f"{KIND_NAMES.get(kind, f'op#{kind}')}/{dtype_name(dtype)}"


# The error kinds a rank may record in its slot; any other word there (it is the rank's to
# write) becomes INVALID, so that no reply, metric or log built from it can fail.
KNOWN_KINDS = frozenset(pb.ErrorKind.values()) - {pb.ERROR_KIND_UNSPECIFIED}


def known_kind(kind: int) -> int:
    """``kind`` if it is one of the wire's error kinds, else INVALID."""
    return kind if kind in KNOWN_KINDS else pb.INVALID


def printable(text: str) -> str:
    """``text`` with its unprintable characters escaped (``\\n``): a message a rank wrote
    goes into the daemon's log one line long."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@dataclass
class RegionPending:
    """An op some ranks arrived at in the region while others have not."""

    seq: int
    description: str
    arrived: list[int]
    missing: list[int]
    waited_s: float
    # True when every rank is in the op and ``missing`` stopped at a synchronisation inside
    # it (a large op has several); ``waited_s`` then counts from the others' last step.
    inside: bool = False


class ControlRegion:
    """One communicator's region, created and mapped by the daemon."""

    def __init__(self, world_size: int, data_bytes: int | None = None) -> None:
        """``data_bytes``: each data buffer's size (default ``data_bytes_for(world_size)``)."""
        if data_bytes is None:
            data_bytes = data_bytes_for(world_size)
        self.nbytes = region_bytes(world_size, data_bytes)
        self.fd = sealed_memfd("smddp-region", self.nbytes)
        try:
            self._mm = mmap.mmap(
                self.fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        except OSError:
            os.close(self.fd)
            raise
        buf = np.frombuffer(self._mm, dtype=np.uint8)
        init_header(buf, world_size, data_bytes)
        # The geometry it was made with: the header's words are the ranks' to overwrite.
        self.view = RegionView(buf, world_size, data_bytes)
        # The daemon's failure, once it wrote one: the header's flag is the ranks' to write.
        self._failure: tuple[int, str] | None = None
        # The counters as last read into the metrics, to add only what is new.
        self._seen_ops = np.zeros_like(self.view.op_table(0))
        self._seen_bytes = np.zeros((world_size,) + self._seen_ops.shape[:1], dtype=np.int64)
        self._seen_skew = np.zeros_like(self.view.skew_table(0))
        self._seen_last = np.zeros(world_size, dtype=np.int64)
        # Ops each rank completed in the region (S_OPS), which status shows: never added to
        # the metrics, only checked with the rest.
        self._seen_done = np.zeros(world_size, dtype=np.int64)
        # When the region was made (monotonic ns): what the counters can have reached since
        # is bounded by it (``new_counts``). Once they were found impossible they are not
        # read again.
        self._created_ns = time.monotonic_ns()
        self._counts_refused = False
        # The ranks' step words as last seen, and when they last changed (monotonic ns): how
        # long the ranks inside an op have waited at a synchronisation for one that stopped.
        self._steps: tuple[int, ...] = ()
        self._steps_since = 0
        # The op the furthest ranks waited at when the daemon first saw others missing, and
        # when (monotonic ns): an op is timed from there at the latest, whatever arrival
        # times the ranks wrote (one in the future must not stop it being timed out).
        self._seen_seq = 0
        self._seen_since = 0

    def fail(self, kind: int, message: str) -> None:
        """Marks the communicator failed and wakes every rank (once: later calls keep the
        first failure), whatever a rank wrote into the header's failure words."""
        if self._failure is not None:
            return
        self._failure = (kind, message)
        self.view.write_failure(kind, message)

    def failed(self) -> bool:
        """True once the daemon failed the communicator here (``fail``)."""
        return self._failure is not None

    def rank_error(self) -> tuple[int, str] | None:
        """An error a rank found and recorded (a mismatch), or None: its kind one of the
        wire's (``known_kind``), its message at most ``ERR_MSG_MAX`` bytes, printable."""
        found = self.view.first_slot_error() if self.view.header[H_ALARM] else None
        if found is None:
            return None
        kind, message = found
        message = printable(message) or "a rank recorded an error without a message"
        return known_kind(kind), message

    def ops_completed(self, rank: int) -> int:
        """Ops rank ``rank`` completed through the region (its counter; never below 0)."""
        return max(0, int(self.view.slots[rank, S_OPS]))

    def pending(self, now_ns: int | None = None, inside: bool = True) -> RegionPending | None:
        """The op the furthest ranks wait at while others have not arrived, or None.

        Whatever the ranks wrote: the op's number is positive, its description built
        from any words, and ``waited_s`` at least how long the daemon has seen it waiting
        (arrival times are the ranks' words).

        ``inside``: also a rank that stopped at a synchronisation inside an op every rank
        is in (``_stalled_inside``). Not for a communicator spanning nodes, where the
        node's lowest rank is behind the others while it waits at the daemon for the other
        nodes, which the daemon times by itself.
        """
        v = self.view
        if self._failure is not None:
            return None
        seqs = [int(v.slots[r, S_SEQ]) for r in range(v.world)]
        seq = max(seqs)
        missing = [r for r, s in enumerate(seqs) if s < seq]
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        if seq <= 0:
            return None
        if not missing:
            return self._stalled_inside(seq, now_ns) if inside else None
        if seq != self._seen_seq:
            self._seen_seq, self._seen_since = seq, now_ns
        arrived = [r for r, s in enumerate(seqs) if s >= seq]
        sigs = [
            s for s in (v.signature(r, seq) for r in arrived) if s is not None and s[G_SEQ] == seq
        ]
        if not sigs:
            return None  # a rank is between publishing its sequence number and its signature
        sig = sigs[0]
        first = min(min(s[G_ARRIVAL] for s in sigs), self._seen_since)
        return RegionPending(
            seq,
            describe(published_op(sig)),
            arrived,
            missing,
            max(0.0, (now_ns - first) / 1e9),
        )

    def _stalled_inside(self, seq: int, now_ns: int) -> RegionPending | None:
        """Every rank is in op ``seq``: the ranks behind the others at a synchronisation
        inside it, if some are and the steps have not moved since (else None).

        The ranks of one op pass the same synchronisations (``ShmPath.bump`` then ``wait``),
        so their step words agree whenever none is between two; one whose word stays behind
        the others' has stopped there (SIGSTOP, a debugger, a livelock). It is timed from
        the moment the words last moved, not from the op's start: a large op may rightly run
        longer than the group's timeout as long as it moves.
        """
        v = self.view
        steps = tuple(int(v.slots[r, S_STEP]) for r in range(v.world))
        if steps != self._steps:
            self._steps, self._steps_since = steps, now_ns
        if int(v.slots[:, S_DONE].min()) >= seq:
            return None  # every rank finished it
        top = max(steps)
        missing = [r for r, step in enumerate(steps) if step < top]
        if not missing:
            return None
        sig = v.signature(missing[0], seq)
        if sig is None or sig[G_SEQ] != seq:
            return None
        return RegionPending(
            seq,
            describe(published_op(sig)),
            [r for r in range(v.world) if r not in missing],
            missing,
            max(0.0, (now_ns - self._steps_since) / 1e9),
            inside=True,
        )

    def all_done(self) -> bool:
        """True when no rank is inside an op."""
        s = self.view.slots
        return bool((s[:, S_SEQ] == s[:, S_DONE]).all())

    def new_counts(self, now_ns: int | None = None) -> RegionCounts | None:
        """What the ranks counted since the last call: op table (from the lowest rank, which
        counts each op once), bytes per table row (summed over ranks), skew table, and the
        per-rank straggler counts. None once the counters were refused (below): nothing of
        this region is counted again.

        Every value is checked before any is taken: a counter below its last read, or beyond
        what the region's age allows (``MAX_OPS_PER_S``, ``MAX_BYTES_PER_S``,
        ``MAX_OPS_IN_FLIGHT``), refuses the whole read, so the metrics never move by more
        than what passed.

        Raises:
            ImpossibleCounters: the first time a slot's counters are impossible.
        """
        if self._counts_refused:
            return None
        v = self.view
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        age_s = max(0, now_ns - self._created_ns) / 1e9
        max_ops = age_s * MAX_OPS_PER_S + COUNT_SLACK
        max_bytes = age_s * MAX_BYTES_PER_S + BYTES_SLACK
        max_ns = age_s * 1e9 * (MAX_OPS_IN_FLIGHT + v.world) + NS_SLACK
        ops = v.op_table(0).copy()
        byts = np.stack([v.op_table(r)[:, C_BYTES] for r in range(v.world)])
        skew = v.skew_table(0).copy()
        last = v.slots[:, S_LAST].copy()
        done = v.slots[:, S_OPS].copy()
        try:
            self._check(ops, byts, skew, last, done, age_s, max_ops, max_bytes, max_ns)
        except ImpossibleCounters:
            self._counts_refused = True
            raise
        self._seen_done = done
        d_ops = ops - self._seen_ops
        d_bytes = (byts - self._seen_bytes).sum(axis=0)
        d_skew = skew - self._seen_skew
        d_last = last - self._seen_last
        self._seen_ops, self._seen_bytes, self._seen_skew, self._seen_last = ops, byts, skew, last
        return d_ops, d_bytes, d_skew, d_last

    def _check(
        self, ops: np.ndarray, byts: np.ndarray, skew: np.ndarray, last: np.ndarray,
        done: np.ndarray, age_s: float, max_ops: float, max_bytes: float, max_ns: float,
    ) -> None:  # fmt: skip
        """Raises ImpossibleCounters for the first impossible value of a read (``new_counts``)."""
        for now, seen, name in (
            (ops, self._seen_ops, _row_name),
            (skew, self._seen_skew, lambda kind: f"{KIND_NAMES.get(kind, f'op#{kind}')} skew"),
        ):
            back = np.argwhere(now < seen)
            if len(back):
                row, col = (int(x) for x in back[0])
                raise ImpossibleCounters(
                    0,
                    f"went backwards ({name(row)} column {col}: {int(seen[row, col])} -> {int(now[row, col])})",  # noqa: E501
                )
        for slot in range(len(byts)):
            fell = np.flatnonzero(byts[slot] < self._seen_bytes[slot])
            if len(fell):
                row = int(fell[0])
                raise ImpossibleCounters(
                    slot,
                    f"went backwards ({_row_name(row)} bytes: {int(self._seen_bytes[slot, row])} -> {int(byts[slot, row])})",  # noqa: E501
                )
            for what, now, seen in (
                ("ops at which it arrived last", last, self._seen_last),
                ("ops it completed", done, self._seen_done),
            ):
                if now[slot] < seen[slot]:
                    raise ImpossibleCounters(
                        slot,
                        f"went backwards ({what}: {int(seen[slot])} -> {int(now[slot])})",
                    )
        # From here every value is at least its last read, so at least 0. Sums in float64:
        # int64 sums of values near 2**63 would wrap; the bounds need no exactness.
        since = f"in the {age_s:.1f} s since the region was made"
        counts = (
            ("ops", ops[:, C_OPS]),
            ("op duration observations", ops[:, C_DUR_BUCKET:]),
            ("ops with an arrival skew", skew[:, K_COUNT]),
            ("arrival skew observations", skew[:, K_BUCKET:]),
        )
        for what, table in counts:
            total = float(table.sum(dtype=np.float64))
            if total > max_ops:
                raise ImpossibleCounters(
                    0,
                    f"advanced impossibly ({total:.0f} {what} {since}, more than {MAX_OPS_PER_S} a second)",  # noqa: E501
                )
        times = (("op durations", ops[:, C_DUR_SUM]), ("arrival skews", skew[:, K_SUM]))
        for what, column in times:
            total = float(column.sum(dtype=np.float64))
            if total > max_ns:
                raise ImpossibleCounters(
                    0,
                    f"advanced impossibly ({what} adding up to {total / 1e9:.0f} s {since}, more than {MAX_OPS_IN_FLIGHT + len(byts)} ops in flight at every moment)",  # noqa: E501
                )
        for slot in range(len(byts)):
            total = float(byts[slot].sum(dtype=np.float64))
            if total > max_bytes:
                raise ImpossibleCounters(
                    slot,
                    f"advanced impossibly ({total:.0f} bytes {since}, more than {MAX_BYTES_PER_S} a second)",  # noqa: E501
                )
            for what, now in (("ops at which it arrived last", last), ("ops it completed", done)):
                if now[slot] > max_ops:
                    raise ImpossibleCounters(
                        slot,
                        f"advanced impossibly ({int(now[slot])} {what} {since}, more than {MAX_OPS_PER_S} a second)",  # noqa: E501
                    )

    def close(self) -> None:
        """Unmaps and closes the memfd (the ranks keep their own mappings)."""
        self.view = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it
        os.close(self.fd)
