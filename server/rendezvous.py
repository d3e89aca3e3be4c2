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

from smddp.core.wire import node_layout, rank_list
from smddp.server.errors import (
    FailedPrecondition,
    InvalidRequest,
    LimitExceeded,
    PermissionDenied,
    SmddpError,
)
from smddp.server.fields import check_node_id, check_peer_address
from smddp.v1 import smddp_pb2 as pb

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
    # A rank of this daemon's own node is in it (or was): it counts against --max-jobs, else
    # against --max-peer-rendezvous.
    local: bool
    arrivals: dict[int, tuple[str, str]] = field(
        default_factory=dict
    )  # rank -> (node id, peer address)
    layout: list[pb.NodeSpec] | None = None
    answered: int = 0
    # Set once an arrival shows the meeting cannot complete (disagreeing world sizes): every
    # rank waiting, and every rank arriving until ``failed_until``, gets it at once.
    failed: str = ""
    failed_until: float = 0.0
    # Set when a rank of this node's own came with another proof: every rank waiting in it
    # gets this (PERMISSION_DENIED), and the meeting has left the table.
    displaced: str = ""


class RendezvousTable:
    """The meetings this daemon hosts, one per job until every rank got its answer."""

    def __init__(self, max_meetings: int) -> None:
        """``max_meetings``: most meetings a rank of this node's own is in (``--max-jobs``)."""
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
        *,
        peer_cap: int | None = None,
    ) -> list[pb.NodeSpec]:
        """Waits until all ``world_size`` ranks of ``job_id`` arrived; returns the layout.

        Args:
            active: turns False when the caller has gone (its call was cancelled, say): its
                arrival is then withdrawn within half a second.
            peer_cap: None for a rank of this node's own (``Node.Rendezvous``); for an arrival
                forwarded by another daemon (``Peer.Meet``), the most meetings that no rank of
                this node's own is in (``--max-peer-rendezvous``).

        Raises:
            InvalidRequest, PermissionDenied, FailedPrecondition, LimitExceeded: a bad arrival,
            a caller gone or a daemon stopping; RendezvousTimeout: ranks missing after
            ``timeout_s`` (this rank's arrival is withdrawn).
        """
        where = f"rendezvous of job {job_id[:64]}"
        if world_size > MAX_WORLD:
            raise InvalidRequest(
                f"{where}: "
                f"the daemons' rendezvous serves jobs of up to {MAX_WORLD} ranks; "
                "a larger job passes its node layout to Register itself (as torch jobs do from their store)"  # noqa: E501
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
            local = peer_cap is None
            if meeting is not None and not hmac.compare_digest(meeting.proof, proof):
                if meeting.local or not local:
                    raise PermissionDenied(f"{where}: rank {rank} has the wrong job token")
                # Only other daemons' ranks are in it, and whoever reaches the Peer port can
                # make those up: this node's own rank (it came through the unix socket) wins.
                self._displace(job_id, meeting, where, rank, node_id)
                meeting = None
            if meeting is not None and meeting.failed:
                raise FailedPrecondition(meeting.failed)
            if meeting is None or (local and not meeting.local):
                self._check_room(where, rank, node_id, peer_cap)
            if meeting is None:
                meeting = self._meetings[job_id] = _Meeting(world_size, proof, local)
            meeting.local = meeting.local or local
            if meeting.world_size != world_size:
                meeting.failed = (
                    f"{where}: "
                    f"rank {rank} says the world size is {world_size}, earlier ranks said {meeting.world_size}: "  # noqa: E501
                    "the ranks of one job must agree on it"
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
                        f"{where}: "
                        f"two daemons claim node id {node_id}: "
                        f"{other_address} (rank {other}) and {peer_address} (rank {rank}); "
                        "give each node its own --node-id"
                    )
            meeting.arrivals[rank] = (node_id, peer_address)
            if len(meeting.arrivals) == world_size:
                nodes = [meeting.arrivals[r][0] for r in range(world_size)]
                meeting.layout = node_layout(nodes, {n: a for n, a in meeting.arrivals.values()})
                self._cond.notify_all()
            while meeting.layout is None:
                if meeting.displaced:
                    del meeting.arrivals[rank]
                    raise PermissionDenied(meeting.displaced)
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
                        self._forget(job_id, meeting)
                    if gone:
                        raise FailedPrecondition(f"{where}: {gone}")
                    missing = [
                        r for r in range(world_size) if r not in meeting.arrivals and r != rank
                    ]
                    raise RendezvousTimeout(
                        f"{where}: "
                        f"{rank_list(missing)} did not arrive within {timeout_s:.0f} s ({len(meeting.arrivals) + 1} of {world_size} ranks came)"  # noqa: E501
                    )
                self._cond.wait(min(remaining, 0.5))
            meeting.answered += 1
            if meeting.answered == world_size:
                self._forget(job_id, meeting)
            return list(meeting.layout)

    def _check_room(self, where: str, rank: int, node_id: str, peer_cap: int | None) -> None:
        """Refuses an arrival that would open (or, a rank of this node's own, adopt) a
        meeting beyond its kind's cap (lock held).

        Raises:
            LimitExceeded: the cap is reached.
        """
        if peer_cap is None:
            held = sum(1 for m in self._meetings.values() if m.local)
            if held >= self._max:
                raise LimitExceeded(
                    f"{where}: "
                    f"this daemon already hosts {held} rendezvous of its own ranks (--max-jobs {self._max})"  # noqa: E501
                )
            return
        held = sum(1 for m in self._meetings.values() if not m.local)
        if held >= peer_cap:
            raise LimitExceeded(
                f"{where}: "
                f"rank {rank} from node {node_id}: "
                f"this daemon already hosts {held} rendezvous that only other daemons' ranks are in (--max-peer-rendezvous {peer_cap}); "  # noqa: E501
                "its own ranks' rendezvous are not affected"
            )

    def _displace(self, job_id: str, meeting: _Meeting, where: str, rank: int, node: str) -> None:
        """Ends a meeting only other daemons' ranks are in, for a rank of this node's own that
        came with another proof (lock held): the ranks waiting in it are told why."""
        meeting.displaced = (
            f"{where}: "
            f"rank {rank} on the root's own node {node} came with another job token than {rank_list(sorted(meeting.arrivals))} from other nodes; "  # noqa: E501
            "the root's own ranks win, so those have the wrong job token"
        )
        self._forget(job_id, meeting)
        self._cond.notify_all()

    def _forget(self, job_id: str, meeting: _Meeting) -> None:
        """Drops ``meeting`` from the table, unless another meeting of the job replaced it
        (lock held)."""
        if self._meetings.get(job_id) is meeting:
            del self._meetings[job_id]
