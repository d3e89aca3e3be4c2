"""The daemon's own rendezvous, for jobs that have no store (non-torch clients).

Every rank of a job asks its node's daemon (``Node.Rendezvous``), naming one daemon of the job
as the root; the daemons forward to the root's Peer service (``Peer.Meet``), adding their own
node id and peer address. The root holds a meeting per job until every rank arrived, then
answers each with the job's node layout (nodes ordered by lowest rank, as torch jobs compute it
from their store), which the ranks pass to Register. The job's token never leaves a node: the
daemons forward an HMAC proof of it, and the first rank to arrive sets the proof the others
must match.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from smddp.server.errors import (
    FailedPrecondition,
    InvalidRequest,
    LimitExceeded,
    PermissionDenied,
    SmddpError,
)
from smddp.server.fields import check_node_id, check_peer_address
from smddp.v1 import smddp_pb2 as pb
from smddp.wire import node_layout, rank_list

# Every rank of a rendezvous holds a gRPC thread of the root's daemon until all arrived (its
# Node and Peer services have 256 each), so the rendezvous serves jobs below that; larger jobs
# pass their node layout to Register themselves, as torch jobs do from their store.
MAX_WORLD = 200


class RendezvousTimeout(SmddpError):
    """Not every rank of the job arrived at the rendezvous in time."""

    kind = pb.TIMEOUT
    code = grpc.StatusCode.DEADLINE_EXCEEDED


def rendezvous_proof(token: bytes, job_id: str) -> bytes:
    """What a daemon forwards to the root instead of the job's token."""
    return hmac.new(token, f"smddp-rendezvous-v1/{job_id}".encode(), hashlib.sha256).digest()


@dataclass
class _Meeting:
    world_size: int
    proof: bytes
    arrivals: dict[int, tuple[str, str]] = field(
        default_factory=dict
    )  # rank -> (node id, peer address)
    layout: list[pb.NodeSpec] | None = None
    answered: int = 0
    # Set once an arrival shows the meeting cannot complete (disagreeing world sizes): every
    # rank waiting, and every rank arriving until ``failed_until``, gets it at once.
    failed: str = ""
    failed_until: float = 0.0


class RendezvousTable:
    """The meetings this daemon hosts, one per job until every rank got its answer."""

    def __init__(self, max_meetings: int) -> None:
        self._max = max_meetings
        self._meetings: dict[str, _Meeting] = {}
        self._cond = threading.Condition()
        self._stopped: str | None = None

    def shutdown(self, reason: str) -> None:
        """Ends every wait with ``reason`` (the daemon is stopping) and refuses new arrivals."""
        with self._cond:
            self._stopped = reason
            self._cond.notify_all()

    def meet(
        self,
        job_id: str,
        proof: bytes,
        rank: int,
        world_size: int,
        node_id: str,
        peer_address: str,
        timeout_s: float,
        active: Callable[[], bool] = lambda: True,
    ) -> list[pb.NodeSpec]:
        """Waits until all ``world_size`` ranks of ``job_id`` arrived; returns the layout.

        Args:
            active: turns False when the caller has gone (its call was cancelled, say): its
                arrival is then withdrawn within half a second.

        Raises:
            InvalidRequest, PermissionDenied, FailedPrecondition, LimitExceeded: a bad arrival,
            a caller gone or a daemon stopping; RendezvousTimeout: ranks missing after
            ``timeout_s`` (this rank's arrival is withdrawn).
        """
        where = f"rendezvous of job {job_id[:64]}"
        if world_size > MAX_WORLD:
            raise InvalidRequest(
                f"{where}: the daemons' rendezvous serves jobs of up to {MAX_WORLD} ranks; a "
                "larger job "
                "passes its node layout to Register itself (as torch jobs do from their store)"
            )
        if not job_id or not world_size > 0 or rank >= world_size:
            raise InvalidRequest(
                f"{where}: rank {rank} of world size {world_size} is not a rank of a job"
            )
        if not node_id or not peer_address:
            raise InvalidRequest(f"{where}: rank {rank} arrived without a node id and peer address")
        check_node_id(where, "node_id", node_id)
        check_peer_address(where, "peer_address", peer_address)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self._stopped is not None:
                raise FailedPrecondition(f"{where}: {self._stopped}")
            meeting = self._meetings.get(job_id)
            now = time.monotonic()
            for stale in [
                j for j, m in self._meetings.items() if m.failed and m.failed_until <= now
            ]:
                if stale == job_id:
                    meeting = None
                del self._meetings[stale]
            if meeting is not None and meeting.failed:
                raise FailedPrecondition(meeting.failed)
            if meeting is None:
                if len(self._meetings) >= self._max:
                    raise LimitExceeded(
                        f"{where}: this daemon already hosts {self._max} rendezvous (--max-jobs)"
                    )
                meeting = self._meetings[job_id] = _Meeting(world_size, proof)
            if not hmac.compare_digest(meeting.proof, proof):
                raise PermissionDenied(f"{where}: rank {rank} has the wrong job token")
            if meeting.world_size != world_size:
                meeting.failed = (
                    f"{where}: rank {rank} says the world size is {world_size}, earlier ranks said "
                    f"{meeting.world_size}: the ranks of one job must agree on it"
                )
                meeting.failed_until = now + timeout_s
                self._cond.notify_all()  # the ranks already waiting cannot meet either
                raise FailedPrecondition(meeting.failed)
            if rank in meeting.arrivals or meeting.layout is not None:
                raise FailedPrecondition(
                    f"{where}: rank {rank} arrived twice (from node {node_id})"
                )
            for other, (other_node, other_address) in meeting.arrivals.items():
                if other_node == node_id and other_address != peer_address:
                    raise FailedPrecondition(
                        f"{where}: two daemons claim node id {node_id}: {other_address} (rank "
                        f"{other}) and "
                        f"{peer_address} (rank {rank}); give each node its own --node-id"
                    )
            meeting.arrivals[rank] = (node_id, peer_address)
            if len(meeting.arrivals) == world_size:
                nodes = [meeting.arrivals[r][0] for r in range(world_size)]
                meeting.layout = node_layout(nodes, {n: a for n, a in meeting.arrivals.values()})
                self._cond.notify_all()
            while meeting.layout is None:
                if meeting.failed:
                    del meeting.arrivals[rank]
                    raise FailedPrecondition(meeting.failed)
                remaining = deadline - time.monotonic()
                gone = self._stopped or (
                    None
                    if active()
                    else f"rank {rank}'s call was cancelled (its process went away)"
                )
                if remaining <= 0 or gone:
                    del meeting.arrivals[rank]
                    if not meeting.arrivals:
                        self._meetings.pop(job_id, None)
                    if gone:
                        raise FailedPrecondition(f"{where}: {gone}")
                    missing = [
                        r for r in range(world_size) if r not in meeting.arrivals and r != rank
                    ]
                    raise RendezvousTimeout(
                        f"{where}: {rank_list(missing)} did not arrive within {timeout_s:.0f} s "
                        f"({len(meeting.arrivals) + 1} of {world_size} ranks came)"
                    )
                self._cond.wait(min(remaining, 0.5))
            meeting.answered += 1
            if meeting.answered == world_size:
                self._meetings.pop(job_id, None)
            return list(meeting.layout)
