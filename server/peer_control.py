"""Calls to other daemons' Peer services (gRPC): Join, Abort, PeerStatus and Meet.

Control only: the bytes of a collective travel on the data connections whose port Join
returns (``peer_transport``). Every request carries the HMAC proof of the job's token
(``peer_wire.token_proof``). With ``--tls-cert`` the channels run over mutual TLS, and a
caller checks that the callee's certificate names the node id the job's layout gives for
that address. The answering side is ``peer_service``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import grpc

from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc


class PeerControl:
    """Channels to other daemons' Peer services, one per (address, node id), shared by every
    communicator of this daemon, and the calls made on them."""

    def __init__(self, tls_files: tuple[str, str, str] | None = None) -> None:
        self._credentials: grpc.ChannelCredentials | None = None
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
                        address,
                        self._credentials,
                        options=[("grpc.ssl_target_name_override", node_id)],
                    )
                self._channels[key] = channel
        return pb_grpc.PeerStub(channel)

    def join(
        self,
        address: str,
        node_id: str,
        peer: pb.PeerRequest,
        node_ids: list[str],
        transport: pb.Transport,
        exchange: str,
        timeout: float,
        excluded_ranks: Sequence[int] = (),
    ) -> int:
        """Asks node ``node_id`` to let this node join the communicator; its data port.

        Args:
            excluded_ranks: for a communicator made by shrink_group, the parent's ranks left
                out, which the callee compares with its own.

        Raises:
            grpc.RpcError: it refused, or did not answer within ``timeout`` seconds.
        """
        request = pb.JoinRequest(
            peer=peer,
            node_ids=node_ids,
            transport=transport,
            excluded_ranks=excluded_ranks,
            exchange=exchange,
        )
        reply: pb.JoinReply = self.stub(address, node_id).Join(request, timeout=timeout)
        return reply.data_port

    def abort(
        self,
        address: str,
        node_id: str,
        peer: pb.PeerRequest,
        kind: int,
        message: str,
        timeout: float,
        failed_ranks: Sequence[int] = (),
    ) -> tuple[int, ...]:
        """Tells node ``node_id`` that the communicator failed, with ``kind``, ``message`` and
        the ranks this node holds failed; returns the ranks that node holds failed after it.

        Raises:
            grpc.RpcError: it did not take the news.
        """
        # cast: protoc's stubs type an enum field as its enum class alone; an int is what it holds.
        request = pb.AbortRequest(
            peer=peer,
            kind=cast("pb.ErrorKind", kind),
            message=message[:65536],
            failed_ranks=failed_ranks,
        )
        reply: pb.AbortReply = self.stub(address, node_id).Abort(request, timeout=timeout)
        return tuple(reply.failed_ranks)

    def status(
        self, address: str, node_id: str, peer: pb.PeerRequest, timeout: float
    ) -> pb.CommStatus:
        """What the communicator waits for on node ``node_id``.

        Raises:
            grpc.RpcError: it did not answer.
        """
        reply: pb.PeerStatusReply = self.stub(address, node_id).PeerStatus(
            pb.PeerStatusRequest(peer=peer), timeout=timeout
        )
        return reply.comm

    def meet_future(
        self, address: str, node_id: str, request: pb.MeetRequest, timeout: float
    ) -> grpc.Future[pb.RendezvousReply]:
        """Starts a Meet call at the rendezvous root ``address``; the call's future."""
        return self.stub(address, node_id).Meet.future(request, timeout=timeout)

    def close(self) -> None:
        """Closes every channel."""
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            channel.close()
