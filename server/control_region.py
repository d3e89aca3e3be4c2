"""The daemon's side of a communicator's control region: it creates it and supervises.

The communicator's ranks on this node run their collectives through the region (see
``smddp.region``); the daemon takes no part in them, beyond the exchange with other nodes
that a communicator spanning nodes asks of it (``OpRequest.node_combined``). Slot i is the
communicator's ``local_ranks[i]``. It marks the communicator failed there (every waiting rank
wakes and raises the same error), finds ops that waited past the timeout, shows in-flight
ops to ``smddpctl status`` and reads the ranks' counters into its metrics.
"""

from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass

import numpy as np

from smddp.region import (
    G_ARRIVAL,
    G_COUNT,
    G_DTYPE,
    G_KIND,
    G_OP,
    G_ROOT,
    G_SEQ,
    H_ALARM,
    S_DONE,
    S_LAST,
    S_OPS,
    S_SEQ,
    S_STEP,
    RegionView,
    data_bytes_for,
    init_header,
    region_bytes,
)
from smddp.wire import describe


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
        self.fd = os.memfd_create("smddp-region", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.nbytes)
            self._mm = mmap.mmap(
                self.fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        except OSError:
            os.close(self.fd)
            raise
        buf = np.frombuffer(self._mm, dtype=np.uint8)
        init_header(buf, world_size, data_bytes)
        self.view = RegionView(buf)
        # The counters as last read into the metrics, to add only what is new.
        self._seen_ops = np.zeros_like(self.view.op_table(0))
        self._seen_bytes = np.zeros((world_size,) + self._seen_ops.shape[:1], dtype=np.int64)
        self._seen_skew = np.zeros_like(self.view.skew_table(0))
        self._seen_last = np.zeros(world_size, dtype=np.int64)
        # The ranks' step words as last seen, and when they last changed (monotonic ns): how
        # long the ranks inside an op have waited at a synchronisation for one that stopped.
        self._steps: tuple[int, ...] = ()
        self._steps_since = 0

    def fail(self, kind: int, message: str) -> None:
        """Marks the communicator failed and wakes every rank."""
        self.view.set_failure(kind, message)

    def rank_error(self) -> tuple[int, str] | None:
        """An error a rank found and recorded (a mismatch), or None."""
        return self.view.first_slot_error() if self.view.header[H_ALARM] else None

    def ops_completed(self, rank: int) -> int:
        """Ops rank ``rank`` completed through the region."""
        return int(self.view.slots[rank, S_OPS])

    def pending(self, now_ns: int | None = None, inside: bool = True) -> RegionPending | None:
        """The op the furthest ranks wait at while others have not arrived, or None.

        ``inside``: also a rank that stopped at a synchronisation inside an op every rank
        is in (``_stalled_inside``). Not for a communicator spanning nodes, where the
        node's lowest rank is behind the others while it waits at the daemon for the other
        nodes, which the daemon times by itself.
        """
        v = self.view
        if v.failure() is not None:
            return None
        seqs = [int(v.slots[r, S_SEQ]) for r in range(v.world)]
        seq = max(seqs)
        missing = [r for r, s in enumerate(seqs) if s < seq]
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        if seq == 0:
            return None
        if not missing:
            return self._stalled_inside(seq, now_ns) if inside else None
        arrived = [r for r, s in enumerate(seqs) if s >= seq]
        sigs = [
            s for s in (v.signature(r, seq) for r in arrived) if s is not None and s[G_SEQ] == seq
        ]
        if not sigs:
            return None  # a rank is between publishing its sequence number and its signature
        sig = sigs[0]
        first = min(s[G_ARRIVAL] for s in sigs)
        return RegionPending(
            seq,
            describe(sig[G_KIND], sig[G_DTYPE], sig[G_COUNT], sig[G_ROOT], sig[G_OP]),
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
            describe(sig[G_KIND], sig[G_DTYPE], sig[G_COUNT], sig[G_ROOT], sig[G_OP]),
            [r for r in range(v.world) if r not in missing],
            missing,
            max(0.0, (now_ns - self._steps_since) / 1e9),
            inside=True,
        )

    def all_done(self) -> bool:
        """True when no rank is inside an op."""
        s = self.view.slots
        return bool((s[:, S_SEQ] == s[:, S_DONE]).all())

    def new_counts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """What the ranks counted since the last call: op table (from the lowest rank, which
        counts each op once), bytes per table row (summed over ranks), skew table, and the
        per-rank straggler counts."""
        v = self.view
        ops = v.op_table(0).copy()
        d_ops = ops - self._seen_ops
        self._seen_ops = ops
        byts = np.stack([v.op_table(r)[:, 1] for r in range(v.world)])
        d_bytes = (byts - self._seen_bytes).sum(axis=0)
        self._seen_bytes = byts
        skew = v.skew_table(0).copy()
        d_skew = skew - self._seen_skew
        self._seen_skew = skew
        last = v.slots[:, S_LAST].copy()
        d_last = last - self._seen_last
        self._seen_last = last
        return d_ops, d_bytes, d_skew, d_last

    def close(self) -> None:
        """Unmaps and closes the memfd (the ranks keep their own mappings)."""
        self.view = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it
        os.close(self.fd)
