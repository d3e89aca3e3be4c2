"""One rank's connection to its node daemon: registration, arena attach, op channel.

Ops travel on the data socket by default (``ClientConfig.op_channel``, ``SMDDP_OP_CHANNEL``:
``socket``); the gRPC Ops stream (``grpc``) carries the same messages where a plain socket is
unwelcome.
"""

from __future__ import annotations

import atexit
import mmap
import os
import queue
import select
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np

from smddp.client.arena import ClientArena
from smddp.client.config import ENV_OP_CHANNEL, OP_CHANNELS
from smddp.client.errors import ConnectError, DaemonLostError, OpError, op_error
from smddp.core.wire import (
    DATA_SOCKET_SUFFIX,
    MAX_MESSAGE_BYTES,
    MSG_ATTACH,
    MSG_ATTACH_REPLY,
    MSG_FREE_ATTACH,
    MSG_OP,
    MSG_OP_REPLY,
    MSG_PEER_ARENAS,
    MSG_PEER_ARENAS_REPLY,
    pack,
    unpack,
)
from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc

REGISTER_TIMEOUT_S = 30.0
RECV_SLICE_S = 1.0  # how often a waiting rank checks its own deadline

_channels: dict[str, grpc.Channel] = {}
_channels_lock = threading.Lock()


def grpc_channel(path: str) -> grpc.Channel:
    """The process's gRPC channel to the daemon at ``path`` (one per socket, shared)."""
    with _channels_lock:
        channel = _channels.get(path)
        if channel is None:
            channel = grpc.insecure_channel("unix:" + path)
            _channels[path] = channel
        return channel


def _close_channels() -> None:
    """Closes the cached channels at exit, before the interpreter finalizes: a gRPC channel
    left to finalization has its core threads call back into a half-torn-down interpreter,
    which gRPC's issues report ending in SIGABRT or SIGSEGV after the script's last line."""
    with _channels_lock:
        channels = list(_channels.values())
        _channels.clear()
    for channel in channels:
        channel.close()


atexit.register(_close_channels)


