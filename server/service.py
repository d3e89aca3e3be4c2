"""The gRPC edge of the daemon: the Node service. Proto in, domain calls, proto out."""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Iterator
from typing import cast

import grpc

from smddp.server import __version__
from smddp.server.communicator import AGREE_SLICE_S, Session
from smddp.server.domain import Registration
from smddp.server.errors import LimitExceeded, PermissionDenied, SmddpError
from smddp.server.grpc_edge import EdgeService, edge
from smddp.server.limits import Slots
from smddp.server.logthrottle import refusals
from smddp.server.registry import Registry
from smddp.server.topology import local_devices
from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class StreamChannel:
    """Replies to one rank over its gRPC Ops stream."""

    def __init__(self) -> None:
        self.queue: queue.Queue[pb.OpReply | None] = queue.Queue()

    def send_reply(self, reply: pb.OpReply) -> None:
        self.queue.put(reply)


class NodeService(pb_grpc.NodeServicer, EdgeService):
    """Registration, the op stream, deregistration and status for local ranks."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        # Each Ops stream holds a gRPC thread for its life: bounded, so that they cannot take
        # the threads that Register, Status and health need.
        self._streams = Slots(
            "gRPC Ops streams", registry.config.max_op_streams, "--max-op-streams"
        )

    def _refused(self, what: str, exc: SmddpError) -> None:
        """Counts a refused call by its error kind and logs it (rate-limited per cause)."""
        if self._registry.metrics is not None:
            self._registry.metrics.error(exc.kind)
        refusals.log(
            log, logging.INFO, f"{what} refused ({exc.code.name})", "refused a %s: %s", what, exc
        )

    @edge()
    def Register(
        self, request: pb.RegisterRequest, context: grpc.ServicerContext
    ) -> pb.RegisterReply:
        session = self._registry.register(Registration.from_proto(request))
        return pb.RegisterReply(
            session_id=session.session_id,
            session_secret=session.secret,
            chunk_bytes=session.comm.chunk_bytes,
            daemon_node_id=self._registry.config.node_id,
            daemon_version=__version__,
            node_region=True,
        )

    @edge("Ops stream")
    def Ops(
        self, request_iterator: Iterator[pb.OpRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.OpReply]:
        # A stream holds its gRPC thread from its first moment, so it takes its slot before
        # it has said who it is: streams that never speak cannot take the threads of
        # Register, Status and health. (No deadline for the first message: a rank sends it
        # with its first op through the daemon, which may come much later or never.)
        with self._streams.held("an Ops stream"):
            try:
                first = next(request_iterator)
            except StopIteration:
                return
            session = self._registry.authenticate(first.session_id, first.session_secret)
            yield from self._serve_stream(session, first, request_iterator)

    def _serve_stream(
        self, session: Session, first: pb.OpRequest, request_iterator: Iterator[pb.OpRequest]
    ) -> Iterator[pb.OpReply]:
        channel = StreamChannel()
        session.channel = channel

        def read() -> None:
            detail = "the Ops stream ended"
            try:
                session.comm.submit(session, first)
                for req in request_iterator:
                    session.comm.submit(session, req)
            except grpc.RpcError as exc:
                detail = f"the Ops stream broke: {exc}"
            except Exception as exc:  # keep serving others whatever one stream does
                detail = f"the Ops stream failed: {exc!r}"
            finally:
                if not session.closed:
                    self._registry.connection_lost(session, detail)
                channel.queue.put(None)

        threading.Thread(target=read, name="smddp-ops-stream", daemon=True).start()
        while True:
            reply = channel.queue.get()
            if reply is None:
                return
            yield reply

    @edge()
    def Deregister(
        self, request: pb.DeregisterRequest, context: grpc.ServicerContext
    ) -> pb.DeregisterReply:
        session = self._registry.authenticate(request.session_id, request.session_secret)
        self._registry.deregister(session, request.shrink[:4096], request.reason[:4096])
        return pb.DeregisterReply()

    @edge()
    def Failure(self, request: pb.FailureRequest, context: grpc.ServicerContext) -> pb.FailureReply:
        session = self._registry.authenticate(request.session_id, request.session_secret)
        comm = session.comm
        wait_s = min(request.wait_ms / 1000, AGREE_SLICE_S) if request.wait_ms else AGREE_SLICE_S
        if not session.asking_failure.acquire(blocking=False):
            raise LimitExceeded(
                f"{comm.name()}: {session.label()} asked for the communicator's failure while its previous Failure call was still waiting; ask once at a time"  # noqa: E501
            )
        try:
            record = comm.failure_record(wait_s)
        finally:
            session.asking_failure.release()
        if record is None:
            return pb.FailureReply(failed=False, generation=comm.generation)
        kind, message, ranks, agreed = record
        # cast: protoc's stubs type an enum field as its enum class alone; an int is what it holds.
        return pb.FailureReply(
            failed=True,
            kind=cast("pb.ErrorKind", kind),
            message=message,
            failed_ranks=ranks,
            generation=comm.generation,
            agreed=agreed,
        )

    @edge()
    def Revoke(self, request: pb.RevokeRequest, context: grpc.ServicerContext) -> pb.RevokeReply:
        session = self._registry.authenticate(request.session_id, request.session_secret)
        comm = session.comm
        reason = request.reason[:4096] or "a rank revoked the communicator"
        comm.fail(pb.ABORTED, f"{comm.name()}: {session.label()}: {reason}", culprit=session)
        return pb.RevokeReply()

    # gRPC on a unix socket does not tell who calls. Without --socket-group only the daemon's
    # own uid and root can reach the socket, so a caller may see every job; with it, users of
    # the group can too, so Status is refused and Metrics leaves out every job's series:
    # smddpctl asks over the data socket instead, where the kernel names the caller's uid and
    # the daemon shows them their own jobs (data_socket.DataSocketServer._answer_query).

    @edge()
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        config = self._registry.config
        if config.socket_group:
            raise PermissionDenied(
                f"smddpd on node {config.node_id} answers Status over gRPC only when its socket is its own user's (no --socket-group; it is {config.socket_group}'s): "  # noqa: E501
                "gRPC does not tell who calls, so it cannot show a user their own jobs only; "
                "smddpctl status asks over the data socket, where the kernel names the caller"
            )
        return self._registry.status(__version__)

    @edge()
    def Metrics(self, request: pb.MetricsRequest, context: grpc.ServicerContext) -> pb.MetricsReply:
        metrics = self._registry.metrics
        if metrics is None:
            return pb.MetricsReply()
        anyone = self._registry.config.socket_group != ""
        text = metrics.exposition((lambda job_id: False) if anyone else None)
        return pb.MetricsReply(exposition=text.decode())

    @edge()
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoReply:
        network = self._registry.network
        return pb.InfoReply(
            node_id=self._registry.config.node_id,
            peer_address=self._registry.peer_address,
            version=__version__,
            peer_transport=network.transport if network is not None else pb.TRANSPORT_UNSPECIFIED,
            data_port=network.data_port if network is not None else 0,
        )

    @edge()
    def Rendezvous(
        self, request: pb.RendezvousRequest, context: grpc.ServicerContext
    ) -> pb.RendezvousReply:
        nodes = self._registry.meet(request, context.is_active)
        return pb.RendezvousReply(nodes=nodes)

    @edge()
    def Topology(
        self, request: pb.TopologyRequest, context: grpc.ServicerContext
    ) -> pb.TopologyReply:
        network = self._registry.network
        reply = pb.TopologyReply(
            node_id=self._registry.config.node_id,
            peer_address=self._registry.peer_address,
            cpu_count=os.cpu_count() or 1,
            devices=local_devices(),
            peer_transport=network.transport if network is not None else pb.TRANSPORT_UNSPECIFIED,
            data_port=network.data_port if network is not None else 0,
        )
        for comm in self._registry.comms():
            layout = reply.jobs.add(
                job_id=comm.job_id, comm_id=comm.comm_id, local_ranks=comm.local_ranks
            )
            ids = comm.peers.node_ids if comm.peers else [self._registry.config.node_id]
            addrs = comm.peers.addresses if comm.peers else [self._registry.peer_address]
            for node_id, addr, ranks in zip(ids, addrs, comm.nodes):
                layout.nodes.add(node_id=node_id, peer_address=addr, ranks=ranks)
        return reply
