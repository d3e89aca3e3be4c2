"""Prometheus metrics of the daemon, on a registry of its own.

Label sets stay bounded: op kind, dtype, error kind, and (for stragglers) job and rank,
whose series are removed when the job ends. No label carries an op sequence number.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.metrics_core import Metric

from smddp import region as rg
from smddp.v1 import smddp_pb2 as pb
from smddp.wire import KIND_NAMES, WIRE_CODES, dtype_name

# The *_created series double the output and say nothing a scrape's timestamps don't.
disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it bare

# The ranks count region ops into the same buckets (smddp.region), so both paths add up.
_LATENCY_BUCKETS = rg.LATENCY_BUCKETS
ERROR_NAMES = {v.number: v.name.lower() for v in pb.ErrorKind.DESCRIPTOR.values}

# One op kind and dtype's series: ops, bytes, duration, skew (resolved once, see _op_children).
_OpChildren = tuple[Counter, Counter, Histogram, Histogram]


class Metrics:
    """Every metric smddpd exports; the communicator reports into it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # Registered first, so that a scrape reads the regions' counters before the metrics.
        self._drain = _RegionDrain()
        r.register(self._drain)
        self.ops = Counter(
            "smddp_ops", "Collective and point-to-point ops completed", ["op", "dtype"], registry=r
        )
        self.bytes = Counter(
            "smddp_op_bytes",
            "Bytes contributed by each rank, summed over ranks",
            ["op", "dtype"],
            registry=r,
        )
        self.duration = Histogram(
            "smddp_op_duration_seconds",
            "Time from the first rank's arrival to completion of an op",
            ["op", "dtype"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.skew = Histogram(
            "smddp_arrival_skew_seconds",
            "Time from the first to the last rank's arrival at an op",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.straggler = Counter(
            "smddp_straggler",
            "Ops at which this rank arrived last (with more than one rank)",
            ["job", "rank"],
            registry=r,
        )
        self.errors = Counter(
            "smddp_errors",
            "Failed communicators and refused requests by kind",
            ["kind"],
            registry=r,
        )
        self.registered_ranks = Gauge(
            "smddp_registered_ranks", "Ranks registered with this daemon", registry=r
        )
        self.jobs = Gauge("smddp_active_jobs", "Jobs with at least one registered rank", registry=r)
        self.shm_bytes = Gauge(
            "smddp_shm_bytes", "Bytes of shared-memory arenas mapped by the daemon", registry=r
        )
        self.peer_bytes_sent = Counter(
            "smddp_peer_bytes_sent", "Bytes sent to peer daemons", ["peer"], registry=r
        )
        self.peer_bytes_received = Counter(
            "smddp_peer_bytes_received", "Bytes received from peer daemons", ["peer"], registry=r
        )
        self.peer_errors = Counter(
            "smddp_peer_connection_errors",
            "Failed connections to peer daemons",
            ["peer"],
            registry=r,
        )
        self.peer_calls = Counter(
            "smddp_peer_calls",
            "Calls of other daemons that this daemon's Peer service answered, by status",
            ["method", "code"],
            registry=r,
        )
        # Pre-create the error series so that dashboards see zeros, not absences.
        for name in ERROR_NAMES.values():
            if name != "error_kind_unspecified":
                self.errors.labels(name)
        self._job_ranks: dict[str, set[str]] = {}
        self._children: dict[tuple[int, int], _OpChildren] = {}
        self._skew_children: dict[int, Histogram] = {}

    def watch(
        self,
        session_count: Callable[[], int],
        job_count: Callable[[], int],
        arena_bytes: Callable[[], int],
        drain: Callable[[], None],
    ) -> None:
        """Makes the gauges read the registry's tables at scrape time (``session_count``,
        ``job_count``, ``arena_bytes``), and every scrape first call ``drain``, which reads the
        ranks' counters in the control regions."""
        self._drain.drain = drain
        self.registered_ranks.set_function(session_count)
        self.jobs.set_function(job_count)
        self.shm_bytes.set_function(arena_bytes)

    def _op_children(self, kind: int, dtype_code: int) -> _OpChildren:
        key = (kind, dtype_code)
        children = self._children.get(key)
        if children is None:  # labels() costs microseconds per call: resolve once per op and dtype
            op = KIND_NAMES.get(kind, "unknown")
            dtype = (
                dtype_name(dtype_code)
                if dtype_code in WIRE_CODES and kind != pb.BARRIER
                else "none"
            )
            children = (
                self.ops.labels(op, dtype),
                self.bytes.labels(op, dtype),
                self.duration.labels(op, dtype),
                self.skew.labels(op),
            )
            self._children[key] = children
        return children

    def op_done(
        self, job_id: str, world_size: int, req: pb.OpRequest, duration: float, last_rank: int,
        skew: float, nbytes: int,
    ) -> None:  # fmt: skip
        """Records one completed op of job ``job_id`` (called once per op, at its last chunk)."""
        ops, nbytes_counter, durations, skews = self._op_children(req.kind, req.dtype)
        ops.inc()
        nbytes_counter.inc(nbytes)
        durations.observe(duration)
        skews.observe(skew)
        if world_size > 1 and req.kind not in (pb.SEND, pb.RECV):
            self.straggler.labels(job_id, str(last_rank)).inc()
            self._job_ranks.setdefault(job_id, set()).add(str(last_rank))

    def add_region_counts(
        self, job_id: str, world_size: int, ops: np.ndarray, nbytes: np.ndarray, skew: np.ndarray,
        last: np.ndarray,
    ) -> None:  # fmt: skip
        """Adds what a communicator's ranks counted in its control region since the last read:
        the same metrics, buckets and labels as ``op_done`` (see ``ControlRegion.new_counts``)."""
        for row in np.flatnonzero(ops[:, rg.C_OPS] | nbytes):
            kind, dtype_code = divmod(int(row), rg.DTYPES)
            c_ops, c_bytes, c_duration, _ = self._op_children(kind, dtype_code)
            c_ops.inc(int(ops[row, rg.C_OPS]))
            c_bytes.inc(int(nbytes[row]))
            _add_observations(
                c_duration, ops[row, rg.C_DUR_BUCKET :], int(ops[row, rg.C_DUR_SUM]) / 1e9
            )
        for skew_row in np.flatnonzero(skew[:, rg.K_COUNT]):
            c_skew = self._skew_children.get(int(skew_row))
            if c_skew is None:
                c_skew = self._skew_children[int(skew_row)] = self.skew.labels(
                    KIND_NAMES.get(int(skew_row), "unknown")
                )
            _add_observations(
                c_skew, skew[skew_row, rg.K_BUCKET :], int(skew[skew_row, rg.K_SUM]) / 1e9
            )
        if world_size > 1:
            for rank in np.flatnonzero(last):
                self.straggler.labels(job_id, str(int(rank))).inc(int(last[rank]))
                self._job_ranks.setdefault(job_id, set()).add(str(int(rank)))

    def error(self, kind: int) -> None:
        """Counts one error of the wire ErrorKind ``kind``."""
        self.errors.labels(ERROR_NAMES.get(kind, "invalid")).inc()

    def job_ended(self, job_id: str) -> None:
        """Drops the job's straggler series so that label sets stay bounded."""
        for rank in self._job_ranks.pop(job_id, ()):
            try:
                self.straggler.remove(job_id, rank)
            except KeyError:
                pass


def _add_observations(child: Histogram, buckets: np.ndarray, total: float) -> None:
    """Adds counted observations to a histogram child: per-bucket counts (not cumulative, as
    the ranks keep them) and their sum. prometheus_client has no public call for this; its
    ``observe`` does the same to the same fields, one observation at a time."""
    for i in np.flatnonzero(buckets):
        child._buckets[i].inc(int(buckets[i]))
    child._sum.inc(total)


class _RegionDrain:
    """A collector that exports nothing: at each scrape it first has every communicator read
    its ranks' region counters into the metrics, so a scrape after an op sees it."""

    def __init__(self) -> None:
        self.drain: Callable[[], None] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.drain is not None:
            self.drain()
        return iter(())
