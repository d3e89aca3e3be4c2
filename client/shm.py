"""The shared-memory path: a communicator's collectives run between its ranks on one node.

Through the communicator's control region (``smddp.core.region``), with no message to the daemon:
a rank copies its input into its slot's data buffer (or, for large ops, its arena), writes
the op's signature and bumps its step; once every rank's step has reached its own, it
checks that all signatures agree, then reduces or copies what it needs from the others'
buffers, in rank order, so that every rank gets the same bits. Data buffers alternate with
the op's parity, so an op needs no trailing synchronisation.

Waiting spins briefly (a few microseconds only when ranks share cores), then sleeps on
the other rank's step word (futex), so an oversubscribed host does not collapse and an idle
rank costs nothing. While it sleeps it watches the daemon's connection and the region's
alarm word: the daemon writes a failure there (a rank died, a timeout, shutdown) and wakes
every rank, which raises the same error.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from smddp.client.errors import DaemonLostError, MismatchError, OpError, op_error
from smddp.client.peer_memory import Probe, reaches
from smddp.core.op import ReduceOp
from smddp.core.region import (
    C_BYTES,
    C_DUR_BUCKET,
    C_DUR_SUM,
    C_OPS,
    DTYPES,
    G_ARRIVAL,
    G_COUNT,
    G_DTYPE,
    G_KIND,
    G_OP,
    G_PACKED,
    G_ROOT,
    G_SEQ,
    H_ALARM,
    HEADER_BYTES,
    K_BUCKET,
    K_COUNT,
    K_SUM,
    LATENCY_BUCKETS,
    OP_COLS,
    OP_TABLE_OFFSET,
    READS_NO,
    READS_UNKNOWN,
    READS_YES,
    S_DONE,
    S_ERR_KIND,
    S_LAST,
    S_OPS,
    S_PID,
    S_PROBE_ADDRESS,
    S_PROBE_VALUE,
    S_READS,
    S_SEQ,
    S_SLEEPING,
    S_SOURCE,
    S_STEP,
    SIG_WORD,
    SIG_WORDS,
    SKEW_COLS,
    SKEW_TABLE_OFFSET,
    RegionGeometryError,
    RegionView,
    futex_wait,
    futex_wake,
    published_op,
    usable_cores,
)
from smddp.core.wire import describe, rank_list
from smddp.v1 import smddp_pb2 as pb

try:  # the per-op bookkeeping in C (setup.py builds it where a compiler is found)
    from smddp.core import _fastregion
except ImportError:  # pragma: no cover - an install without it runs the same in Python
    _fastregion = None  # type: ignore[assignment]

_BOUNDS_NS = [int(b * 1e9) for b in LATENCY_BUCKETS]
SPIN_S = 50e-6  # pure spinning, when every rank has a core
SHORT_SPIN_S = 5e-6  # when ranks share cores: the rank we wait for needs ours
# Then futex sleeps of this long, checking the daemon in between. No sched_yield phase: on a
# host shared with other work, one yield gave the core away for 4 ms (measured).
SLEEP_SLICE_S = 0.05
# Ops that never wait (every rank arrives together) would otherwise not notice that the daemon
# died: the region needs no daemon to run. So an op's entry asks at most this often.
ALIVE_CHECK_S = 0.1
# How often a rank looks for the others during ``wait``'s grace (a rare path: the
# communicator has failed).
GRACE_POLL_S = 0.001
# The daemon enforces the op timeout; this is a rank's last resort when it cannot.
GRACE_S = 30.0
# The error kinds an error read from the region may have; any other word there (a rank of
# the job can write any) is raised as INVALID.
KNOWN_KINDS = frozenset(pb.ErrorKind.values()) - {pb.ERROR_KIND_UNSPECIFIED}


class ShmPath:
    """One rank's side of a communicator's control region."""

    def __init__(
        self,
        name: str,
        rank: int,
        region: np.ndarray,
        timeout_s: float,
        daemon_alive: Callable[[], bool],
        daemon_gone: Callable[[], DaemonLostError],
        ranks: Sequence[int] = (),
        world: int | None = None,
        *,
        native: bool,
    ) -> None:
        """``rank``: this rank's slot; ``ranks``: the communicator's rank of each slot, as
        messages name them (default: the slot's own number; a communicator spanning nodes
        has a slot for each of its ranks on this node); ``world``: the number of slots, as
        the daemon registered the communicator's ranks on this node (None: the header's,
        for a region made here); ``native``: whether the C part may run the protocol
        (``ClientConfig.native``).

        Raises:
            OpError: the region's header disagrees with ``world`` or the region's size (a
                rank of the job wrote over it); the error is recorded in this rank's slot
                where the size and ``world`` say it is, so that the others raise it too.
        """
        self.name = name
        self.rank = rank
        try:
            self.view = v = RegionView.mapped(region, world)
        except RegionGeometryError as exc:
            raise self._unusable(exc, ranks) from None
        if not 0 <= rank < v.world:
            raise op_error(
                pb.INVALID, f"{name}: slot {rank} is outside a control region of {v.world} slots"
            )
        self.world = v.world
        self.ranks = list(ranks) or list(range(v.world))
        self.data_bytes = v.data_bytes
        self.timeout_s = timeout_s
        self._alive = daemon_alive
        self._gone = daemon_gone
        # Scalar access through a memoryview costs a third of numpy's.
        self.q = region.data.cast("q")
        self.base = v.slot_base[rank]
        self.bases = v.slot_base
        self.others = [
            (j, v.slot_base[j] + S_STEP, v.step_address(j)) for j in range(self.world) if j != rank
        ]
        self.sleep_words = [b + S_SLEEPING for b in v.slot_base]
        self.my_address = v.step_address(rank)
        self.step = self.q[self.base + S_STEP]
        self.q[self.base + S_PID] = os.getpid()
        self._probe = Probe()
        self._reached: dict[int, int] = {}  # slot -> pid, see judge_peers
        self.q[self.base + S_PROBE_ADDRESS] = self._probe.address
        self.q[self.base + S_PROBE_VALUE] = self._probe.value
        self.q[self.base + S_READS] = READS_UNKNOWN
        slot_start = HEADER_BYTES + rank * v.slot_bytes
        self.op_base = (slot_start + OP_TABLE_OFFSET) // 8
        self.skew_base = (slot_start + SKEW_TABLE_OFFSET) // 8
        self.buffers = [[v.data(j, p) for j in range(self.world)] for p in (0, 1)]
        self._typed: dict[tuple[int, np.dtype], list[np.ndarray]] = {}
        self._sized: dict[tuple[int, np.dtype, int], list[np.ndarray]] = {}
        # Word indices of every rank's arrival time, per parity (done() reads them).
        self._arrival_words = [
            [b + SIG_WORD + p * SIG_WORDS + G_ARRIVAL for b in v.slot_base] for p in (0, 1)
        ]
        self.spin_s = SPIN_S if usable_cores() >= self.world else SHORT_SPIN_S
        self.error: OpError | DaemonLostError | None = None
        self.count = 0  # ops run in the region so far (their parity alternates)
        self._next_alive_check = 0.0
        # The C part, when built and not turned off (ClientConfig.native): it takes over the
        # step counter and the methods below of the same names, which stay as the reference.
        self.native = _native_slot(region, rank, self.world, v, self.spin_s) if native else None
        if self.native is not None:
            self.bump = self.native.bump  # type: ignore[method-assign]
            self.publish = self.native.publish  # type: ignore[method-assign]
            self.done = self.native.done  # type: ignore[method-assign]
            self._agree = self.native.agree
            self._spin = self.native.spin

    def _unusable(self, exc: RegionGeometryError, ranks: Sequence[int]) -> OpError:
        """The error of a region whose header is not the one the daemon wrote, recorded
        in this rank's slot when the region's size and world say where it is."""
        who = f"rank {ranks[self.rank]}" if self.rank < len(ranks) else f"slot {self.rank}"
        message = f"{self.name}: {who} cannot use the control region: {exc}"
        trusted = exc.trusted
        if trusted is not None and 0 <= self.rank < trusted.world:
            trusted.set_slot_error(self.rank, pb.INVALID, message)
            futex_wake(trusted.step_address(self.rank))
        return op_error(pb.INVALID, message)

    # -- synchronisation ----------------------------------------------------------------------

    def check(self) -> None:
        """Raises the communicator's error, if it has one (at the start of every op)."""
        if self.error is not None and getattr(self.error, "kind", None) != pb.SHUTDOWN:
            raise self.error
        if self.q[H_ALARM]:
            self._raise_alarm(entry=True)
        now = time.monotonic()
        if now >= self._next_alive_check:
            self._next_alive_check = now + ALIVE_CHECK_S
            if not self._alive():
                if self.q[H_ALARM]:
                    self._raise_alarm(entry=True)
                self.error = self._gone()
                raise self.error

    def _raise_alarm(self, entry: bool = False) -> None:
        found = self.view.failure() or self.view.first_slot_error()
        if found is None:
            return  # the alarm is being raised right now; its message follows
        kind, message = found
        # The words are the daemon's or a rank's, and any rank can write any: the kind is
        # one the client knows, and the error says something.
        if kind not in KNOWN_KINDS:
            kind = pb.INVALID
        if not message:
            message = (
                f"{self.name}: "
                "the control region says the communicator failed, without a message (a rank of the job wrote over the region's failure words)"  # noqa: E501
            )
        if entry and kind == pb.SHUTDOWN and not self._alive():
            # A new op after the daemon went away: say so, as an op sent to it would. (An
            # op that was in flight when it stopped says that it was shutting down.)
            self.error = self._gone()
        else:
            self.error = op_error(kind, message)
        raise self.error

    def bump(self) -> int:
        """Marks this rank arrived at its next synchronisation point; returns its number."""
        q = self.q
        self.step += 1
        q[self.base + S_STEP] = self.step
        for w in self.sleep_words:
            if q[w]:  # someone may sleep on a step word: wake ours
                futex_wake(self.my_address)
                break
        return self.step

    def wait(self, target: int, seq: int, grace_s: float = 0.0, spin: bool = True) -> None:
        """Returns once every other rank's step has reached ``target``.

        ``spin``: False to sleep at once, for a wait that lasts a network exchange (spinning
        would only take the core from the work it waits for).

        ``grace_s``: when the communicator fails meanwhile, how long to go on waiting for
        ranks that will still arrive unless they failed too (they recorded an error, or
        the grace ran out). An op whose outcome was settled before the failure (the second
        synchronisation of ``RegionOps.across_nodes``, after the node's exchange succeeded)
        then still completes: a rank of another node that finished the op and left must
        not fail it here.
        """
        try:
            self._wait(target, seq, spin)
        except OpError:
            if grace_s <= 0 or not self._arrive_within(target, grace_s):
                raise
            self.error = None  # the op completed; the next one raises the failure

    def _arrive_within(self, target: int, grace_s: float) -> bool:
        q = self.q
        deadline = time.perf_counter() + grace_s
        while time.perf_counter() < deadline:
            if all(q[w] >= target for _, w, _ in self.others):
                return True
            if any(q[self.bases[j] + S_ERR_KIND] for j, _, _ in self.others):
                return False  # one gave up: it will not arrive
            time.sleep(GRACE_POLL_S)
        return False

    def _wait(self, target: int, seq: int, spin: bool = True) -> None:
        spin_s = self.spin_s if spin else 0.0
        if spin and self.native is not None:
            arrived = self._spin(target)  # spins as _wait_one would
            if arrived > 0:
                return
            if arrived < 0:
                self._raise_alarm()
            spin_s = 0.0  # spun already: on to sleeping
        q = self.q
        for j, word, address in self.others:
            if q[word] < target:
                self._wait_one(j, word, address, target, seq, spin_s)

    def _wait_one(
        self, j: int, word: int, address: int, target: int, seq: int, spin_s: float
    ) -> None:
        q = self.q
        start = time.perf_counter()
        spin_until = start + spin_s
        while q[word] < target:
            if q[H_ALARM]:
                self._raise_alarm()
            if time.perf_counter() < spin_until:
                continue
            break
        else:
            return
        sleeping = self.base + S_SLEEPING
        deadline = start + self.timeout_s + GRACE_S
        try:
            while True:
                q[sleeping] = 1
                seen = q[word]
                if seen >= target:
                    return
                if q[H_ALARM]:
                    self._raise_alarm()
                futex_wait(address, seen, SLEEP_SLICE_S)
                if q[word] >= target:
                    return
                if not self._alive():
                    if q[H_ALARM]:
                        self._raise_alarm()
                    self.error = self._gone()
                    raise self.error
                if time.perf_counter() > deadline:
                    self._local_timeout(seq, target, time.perf_counter() - start)
        finally:
            q[sleeping] = 0

    def _local_timeout(self, seq: int, target: int, waited: float) -> None:
        """The daemon did not time the op out (it is stuck): name the lagging ranks here,
        those behind op ``seq`` or, inside it, behind synchronisation ``target``."""
        q = self.q
        lagging = [
            j
            for j in range(self.world)
            if q[self.bases[j] + S_SEQ] < seq
            or (j != self.rank and q[self.bases[j] + S_STEP] < target)
        ]
        arrived = [j for j in range(self.world) if j not in lagging]
        sig = self.view.signature(self.rank, seq) or (0,) * SIG_WORDS
        self.error = op_error(
            pb.TIMEOUT,
            f"{self.name}: "
            f"op #{seq} {describe(published_op(sig))} timed out: "
            f"{self._names(lagging) or 'no rank'} never arrived while {self._names(arrived)} waited {waited:.1f} s, past the group's timeout of {self.timeout_s:.1f} s (smddpd did not answer in time)",  # noqa: E501
        )
        raise self.error

    def _names(self, slots: list[int]) -> str:
        """``ranks 0-2``: the communicator's ranks of some slots, for a message."""
        return rank_list([self.ranks[j] for j in slots]) if slots else ""

    # -- reading the others' memory in place ---------------------------------------------------

    def judge_peers(self, allowed: bool) -> bool:
        """Writes and returns this rank's verdict on reading every other rank's memory in
        place (``peer_memory``): yes when ``allowed`` and it reads each one's probe word back.

        The pids it reached are the only ones it reads from later (``pid_of``): a pid word
        that changes afterwards (any rank of the communicator can write the region) cannot
        send its reads to another process.
        """
        q = self.q
        reached = {}
        if allowed:
            for j, _, _ in self.others:
                b = self.bases[j]
                pid = q[b + S_PID]
                if reaches(pid, q[b + S_PROBE_ADDRESS], q[b + S_PROBE_VALUE]):
                    reached[j] = pid
        ok = allowed and len(reached) == len(self.others)
        self._reached = reached if ok else {}
        q[self.base + S_READS] = READS_YES if ok else READS_NO
        return ok

    def peers_readable(self) -> bool:
        """After a synchronisation that followed every rank's ``judge_peers``: True when
        every rank can read every other one (the same answer on every rank)."""
        return bool(self._reached) and all(self.q[b + S_READS] == READS_YES for b in self.bases)

    def offer_source(self, address: int) -> None:
        """Publishes where this rank's source of its next single-copy op lies (before the op's
        first synchronisation, which makes it visible)."""
        self.q[self.base + S_SOURCE] = address

    def source_of(self, slot: int) -> int:
        """Where the rank of ``slot`` offered its source (an address in its process)."""
        return self.q[self.bases[slot] + S_SOURCE]

    def pid_of(self, slot: int) -> int:
        """The process of the rank of ``slot`` as ``judge_peers`` reached it; 0 if it did
        not."""
        return self._reached.get(slot, 0)

    # -- one op ----------------------------------------------------------------------------------

    def next_parity(self) -> int:
        """The parity of the next op in the region: its data buffers and signature words."""
        self.count += 1
        return self.count & 1

    def publish(
        self, seq: int, parity: int, kind: int, dtype: int, count: int, root: int, reduce_op: int
    ) -> int:
        """Writes this rank's signature of op ``seq`` and arrives at it; returns the step."""
        q = self.q
        w = self.base + SIG_WORD + parity * SIG_WORDS
        q[w + G_SEQ] = seq
        q[w + G_KIND] = kind
        q[w + G_DTYPE] = dtype
        q[w + G_COUNT] = count
        q[w + G_ROOT] = root
        q[w + G_OP] = reduce_op
        q[w + G_ARRIVAL] = time.monotonic_ns()
        # packed_signature(), inline (a function call is a tenth of this method).
        q[w + G_PACKED] = (
            (kind << 58)
            | (dtype << 53)
            | (reduce_op << 49)
            | ((root & 0x3FFF) << 35)
            | (count & 0x7FFFFFFFF)
        )
        q[self.base + S_SEQ] = seq
        return self.bump()

    def agree(self, seq: int, parity: int) -> None:
        """After the op's first synchronisation: raises MismatchError unless every rank
        published the same signature for op ``seq`` (the same text on every rank)."""
        if self.native is not None:
            if not self._agree(seq, parity):
                self._mismatch(seq, parity)
            return
        q = self.q
        off = SIG_WORD + parity * SIG_WORDS
        mine = q[self.base + off + G_PACKED]
        for b in self.bases:
            if q[b + off + G_PACKED] != mine or q[b + off + G_SEQ] != seq:
                self._mismatch(seq, parity)

    def fail(self, kind: int, message: str) -> OpError:
        """Records this rank's error in its slot, where every other rank finds it (they
        raise the same), and returns it to raise."""
        self.view.set_slot_error(self.rank, kind, message)
        futex_wake(self.my_address)  # a rank asleep on our step sees the alarm at once
        self.error = op_error(kind, message)
        return self.error

    def _mismatch(self, seq: int, parity: int) -> None:
        groups: dict[tuple[int, ...], list[int]] = {}
        sigs = {}
        for r in range(self.world):
            sig = self.view.signature_at(r, parity)
            sigs[r] = sig
            groups.setdefault(sig[G_KIND : G_OP + 1] + (sig[G_SEQ],), []).append(r)
        ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1][0]))

        def call(ranks: list[int]) -> str:
            sig = sigs[ranks[0]]
            text = f"{self._names(ranks)} called {describe(published_op(sig))}"
            return text if sig[G_SEQ] == seq else f"{text} as op #{sig[G_SEQ]}"

        message = f"{self.name}: {call(ordered[0][1])} as op #{seq} while " + " and ".join(
            call(r) for _, r in ordered[1:]
        )
        message = message.replace(f" as op #{seq} as op #", " as op #")
        self.view.set_slot_error(self.rank, pb.MISMATCH, message)
        self.error = MismatchError(message)
        raise self.error

    def done(self, seq: int, parity: int, kind: int, dtype: int, nbytes: int) -> None:
        """Counts the completed op in this rank's slot (the daemon reads the counters)."""
        q = self.q
        arrivals = list(map(q.__getitem__, self._arrival_words[parity]))
        first, last = min(arrivals), max(arrivals)
        took = time.monotonic_ns() - first
        skew = last - first
        e = self.op_base + (kind * DTYPES + dtype) * OP_COLS
        q[e + C_OPS] += 1
        q[e + C_BYTES] += nbytes
        q[e + C_DUR_SUM] += took
        e += C_DUR_BUCKET + bisect.bisect_left(_BOUNDS_NS, took)
        q[e] += 1
        k = self.skew_base + kind * SKEW_COLS
        q[k + K_COUNT] += 1
        q[k + K_SUM] += skew
        k += K_BUCKET + bisect.bisect_left(_BOUNDS_NS, skew)
        q[k] += 1
        b = self.base
        if arrivals[self.rank] == last and arrivals.index(last) == self.rank:
            q[b + S_LAST] += 1
        q[b + S_OPS] += 1
        q[b + S_DONE] = seq

    def sized(self, parity: int, dtype: np.dtype, n: int) -> list[np.ndarray]:
        """Every rank's data buffer for ``parity``: its first ``n`` elements of ``dtype``
        (cached: an op of the same size as a recent one builds no views)."""
        key = (parity, dtype, n)
        views = self._sized.get(key)
        if views is None:
            if len(self._sized) >= 64:
                self._sized.clear()
            views = [b[:n] for b in self.typed(parity, dtype)]
            self._sized[key] = views
        return views

    def typed(self, parity: int, dtype: np.dtype) -> list[np.ndarray]:
        """Every rank's data buffer for ``parity`` as ``dtype`` (cached)."""
        key = (parity, dtype)
        views = self._typed.get(key)
        if views is None:
            n = self.data_bytes // dtype.itemsize
            views = [b[: n * dtype.itemsize].view(dtype) for b in self.buffers[parity]]
            self._typed[key] = views
        return views


def _built() -> bool:
    """True when the C part is built (whether to use it is ``ClientConfig.native``'s)."""
    return _fastregion is not None


def native_reduce(out: np.ndarray, ins: list[np.ndarray], average: bool) -> bool:
    """True once the C part has reduced ``ins`` in their order into ``out`` (divided by
    their number when ``average``), bitwise as numpy would, without the GIL; False (``out``
    untouched) for what it leaves to numpy (dtypes, aliasing) or without the C part. Whether
    to call it at all is the caller's (``ClientConfig.native``)."""
    return _built() and _fastregion.reduce_into(out, ins, average)


def _native_slot(
    region: np.ndarray, rank: int, world: int, view: RegionView, spin_s: float
) -> _fastregion.Slot | None:
    """The C side of this rank's slot, or None (not built)."""
    if not _built():
        return None
    from smddp.core import region as layout

    return _fastregion.Slot(
        region,
        rank,
        world,
        view.slot_bytes,
        view.data_bytes,
        int(spin_s * 1e9),
        tuple(getattr(layout, name) for name in _fastregion.LAYOUT),
        tuple(_BOUNDS_NS),
        ReduceOp.SUM,
        ReduceOp.AVG,
    )
