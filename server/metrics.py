"""Prometheus metrics of the daemon, on a registry of its own.

Label sets stay bounded: op kind, dtype, error kind, peer. Job ids appear only with
``--metrics-job-labels`` (``Metrics.job_labels``): then each job's ops, bytes and stragglers
have series of their own, labelled ``job``, removed when the job ends. Without it no series
names a job: whoever scrapes /metrics learns nothing of who runs what. No label carries an op
sequence number.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Iterator

import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

from smddp.core import region as rg
from smddp.core.wire import KIND_NAMES, WIRE_CODES, dtype_name
from smddp.server.logthrottle import refusals
from smddp.v1 import smddp_pb2 as pb

log = logging.getLogger(__name__)

# The *_created series double the output and say nothing a scrape's timestamps don't.
disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it bare

# The ranks count region ops into the same buckets (smddp.core.region), so both paths add up.
_LATENCY_BUCKETS = rg.LATENCY_BUCKETS
ERROR_NAMES = {v.number: v.name.lower() for v in pb.ErrorKind.DESCRIPTOR.values}

# One op kind and dtype's series: ops, bytes, duration, skew (resolved once, see _op_children).
_OpChildren = tuple[Counter, Counter, Histogram, Histogram]


class Metrics:
    """Every metric smddpd exports; the communicator reports into it."""

    def __init__(self, job_labels: bool = False) -> None:
        """``job_labels``: per-job series (``--metrics-job-labels``; the registry sets it from
        the daemon's configuration)."""
        self.job_labels = job_labels
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
            "Ops at which this rank of this job arrived last, with more than one rank (--metrics-job-labels only; removed when the job ends)",  # noqa: E501
            ["job", "rank"],
            registry=r,
        )
        self.job_ops = Counter(
            "smddp_job_ops",
            "Ops this job completed (--metrics-job-labels only; removed when the job ends)",
            ["job", "op", "dtype"],
            registry=r,
        )
        self.job_bytes = Counter(
            "smddp_job_op_bytes",
            "Bytes contributed by this job's ranks, summed over ranks (--metrics-job-labels only; removed when the job ends)",  # noqa: E501
            ["job", "op", "dtype"],
            registry=r,
        )
        self.errors = Counter(
            "smddp_errors",
            "Failed communicators and refused requests by kind",
            ["kind"],
            registry=r,
        )
        self.shrinks = Counter(
            "smddp_shrinks",
            "Communicators this daemon made for shrink_group's survivors (generation 1 and up; smddpctl status shows each one's generation and the ranks it left out)",  # noqa: E501
            registry=r,
        )
        self.grows = Counter(
            "smddp_grows",
            "Communicators this daemon made for smddp.grow (survivors and the replacements that joined them; smddpctl status shows each one's generation and the ranks that joined)",  # noqa: E501
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
        # Per-job series, by job id: how many live jobs have the id (jobs of different tokens
        # may share one), and every series made for it, removed with the last of them.
        self._jobs_lock = threading.Lock()
        self._live_jobs: dict[str, int] = {}
        self._job_series: dict[str, set[tuple[Counter, tuple[str, ...]]]] = {}
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
            op, dtype = _op_labels(kind, dtype_code)
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
        if self.job_labels:
            self._job_inc(job_id, req.kind, req.dtype, 1, nbytes)
            if world_size > 1 and req.kind not in (pb.SEND, pb.RECV):
                self._job_child(self.straggler, job_id, str(last_rank)).inc()

    def add_region_counts(
        self, job_id: str, world_size: int, ops: np.ndarray, nbytes: np.ndarray, skew: np.ndarray,
        last: np.ndarray,
    ) -> None:  # fmt: skip
        """Adds what a communicator's ranks counted in its control region since the last read:
        the same metrics, buckets and labels as ``op_done`` (see ``ControlRegion.new_counts``,
        which has checked every value: none is negative)."""
        for row in np.flatnonzero(ops[:, rg.C_OPS] | nbytes):
            kind, dtype_code = divmod(int(row), rg.DTYPES)
            c_ops, c_bytes, c_duration, _ = self._op_children(kind, dtype_code)
            c_ops.inc(int(ops[row, rg.C_OPS]))
            c_bytes.inc(int(nbytes[row]))
            _add_observations(
                c_duration, ops[row, rg.C_DUR_BUCKET :], int(ops[row, rg.C_DUR_SUM]) / 1e9
            )
            if self.job_labels:
                self._job_inc(job_id, kind, dtype_code, int(ops[row, rg.C_OPS]), int(nbytes[row]))
        for skew_row in np.flatnonzero(skew[:, rg.K_COUNT]):
            c_skew = self._skew_children.get(int(skew_row))
            if c_skew is None:
                c_skew = self._skew_children[int(skew_row)] = self.skew.labels(
                    KIND_NAMES.get(int(skew_row), "unknown")
                )
            _add_observations(
                c_skew, skew[skew_row, rg.K_BUCKET :], int(skew[skew_row, rg.K_SUM]) / 1e9
            )
        if world_size > 1 and self.job_labels:
            for rank in np.flatnonzero(last):
                self._job_child(self.straggler, job_id, str(int(rank))).inc(int(last[rank]))

    def _job_inc(self, job_id: str, kind: int, dtype_code: int, ops: int, nbytes: int) -> None:
        """Adds to job ``job_id``'s own op and byte series (``job_labels`` only)."""
        op = KIND_NAMES.get(kind, "unknown")
        dtype = (
            dtype_name(dtype_code) if dtype_code in WIRE_CODES and kind != pb.BARRIER else "none"
        )
        self._job_child(self.job_ops, job_id, op, dtype).inc(ops)
        if nbytes:
            self._job_child(self.job_bytes, job_id, op, dtype).inc(nbytes)

    def _job_child(self, counter: Counter, job_id: str, *labels: str) -> Counter:
        """``counter``'s series of job ``job_id``, remembered so that ``job_ended`` removes it.
        For a job that has ended (or never started here) a series that is not exported: what
        arrives after a job's end must not bring its series back."""
        with self._jobs_lock:
            if job_id not in self._live_jobs:
                return _DETACHED
            self._job_series.setdefault(job_id, set()).add((counter, labels))
            return counter.labels(job_id, *labels)

    def error(self, kind: int) -> None:
        """Counts one error of the wire ErrorKind ``kind``."""
        self.errors.labels(ERROR_NAMES.get(kind, "invalid")).inc()

    def job_started(self, job_id: str) -> None:
        """A job of id ``job_id`` came (the registry calls it once per job it creates)."""
        with self._jobs_lock:
            self._live_jobs[job_id] = self._live_jobs.get(job_id, 0) + 1

    def job_ended(self, job_id: str) -> None:
        """A job of id ``job_id`` ended: once no other job has the id, its series are removed,
        so that label sets stay bounded and nobody reads a finished job's figures as running."""
        with self._jobs_lock:
            left = self._live_jobs.get(job_id, 0) - 1
            if left > 0:
                self._live_jobs[job_id] = left
                return
            self._live_jobs.pop(job_id, None)
            series = self._job_series.pop(job_id, set())
        for counter, labels in series:
            try:
                counter.remove(job_id, *labels)
            except KeyError:
                pass

    def exposition(self, visible: Callable[[str], bool] | None = None) -> bytes:
        """The Prometheus text of every metric (after reading the control regions).

        Args:
            visible: given, a series labelled with a job appears only if it says True for
                the job's id (whom ``smddpctl metrics`` may show a job to).
        """
        if visible is None:
            return generate_latest(self.registry)
        view = CollectorRegistry(auto_describe=False)
        view.register(_JobFilter(self.registry, visible))
        return generate_latest(view)


def _op_labels(kind: int, dtype_code: int) -> tuple[str, str]:
    """The op and dtype labels of an op kind and wire dtype."""
    op = KIND_NAMES.get(kind, "unknown")
    dtype = dtype_name(dtype_code) if dtype_code in WIRE_CODES and kind != pb.BARRIER else "none"
    return op, dtype


# What ``Metrics._job_child`` gives for a job that is not live: counts into nothing exported.
_DETACHED = Counter("smddp_detached", "never exported", registry=None)


class _JobFilter:
    """A collector that passes on ``source``'s metrics, less the samples of the jobs that
    ``visible`` refuses."""

    def __init__(self, source: CollectorRegistry, visible: Callable[[str], bool]) -> None:
        self._source = source
        self._visible = visible

    def collect(self) -> Iterator[Metric]:
        for metric in self._source.collect():
            kept = copy.copy(metric)
            kept.samples = [
                s for s in metric.samples if "job" not in s.labels or self._visible(s.labels["job"])
            ]
            yield kept


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
            try:
                self.drain()
            except Exception as exc:  # a scrape shows what it has rather than fail
                refusals.log(
                    log,
                    logging.WARNING,
                    "metrics drain failed",
                    "reading the control regions' counters for a scrape failed: %r",
                    exc,
                )
        return iter(())
