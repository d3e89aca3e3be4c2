"""Finding the node's daemon: its socket, what it says about itself, a job's rendezvous.

Starting a private daemon where none answers is ``embedded``'s; this module only looks.
"""

from __future__ import annotations

import os

import grpc

from smddp.client.config import ENV_SOCKET, ClientConfig
from smddp.client.errors import ConnectError
from smddp.client.session import grpc_channel
from smddp.core.wire import SYSTEM_SOCKET, user_socket_path
from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc


def candidates(config: ClientConfig) -> list[str]:
    """Where a client looks for a daemon: the configured socket alone, else both defaults."""
    return [config.socket] if config.socket else [SYSTEM_SOCKET, user_socket_path()]


def daemon_socket(socket_path: str | None, config: ClientConfig) -> str:
    """``socket_path``, else the first of ``config``'s candidates that exists.

    Raises:
        ConnectError: none exists.
    """
    paths = [socket_path] if socket_path else candidates(config)
    path = next((p for p in paths if os.path.exists(p)), None)
    if path is None:
        raise ConnectError(
            f"no smddpd socket found (looked at {', '.join(paths)}); "
            f"start smddpd or set {ENV_SOCKET}"
        )
    return path


def rendezvous(
    job_id: str,
    job_token: bytes,
    rank: int,
    world_size: int,
    root: str = "",
    root_node_id: str = "",
    socket_path: str | None = None,
    timeout_s: float = 300.0,
    config: ClientConfig | None = None,
) -> list[pb.NodeSpec]:
    """Meets every rank of a job through the node daemons; returns the job's node layout.

    For jobs without a store of their own: every rank calls this with the same ``root``, the
    peer address (``HOST:PORT``, what ``smddpctl topology`` shows) of one daemon of the job,
    and passes the result to ``connect(..., nodes=...)``.

    Args:
        root: the daemon that hosts the meeting; "" for this node's (a one-node job, or the
            ranks on the root's own node).
        root_node_id: that daemon's node id; needed where daemons use TLS (its certificate
            must name it).
        timeout_s: how long to wait for the other ranks.
        config: the client's configuration (default: from the environment).

    Raises:
        ConnectError: no daemon answered, or the rendezvous failed (a wrong token, ranks
            missing at the timeout, ...); the message says which.
    """
    path = daemon_socket(socket_path, config or ClientConfig.from_env())
    request = pb.RendezvousRequest(
        job_id=job_id,
        job_token=job_token,
        rank=rank,
        world_size=world_size,
        root=root,
        root_node_id=root_node_id,
        timeout_ms=int(timeout_s * 1000),
    )
    stub = pb_grpc.NodeStub(grpc_channel(path))
    try:
        return list(stub.Rendezvous(request, timeout=timeout_s + 30).nodes)
    except grpc.RpcError as exc:
        raise ConnectError(
            f"smddpd at {path}: rank {rank}: {exc.details() or exc.code()}"
        ) from None


def daemon_info(socket_path: str) -> pb.InfoReply:
    """The node id and peer address of the daemon at ``socket_path``.

    Raises:
        ConnectError: the daemon does not answer.
    """
    try:
        reply: pb.InfoReply = pb_grpc.NodeStub(grpc_channel(socket_path)).Info(
            pb.InfoRequest(), timeout=10
        )
    except grpc.RpcError as exc:
        raise ConnectError(
            f"smddpd at {socket_path} does not answer: {exc.details() or exc.code()}"
        ) from None
    return reply
