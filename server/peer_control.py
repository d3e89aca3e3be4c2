"""The Peer service between node daemons (gRPC): joining a communicator, aborting it, asking
another node what it waits for. Both ends live here: ``PeerService`` answers other daemons,
``PeerControl`` calls them.

Control only: the bytes of a collective travel on the data connections whose port Join
returns (``peer_transport``). Every request carries the HMAC proof of the job's token, so
nobody without the token can join, abort or inspect a job. With ``--tls-cert`` the service
runs over mutual TLS, and a caller checks that the callee's certificate names the node id the
job's layout gives for that address.
"""

from __future__ import annotations

import functools
import hmac
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from smddp.server.errors import SmddpError
from smddp.server.peer_transport import token_proof
from smddp.server.registry import MAX_TIMEOUT_MS
from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from smddp.server.communicator import Communicator
    from smddp.server.peer_transport import PeerNetwork
    from smddp.server.registry import Registry

log = logging.getLogger(__name__)

TRANSPORT_NAMES = {pb.TCP: "tcp", pb.UCX: "ucx"}


def server_credentials(cert: str, key: str, ca: str) -> grpc.ServerCredentials:
    """Mutual TLS for the Peer service: callers must show a certificate of the CA."""
    return grpc.ssl_server_credentials(
        [(Path(key).read_bytes(), Path(cert).read_bytes())],
        root_certificates=Path(ca).read_bytes(),
        require_client_auth=True,
    )


def _counted(method: Callable) -> Callable:
    """Counts each call of a Peer method by its gRPC status (``smddp_peer_calls``)."""

    @functools.wraps(method)
    def counted(self: PeerService, request: object, context: grpc.ServicerContext) -> object:
        try:
            reply = method(self, request, context)
        except BaseException:
            self._count(method.__name__, context.code() or grpc.StatusCode.UNKNOWN)
            raise
        self._count(method.__name__, grpc.StatusCode.OK)
        return reply

    return counted


class PeerService(pb_grpc.PeerServicer):
    """Answers other daemons about the communicators registered here."""

    def __init__(self, registry: Registry, network: PeerNetwork) -> None:
        self._registry = registry
        self._network = network  # this daemon's transport and data port

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        if self._registry.metrics is not None:
            self._registry.metrics.peer_calls.labels(method, code.name).inc()

    def _comm(self, req: pb.PeerRequest, context: grpc.ServicerContext) -> Communicator:
        """The communicator ``req`` names, once its proof and node index check out."""
        comm = self._registry.find_comm(req.job_id, req.comm_id, req.proof)
        if comm is None or comm.peers is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"job {req.job_id[:64]} comm {req.comm_id[:64]} is not registered here yet")
        if not hmac.compare_digest(req.proof, token_proof(comm.token, comm.job_id, comm.comm_id)):
            log.warning("refused a Peer call from %s: wrong job token for job %s", context.peer(), comm.job_id)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"wrong job token for job {comm.job_id}")
        if not 0 <= req.node < len(comm.peers.node_ids) or req.node == comm.peers.my_node:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"node index {req.node} is not a peer of this node in job {comm.job_id} comm {comm.comm_id}",
            )
        return comm

    @_counted
    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        comm = self._comm(request.peer, context)
        peers = comm.peers
        assert peers is not None
        caller = peers.node_ids[request.peer.node]
        if list(request.node_ids) != peers.node_ids:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{comm.name()}: node {caller} lists the nodes {list(request.node_ids)} where node "
                f"{peers.node_ids[peers.my_node]} lists {peers.node_ids}",
            )
        if request.transport != self._network.transport:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {caller} carries data over {TRANSPORT_NAMES.get(request.transport, request.transport)} "
                f"and node {peers.node_ids[peers.my_node]} over {TRANSPORT_NAMES[self._network.transport]}: every daemon "
                "of a job must run the same --peer-transport",
            )
        if request.peer.node > peers.my_node:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{comm.name()}: the node of lower index joins the higher, not node {caller}")
        failure = comm.failed()
        if failure is not None:
            context.abort(grpc.StatusCode.ABORTED, f"the communicator already failed on node {peers.node_ids[peers.my_node]}: {failure[1]}")
        return pb.JoinReply(node_id=peers.node_ids[peers.my_node], data_port=self._network.data_port)

    @_counted
    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortReply:
        comm = self._comm(request.peer, context)
        # The node that failed warns there; here it is news only if an op was waiting (fail()
        # then warns anyway), e.g. not when that node's ranks simply left.
        comm.fail(request.kind or pb.ABORTED, request.message[:65536], propagate=False, log_level=logging.INFO)
        return pb.AbortReply()

    @_counted
    def PeerStatus(self, request: pb.PeerStatusRequest, context: grpc.ServicerContext) -> pb.PeerStatusReply:
        comm = self._comm(request.peer, context)
        assert comm.peers is not None
        return pb.PeerStatusReply(node_id=comm.peers.node_ids[comm.peers.my_node], comm=comm.status())

    @_counted
    def Meet(self, request: pb.MeetRequest, context: grpc.ServicerContext) -> pb.RendezvousReply:
        cfg = self._registry.config
        timeout_s = min(request.timeout_ms, MAX_TIMEOUT_MS) / 1000 if request.timeout_ms else cfg.default_timeout_s
        timeout_s = min(timeout_s, cfg.max_rendezvous_wait_s)
        try:
            # Each waiting Meet holds a thread of this service: bounded with the Node
            # service's Rendezvous calls, so that neither can take every thread.
            with self._registry.rendezvous_slots.held(f"rendezvous of job {request.job_id[:64]}"):
                nodes = self._registry.rendezvous.meet(
                    request.job_id, request.proof, request.rank, request.world_size, request.node_id,
                    request.peer_address, timeout_s, context.is_active,
                )
        except SmddpError as exc:
            context.abort(exc.code, str(exc))
        return pb.RendezvousReply(nodes=nodes)


class PeerControl:
    """Channels to other daemons' Peer services, one per (address, node id), shared by every
    communicator of this daemon."""

    def __init__(self, tls_files: tuple[str, str, str] | None = None) -> None:
        self._credentials = None
        if tls_files is not None:
            cert, key, ca = tls_files
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=Path(ca).read_bytes(),
                private_key=Path(key).read_bytes(),
                certificate_chain=Path(cert).read_bytes(),
            )
        self._channels: dict[tuple[str, str], grpc.Channel] = {}
        self._lock = threading.Lock()

    def stub(self, address: str, node_id: str) -> pb_grpc.PeerStub:
        """The Peer stub of the daemon at ``address``, which must be node ``node_id``."""
        key = (address, node_id)
        with self._lock:
            channel = self._channels.get(key)
            if channel is None:
                if self._credentials is None:
                    channel = grpc.insecure_channel(address)
                else:
                    # The certificate must name the node the layout puts at this address.
                    channel = grpc.secure_channel(
                        address, self._credentials, options=[("grpc.ssl_target_name_override", node_id)]
                    )
                self._channels[key] = channel
        return pb_grpc.PeerStub(channel)

    def close(self) -> None:
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            channel.close()
