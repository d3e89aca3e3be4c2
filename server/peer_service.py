"""The Peer service between node daemons (gRPC), the answering side: joining a communicator,
aborting it, asking what it waits for, meeting at a rendezvous. The calling side is
``peer_control``.

Every request carries the HMAC proof of the job's token, so nobody without the token can
join, abort or inspect a job. Refusals are ``SmddpError``s; ``grpc_edge.edge`` turns them into
the call's status and counts every call by its status (``smddp_peer_calls``).
"""

from __future__ import annotations

import hmac
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from smddp.server.errors import (
    Aborted,
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    PermissionDenied,
)
from smddp.server.grpc_edge import EdgeService, edge
from smddp.server.limits import Slots
from smddp.server.peer_wire import token_proof
from smddp.server.registry import MAX_TIMEOUT_MS
from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from smddp.server.communicator import Communicator
    from smddp.server.peer_transport import CommPeers, PeerNetwork
    from smddp.server.registry import Registry

log = logging.getLogger(__name__)

TRANSPORT_NAMES: dict[int, str] = {pb.TCP: "tcp", pb.UCX: "ucx"}


def server_credentials(cert: str, key: str, ca: str) -> grpc.ServerCredentials:
    """Mutual TLS for the Peer service: callers must show a certificate of the CA."""
    return grpc.ssl_server_credentials(
        [(Path(key).read_bytes(), Path(cert).read_bytes())],
        root_certificates=Path(ca).read_bytes(),
        require_client_auth=True,
    )


class PeerService(pb_grpc.PeerServicer, EdgeService):
    """Answers other daemons about the communicators registered here."""

    def __init__(self, registry: Registry, network: PeerNetwork) -> None:
        self._registry = registry
        self._network = network  # this daemon's transport and data port
        # Each waiting Meet holds a thread of this service, so they are bounded, leaving
        # threads for Join, Abort and PeerStatus. Not with the Node service's Rendezvous calls
        # (registry.rendezvous_slots), as they once were: anyone who reaches the Peer port
        # could then hold every slot and stop this node's own jobs from meeting.
        self._meet_slots = Slots(
            "waiting Meet calls from other daemons",
            registry.config.max_pending_rendezvous,
            "--max-pending-rendezvous",
        )

    def _finished(self, method: str, code: grpc.StatusCode) -> None:
        if self._registry.metrics is not None:
            self._registry.metrics.peer_calls.labels(method, code.name).inc()

    def _comm(
        self, req: pb.PeerRequest, context: grpc.ServicerContext
    ) -> tuple[Communicator, CommPeers]:
        """The communicator ``req`` names and its peers, once its proof and node index check out.

        Raises:
            NotFound, PermissionDenied, InvalidRequest: they do not.
        """
        comm = self._registry.find_comm(req.job_id, req.comm_id, req.proof)
        if comm is None or comm.peers is None:
            raise NotFound(
                f"job {req.job_id[:64]} comm {req.comm_id[:64]} is not registered here yet"
            )
        if not hmac.compare_digest(req.proof, token_proof(comm.token, comm.job_id, comm.comm_id)):
            log.warning(
                "refused a Peer call from %s: wrong job token for job %s",
                context.peer(),
                comm.job_id,
            )
            raise PermissionDenied(f"wrong job token for job {comm.job_id}")
        peers = comm.peers
        if not 0 <= req.node < len(peers.node_ids) or req.node == peers.my_node:
            raise InvalidRequest(
                f"node index {req.node} is not a peer of this node in job {comm.job_id} comm {comm.comm_id}"  # noqa: E501
            )
        return comm, peers

    @edge()
    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        comm, peers = self._comm(request.peer, context)
        caller, me = peers.node_ids[request.peer.node], peers.node_ids[peers.my_node]
        if list(request.node_ids) != peers.node_ids:
            raise FailedPrecondition(
                f"{comm.name()}: "
                f"node {caller} lists the nodes {list(request.node_ids)} where node {me} lists {peers.node_ids}"  # noqa: E501
            )
        if request.transport != self._network.transport:
            theirs = TRANSPORT_NAMES.get(request.transport, request.transport)
            raise FailedPrecondition(
                f"node {caller} carries data over {theirs} and node {me} over {TRANSPORT_NAMES[self._network.transport]}: "  # noqa: E501
                "every daemon of a job must run the same --peer-transport"
            )
        if tuple(request.excluded_ranks) != comm.excluded:
            raise FailedPrecondition(
                f"{comm.name()}: "
                f"shrink_group on node {caller} excluded ranks {list(request.excluded_ranks)} of comm {comm.parent_comm_id} where node {me} excluded {list(comm.excluded)}: "  # noqa: E501
                "every surviving rank must exclude the same ranks"
            )
        if request.peer.node > peers.my_node:
            raise InvalidRequest(
                f"{comm.name()}: the node of lower index joins the higher, not node {caller}"
            )
        if request.exchange != self._network.exchange:
            raise FailedPrecondition(
                f"node {caller} runs {request.exchange or 'an older smddpd'} and node {me} runs {self._network.exchange}: "  # noqa: E501
                "every daemon of a job must run the same --algo and --chunk-bytes (SMDDP_ALGO, SMDDP_CHUNK_BYTES)"  # noqa: E501
            )
        failure = comm.failed()
        if failure is not None:
            raise Aborted(f"the communicator already failed on node {me}: {failure[1]}")
        return pb.JoinReply(node_id=me, data_port=self._network.data_port)

    @edge()
    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortReply:
        comm, _ = self._comm(request.peer, context)
        # The node that failed warns there; here it is news only if an op was waiting (fail()
        # then warns anyway), e.g. not when that node's ranks simply left.
        comm.fail(
            request.kind or pb.ABORTED,
            request.message[:65536],
            propagate=False,
            log_level=logging.INFO,
            failed_ranks=request.failed_ranks,
            from_node=request.peer.node,
        )
        # Already failed here (both nodes found a dead rank at once): the caller's ranks join
        # ours, and the answer gives it ours, so that both end with the same set.
        ranks = comm.merge_failed(request.peer.node, request.failed_ranks)
        return pb.AbortReply(failed_ranks=ranks)

    @edge()
    def PeerStatus(
        self, request: pb.PeerStatusRequest, context: grpc.ServicerContext
    ) -> pb.PeerStatusReply:
        comm, peers = self._comm(request.peer, context)
        return pb.PeerStatusReply(node_id=peers.node_ids[peers.my_node], comm=comm.status())

    @edge()
    def Meet(self, request: pb.MeetRequest, context: grpc.ServicerContext) -> pb.RendezvousReply:
        cfg = self._registry.config
        timeout_s = (
            min(request.timeout_ms, MAX_TIMEOUT_MS) / 1000
            if request.timeout_ms
            else cfg.default_timeout_s
        )
        # No early expiry for meetings only other daemons' ranks are in: the forwarding daemon
        # and the client do not retry a Meet, so a real job whose root node starts minutes
        # after its other nodes would fail. --max-peer-rendezvous bounds them instead.
        timeout_s = min(timeout_s, cfg.max_rendezvous_wait_s)
        with self._meet_slots.held(f"rendezvous of job {request.job_id[:64]}"):
            nodes = self._registry.rendezvous.meet(
                request.job_id, request.proof, request.rank, request.world_size, request.node_id,
                request.peer_address, timeout_s, context.is_active,
                peer_cap=cfg.max_peer_rendezvous,
            )  # fmt: skip
        return pb.RendezvousReply(nodes=nodes)