class DaemonSession:
    """A registered rank with its arena attached; sends OpRequests and collects OpReplies."""

    def __init__(
        self,
        socket_path: str,
        register: pb.RegisterRequest,
        op_channel: str = "socket",
    ) -> None:
        """Registers with the daemon at ``socket_path`` and attaches a new arena; its ops
        travel on ``op_channel`` (``socket`` or ``grpc``).

        Raises:
            ConnectError: the daemon is unreachable or refused the rank.
        """
        self.socket_path = socket_path
        self.rank = register.rank
        self.world_size = register.world_size
        # The communicator's ranks on this node, in the daemon's order (its region's slots).
        self.local_ranks: tuple[int, ...] = next(
            (tuple(n.ranks) for n in register.nodes if register.rank in n.ranks),
            tuple(range(register.world_size)),
        )
        self.job_id = register.job_id
        self.comm_id = register.comm_id
        self._stub = pb_grpc.NodeStub(grpc_channel(socket_path))
        try:
            reply = self._stub.Register(register, timeout=REGISTER_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise ConnectError(
                f"smddpd at {socket_path} refused rank {register.rank} of job {register.job_id} comm {register.comm_id}: "  # noqa: E501
                f"{exc.details() or exc.code()}"
            ) from None
        self.session_id = reply.session_id
        self._secret = reply.session_secret
        self.chunk_bytes = reply.chunk_bytes
        self.daemon_node_id = reply.daemon_node_id
        # The daemon runs the local phases of ops spanning nodes in the region.
        self.node_region = reply.node_region
        self.arena = ClientArena(register.arena_bytes)
        self._replies: dict[int, pb.OpReply] = {}
        self._closed = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.connect(socket_path + DATA_SOCKET_SUFFIX)
            attach = pb.AttachRequest(session_id=self.session_id, session_secret=self._secret)
            socket.send_fds(
                self._sock, [pack(MSG_ATTACH, attach.SerializeToString())], [self.arena.fd]
            )
            self._sock.settimeout(REGISTER_TIMEOUT_S)
            kind, payload = unpack(self._sock.recv(MAX_MESSAGE_BYTES))
            answer = pb.AttachReply.FromString(payload)
        except (OSError, ValueError) as exc:
            self.close()
            raise ConnectError(
                f"cannot attach to smddpd's data socket at {socket_path}{DATA_SOCKET_SUFFIX}: {exc}"
            ) from None
        if kind != MSG_ATTACH_REPLY or not answer.ok:
            self.close()
            raise ConnectError(f"smddpd at {socket_path} refused the arena: {answer.error}")
        self._sock.settimeout(RECV_SLICE_S)
        self._buf = bytearray(MAX_MESSAGE_BYTES)
        self._view = memoryview(self._buf)
        mode = op_channel
        if mode not in OP_CHANNELS:
            raise ConnectError(f"{ENV_OP_CHANNEL}={mode!r}: expected 'socket' or 'grpc'")
        self._stream_requests: queue.Queue[pb.OpRequest | None] | None = None
        self._stream_replies: queue.Queue[pb.OpReply | Exception] | None = None
        if mode == "grpc":
            self._open_stream()

    def open_free_channel(self) -> socket.socket:
        """A new data-socket connection attached as this process's free channel (close
        before free, ``smddp.server.gpu_free``), for the allocator hook to own.

        Raises:
            ConnectError: smddpd is unreachable or refused it (a daemon older than the
                channel answers with an error).
        """
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(self.socket_path + DATA_SOCKET_SUFFIX)
            attach = pb.AttachRequest(session_id=self.session_id, session_secret=self._secret)
            sock.sendall(pack(MSG_FREE_ATTACH, attach.SerializeToString()))
            sock.settimeout(REGISTER_TIMEOUT_S)
            kind, payload = unpack(sock.recv(MAX_MESSAGE_BYTES))
            answer = pb.AttachReply.FromString(payload)
            sock.settimeout(None)
        except (OSError, ValueError) as exc:
            sock.close()
            raise ConnectError(f"cannot open a free channel to smddpd: {exc}") from None
        if kind != MSG_ATTACH_REPLY or not answer.ok:
            sock.close()
            raise ConnectError(f"smddpd refused the free channel: {answer.error}")
        return sock

    def _open_stream(self) -> None:
        requests: queue.Queue[pb.OpRequest | None] = queue.Queue()
        replies: queue.Queue[pb.OpReply | Exception] = queue.Queue()

        def iterate() -> Iterator[pb.OpRequest]:
            # The first message names the session; the daemon ignores the fields afterwards.
            first = True
            while True:
                item = requests.get()
                if item is None:
                    return
                if first:
                    item.session_id, item.session_secret = self.session_id, self._secret
                    first = False
                yield item

        responses = self._stub.Ops(iterate())

        def pump() -> None:
            try:
                for reply in responses:
                    replies.put(reply)
                replies.put(DaemonLostError(f"smddpd at {self.socket_path} ended the Ops stream"))
            except grpc.RpcError as exc:
                replies.put(
                    DaemonLostError(
                        f"smddpd at {self.socket_path}: Ops stream broke: {exc.details()}"
                    )
                )

        threading.Thread(target=pump, name="smddp-ops-stream", daemon=True).start()
        self._stream_requests, self._stream_replies = requests, replies

    def send(self, req: pb.OpRequest) -> None:
        """Submits one chunk.

        Raises:
            DaemonLostError: the daemon is gone.
        """
        if self._stream_requests is not None:
            self._stream_requests.put(req)
            return
        try:
            self._sock.sendall(pack(MSG_OP, req.SerializeToString()))
        except OSError as exc:
            raise self.gone(exc) from None

    def wait_reply(self, request_id: int, timeout_s: float) -> pb.OpReply:
        """Blocks until the reply to ``request_id`` arrives.

        Raises:
            DaemonLostError: the daemon closed the connection or never answered in time.
        """
        deadline = time.monotonic() + timeout_s
        while request_id not in self._replies:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DaemonLostError(
                    f"smddpd at {self.socket_path} sent no reply within {timeout_s:.0f} s (the daemon is stuck or unreachable)"  # noqa: E501
                )
            reply = self._recv()
            if reply is not None:
                self._replies[reply.request_id] = reply
        return self._replies.pop(request_id)

    def has_reply(self, request_id: int) -> bool:
        """True once the reply to ``request_id`` is here; reads what has arrived, never blocks.

        Raises:
            DaemonLostError: the daemon closed the connection.
        """
        while request_id not in self._replies:
            reply = self._recv(block=False)
            if reply is None:
                return False
            self._replies[reply.request_id] = reply
        return True

    def _recv(self, block: bool = True) -> pb.OpReply | None:
        """One reply, or None after RECV_SLICE_S (at once unless ``block``) without one."""
        if self._stream_replies is not None:
            try:
                item = (
                    self._stream_replies.get(timeout=RECV_SLICE_S)
                    if block
                    else self._stream_replies.get_nowait()
                )
            except queue.Empty:
                return None
            if isinstance(item, Exception):
                self._stream_replies.put(item)
                raise item
            return item
        try:
            # Into a buffer kept for the session: a fresh 1 MiB bytes object per reply costs
            # more than the reply's whole round trip.
            if not block:
                self._sock.settimeout(0.0)  # with a timeout, recv would first wait that long
            n = self._sock.recv_into(self._buf)
        except (TimeoutError, BlockingIOError):
            return None
        except OSError as exc:
            raise DaemonLostError(
                f"smddpd at {self.socket_path}: connection broke: {exc}"
            ) from None
        finally:
            if not block:
                self._sock.settimeout(RECV_SLICE_S)
        if not n:
            raise DaemonLostError(
                f"smddpd at {self.socket_path} closed the connection (the daemon stopped, restarted or crashed)"  # noqa: E501
            )
        kind = self._buf[0]
        if kind != MSG_OP_REPLY:
            raise DaemonLostError(f"smddpd at {self.socket_path} sent message type {kind}")
        reply = pb.OpReply.FromString(self._view[1:n])
        if reply.request_id == 0 and not reply.ok:
            raise op_error(
                reply.error_kind, reply.error
            )  # a notice for every rank (the daemon stops)
        return reply

    def peer_arenas(self) -> tuple[list[np.ndarray], np.ndarray]:
        """Maps the arena of every rank of the communicator on this node (``local_ranks``,
        our own included) and the communicator's control region.

        Only with no op in flight: the reply is the next message on the data socket. Blocks
        until every rank has attached.

        Raises:
            ConnectError: the daemon refused (e.g. the communicator failed).
            DaemonLostError: the daemon is gone.
        """
        try:
            self._sock.sendall(pack(MSG_PEER_ARENAS, b""))
            self._sock.settimeout(None)
            msg, fds, _flags, _addr = socket.recv_fds(
                self._sock, MAX_MESSAGE_BYTES, len(self.local_ranks) + 1
            )
        except OSError as exc:
            raise self.gone(exc) from None
        finally:
            self._sock.settimeout(RECV_SLICE_S)
        if not msg:
            raise self.gone()
        kind, payload = unpack(msg)
        answer = pb.AttachReply.FromString(payload) if kind == MSG_PEER_ARENAS_REPLY else None
        try:
            if answer is None or not answer.ok or len(fds) != len(self.local_ranks) + 1:
                raise ConnectError(
                    f"smddpd at {self.socket_path} gave no peer arenas: "
                    f"{answer.error if answer is not None else f'message type {kind}'}"
                )
            maps = []
            for fd in fds:
                size = os.fstat(fd).st_size
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                maps.append(np.frombuffer(mm, dtype=np.uint8))
            return maps[:-1], maps[-1]
        finally:
            for fd in fds:
                os.close(fd)

    def alive(self) -> bool:
        """False once the daemon has closed this rank's connection (it stopped or crashed)."""
        if self._closed:
            return False
        # poll, not recv: the socket's timeout would make even a peek wait.
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN)
        return not any(
            ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in poller.poll(0)
        )

    def gone(self, detail: object = None) -> DaemonLostError:
        """The error for a daemon that went away: its parting notice, if it left one."""
        try:
            while not self._closed and self._recv(block=False) is not None:
                pass  # replies to earlier ops; the notice (request_id 0) raises
        except OpError as exc:
            if isinstance(exc, DaemonLostError):
                return exc
        except (DaemonLostError, OSError, ValueError):
            pass
        suffix = f": {detail}" if detail is not None else ""
        return DaemonLostError(
            f"smddpd at {self.socket_path} is gone (it stopped or restarted){suffix}"
        )

    # Set by shrink_group before the rank leaves for the survivors' new group: the daemon
    # tells the ranks still here so, and does not count this one among the failed.
    shrink = ""

    def failure(self, timeout_s: float) -> pb.FailureReply:
        """The daemon's record of this communicator's failure (``Node.Failure``).

        Raises:
            grpc.RpcError: the daemon did not answer.
        """
        request = pb.FailureRequest(
            session_id=self.session_id,
            session_secret=self._secret,
            wait_ms=max(1, int(timeout_s * 1000)),
        )
        reply: pb.FailureReply = self._stub.Failure(request, timeout=timeout_s + 5.0)
        return reply

    def revoke(self, reason: str, timeout_s: float) -> None:
        """Has the daemon fail this communicator's ops on every rank (``Node.Revoke``).

        Raises:
            grpc.RpcError: the daemon did not answer.
        """
        request = pb.RevokeRequest(
            session_id=self.session_id, session_secret=self._secret, reason=reason
        )
        self._stub.Revoke(request, timeout=timeout_s)

    def leave(self, reason: str = "") -> None:
        """Leaves the communicator now, keeping socket and arena for ``close``: the daemon
        fails the communicator's pending and later ops on every rank, this one's included
        (an abort; torchft's ProcessGroupSmddp.abort), telling them ``reason`` (default:
        destroy_process_group). A second call, or ``close``'s, is refused by the daemon and
        ignored."""
        if self._closed:
            return
        try:
            self._stub.Deregister(
                pb.DeregisterRequest(
                    session_id=self.session_id,
                    session_secret=self._secret,
                    shrink=self.shrink,
                    reason=reason,
                ),
                timeout=5,
            )
        except grpc.RpcError:
            pass  # the daemon is gone, or the rank has left already: nothing left to leave

    def close(self, deregister: bool = True) -> None:
        """Leaves the communicator (when ``deregister``) and releases socket and arena."""
        if self._closed:
            return
        if deregister:
            self.leave()
        self._closed = True
        requests = getattr(self, "_stream_requests", None)  # unset if the attach failed
        if requests is not None:
            requests.put(None)
        self._sock.close()
        self.arena.close()
