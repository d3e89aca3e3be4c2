"""The data socket: a SOCK_SEQPACKET unix socket beside the gRPC one.

A rank connects once per session, sends an AttachRequest with its arena's memfd (SCM_RIGHTS;
gRPC cannot carry descriptors), and then uses the connection as its op channel: one message
per OpRequest and per OpReply, about ten times cheaper than a gRPC round trip. The kernel
tells the rank's uid (SO_PEERCRED) and, when the rank dies, closes the connection, which
fails its communicators at once.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading

from google.protobuf.message import DecodeError

from smddp.server.errors import SmddpError
from smddp.server.registry import Registry
from smddp.server.session import Session
from smddp.v1 import smddp_pb2 as pb
from smddp.wire import (
    MAX_MESSAGE_BYTES,
    MSG_ATTACH,
    MSG_ATTACH_REPLY,
    MSG_OP,
    MSG_OP_REPLY,
    MSG_PEER_ARENAS,
    MSG_PEER_ARENAS_REPLY,
    pack,
    unpack,
)

log = logging.getLogger(__name__)


class SocketChannel:
    """Replies to one rank over its data-socket connection."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self.lock = threading.Lock()

    def send_reply(self, reply: pb.OpReply) -> None:
        data = pack(MSG_OP_REPLY, reply.SerializeToString())
        with self.lock:
            try:
                self._conn.sendall(data)
            except OSError:
                pass  # the reader thread sees the broken connection and reports it


class DataSocketServer:
    """Accepts data-socket connections and serves each in its own thread."""

    def __init__(self, path: str, registry: Registry, mode: int, gid: int | None) -> None:
        self.path = path
        self._registry = registry
        self._mode = mode
        self._gid = gid
        self._sock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = False

    def start(self) -> None:
        """Binds the socket (replacing a stale one) and starts accepting."""
        if os.path.exists(self.path):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.bind(self.path)
        if self._gid is not None:
            os.chown(self.path, -1, self._gid)
        os.chmod(self.path, self._mode)
        sock.listen(256)
        self._sock = sock
        threading.Thread(target=self._accept_loop, name="smddp-data-accept", daemon=True).start()

    def stop(self) -> None:
        """Stops accepting and closes every connection."""
        self._stopping = True
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stopping:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="smddp-data-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        session: Session | None = None
        detail = "connection closed"
        try:
            session = self._attach(conn)
            if session is None:
                return
            buf = bytearray(MAX_MESSAGE_BYTES)  # reused: a fresh 1 MiB object per op is costly
            view = memoryview(buf)
            while True:
                n, _anc, flags, _addr = conn.recvmsg_into([buf])
                if not n:
                    break
                if flags & socket.MSG_TRUNC:
                    # The kernel cut it to fit: parsing the rest could even succeed.
                    detail = f"a message of more than {MAX_MESSAGE_BYTES} bytes on the data socket"
                    break
                if buf[0] == MSG_PEER_ARENAS:
                    self._send_peer_arenas(conn, session)
                    continue
                if buf[0] != MSG_OP:
                    detail = f"unexpected message type {buf[0]} on the data socket"
                    break
                try:
                    req = pb.OpRequest.FromString(view[1:n])
                except DecodeError:
                    detail = "undecodable OpRequest on the data socket"
                    break
                session.comm.submit(session, req)
        except OSError as exc:
            detail = f"connection error: {exc}"
        except ValueError as exc:
            detail = str(exc)
        finally:
            if session is not None:
                self._registry.connection_lost(session, detail)
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _attach(self, conn: socket.socket) -> Session | None:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        msg, fds, _flags, _addr = socket.recv_fds(conn, MAX_MESSAGE_BYTES, 4)
        try:
            if not msg:
                return None
            msg_type, payload = unpack(msg)
            if msg_type != MSG_ATTACH:
                raise ValueError(f"expected an AttachRequest, got message type {msg_type}")
            if len(fds) != 1:
                raise ValueError(f"an AttachRequest carries exactly one memfd, not {len(fds)}")
            try:
                req = pb.AttachRequest.FromString(payload)
            except DecodeError:
                raise ValueError("undecodable AttachRequest") from None
            session = self._registry.authenticate(req.session_id, req.session_secret)
            fd = fds.pop()
            self._registry.attach(session, fd, uid)
        except (ValueError, SmddpError) as exc:
            self._send_attach_reply(conn, pb.AttachReply(ok=False, error=str(exc)))
            log.info("refused a data-socket attach from uid %d: %s", uid, exc)
            return None
        finally:
            for fd in fds:
                os.close(fd)
        session.channel = SocketChannel(conn)
        self._send_attach_reply(conn, pb.AttachReply(ok=True))
        return session

    @staticmethod
    def _send_peer_arenas(conn: socket.socket, session: Session) -> None:
        try:
            fds = session.comm.arena_fds()
            reply, sent = pb.AttachReply(ok=True), fds
        except SmddpError as exc:
            reply, sent = pb.AttachReply(ok=False, error=str(exc)), []
        channel = session.channel
        lock = channel.lock if isinstance(channel, SocketChannel) else threading.Lock()
        with lock:
            try:
                socket.send_fds(conn, [pack(MSG_PEER_ARENAS_REPLY, reply.SerializeToString())], sent)
            except OSError:
                pass

    @staticmethod
    def _send_attach_reply(conn: socket.socket, reply: pb.AttachReply) -> None:
        try:
            conn.sendall(pack(MSG_ATTACH_REPLY, reply.SerializeToString()))
        except OSError:
            pass
