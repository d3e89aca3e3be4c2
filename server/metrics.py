"""Prometheus metrics of the daemon, on a registry of its own.

Label sets stay bounded: op kind, dtype, error kind, and (for stragglers) job and rank,
whose series are removed when the job ends. No label carries an op sequence number.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from smddp.v1 import smddp_pb2 as pb
from smddp.wire import KIND_NAMES, NUMPY_DTYPES, dtype_name

if TYPE_CHECKING:
    from smddp.server.communicator import Communicator
    from smddp.server.registry import Registry

# The *_created series double the output and say nothing a scrape's timestamps don't.
disable_created_metrics()

_LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ERROR_NAMES = {v.number: v.name.lower() for v in pb.ErrorKind.DESCRIPTOR.values}


class Metrics:
    """Every metric smddpd exports; the communicator reports into it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ops = Counter("smddp_ops", "Collective and point-to-point ops completed", ["op", "dtype"], registry=r)
        self.bytes = Counter("smddp_op_bytes", "Bytes contributed by each rank, summed over ranks", ["op", "dtype"], registry=r)
        self.duration = Histogram(
            "smddp_op_duration_seconds", "Time from the first rank's arrival to completion of an op",
            ["op", "dtype"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.skew = Histogram(
            "smddp_arrival_skew_seconds", "Time from the first to the last rank's arrival at an op",
            ["op"], buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.straggler = Counter(
            "smddp_straggler", "Ops at which this rank arrived last (with more than one rank)", ["job", "rank"], registry=r
        )
        self.errors = Counter("smddp_errors", "Failed communicators and refused requests by kind", ["kind"], registry=r)
        self.registered_ranks = Gauge("smddp_registered_ranks", "Ranks registered with this daemon", registry=r)
        self.jobs = Gauge("smddp_active_jobs", "Jobs with at least one registered rank", registry=r)
        self.shm_bytes = Gauge("smddp_shm_bytes", "Bytes of shared-memory arenas mapped by the daemon", registry=r)
        self.peer_bytes_sent = Counter("smddp_peer_bytes_sent", "Bytes sent to peer daemons", ["peer"], registry=r)
        self.peer_bytes_received = Counter("smddp_peer_bytes_received", "Bytes received from peer daemons", ["peer"], registry=r)
        self.peer_errors = Counter("smddp_peer_connection_errors", "Failed connections to peer daemons", ["peer"], registry=r)
        self.peer_calls = Counter(
            "smddp_peer_calls", "Calls of other daemons that this daemon's Peer service answered, by status",
            ["method", "code"], registry=r,
        )
        # Pre-create the error series so that dashboards see zeros, not absences.
        for name in ERROR_NAMES.values():
            if name != "error_kind_unspecified":
                self.errors.labels(name)
        self._job_ranks: dict[str, set[str]] = {}
        self._children: dict[tuple[int, int], tuple] = {}

    def watch(self, registry: Registry) -> None:
        """Makes the gauges read the registry's tables at scrape time."""
        self.registered_ranks.set_function(registry.session_count)
        self.jobs.set_function(registry.job_count)
        self.shm_bytes.set_function(lambda: sum(s.arena.nbytes for s in registry.sessions() if s.arena))

    def op_done(self, comm: Communicator, req: pb.OpRequest, duration: float, last_rank: int, skew: float, nbytes: int) -> None:
        """Records one completed op (called once per op, at its last chunk)."""
        key = (req.kind, req.dtype)
        children = self._children.get(key)
        if children is None:  # labels() costs microseconds per call: resolve once per op and dtype
            op = KIND_NAMES.get(req.kind, "unknown")
            dtype = dtype_name(req.dtype) if req.dtype in NUMPY_DTYPES else "none"
            children = (
                self.ops.labels(op, dtype),
                self.bytes.labels(op, dtype),
                self.duration.labels(op, dtype),
                self.skew.labels(op),
            )
            self._children[key] = children
        ops, nbytes_counter, durations, skews = children
        ops.inc()
        nbytes_counter.inc(nbytes)
        durations.observe(duration)
        skews.observe(skew)
        if comm.world_size > 1 and req.kind not in (pb.SEND, pb.RECV):
            self.straggler.labels(comm.job_id, str(last_rank)).inc()
            self._job_ranks.setdefault(comm.job_id, set()).add(str(last_rank))

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
