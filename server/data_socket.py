"""The data socket: a SOCK_SEQPACKET unix socket beside the gRPC one.

A rank connects once per session, sends an AttachRequest with its arena's memfd (SCM_RIGHTS;
gRPC cannot carry descriptors), and then uses the connection as its op channel: one message
per OpRequest and per OpReply, about ten times cheaper than a gRPC round trip. The kernel
tells the rank's uid (SO_PEERCRED) and, when the rank dies, closes the connection, which
fails its communicators at once.

A connection has at most one peer-arenas request in flight (the client waits for its reply,
the next message), so one thread per connection at most waits in it; a second request before
the first is answered breaks the protocol and closes the connection, like any other message
the protocol does not allow.
"""

from __future__ import annotations

import errno
import grp
import logging
import os
import pwd
import socket
import struct
import threading
import time

from google.protobuf.message import DecodeError

from smddp.core.wire import (
    MAX_MESSAGE_BYTES,
    MSG_ATTACH,
    MSG_ATTACH_REPLY,
    MSG_FREE_ATTACH,
    MSG_METRICS,
    MSG_OP,
    MSG_OP_REPLY,
    MSG_PEER_ARENAS,
    MSG_PEER_ARENAS_REPLY,
    MSG_QUERY_REPLY,
    MSG_STATUS,
    QUERY_MAGIC,
    pack,
    unpack,
)
from smddp.server import __version__, gpu_free, supervise
from smddp.server.communicator import Session
from smddp.server.errors import LimitExceeded, SmddpError
from smddp.server.gpu_supply import DaemonGpu
from smddp.server.limits import Counts
from smddp.server.logthrottle import refusals
from smddp.server.registry import Registry
from smddp.v1 import smddp_pb2 as pb

log = logging.getLogger(__name__)

# accept() errors that pass (descriptors, memory, a connection reset before we took it):
# the loop waits and tries again, from ACCEPT_BACKOFF_S doubling up to ACCEPT_BACKOFF_MAX_S.
ACCEPT_BACKOFF_S = 0.01
ACCEPT_BACKOFF_MAX_S = 1.0
# How long after its last failed accept() the socket counts as unable to take jobs.
ACCEPT_STALL_S = 2.0
# getsockopt(SO_PEERGROUPS) (Linux 4.13): the asker's supplementary groups, as the kernel saw
# them at connect. Python's getsockopt reads at most 1024 bytes: 256 groups.
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
PEERGROUPS_BYTES = 1024


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


class _FreeChannel:
    """What ``_attach`` returns for a rank's free channel rather than its op channel: the
    label of the session it attached with (not the session, which it must not outlive)."""

    def __init__(self, label: str) -> None:
        self.label = label


class DataSocketServer:
    """Accepts data-socket connections and serves each in its own thread."""

    def __init__(
        self, path: str, registry: Registry, gpu: DaemonGpu, mode: int, gid: int | None
    ) -> None:
        self.path = path
        self._registry = registry
        self._gpu = gpu  # the daemon's GPU side, which a rank's free channel asks to unmap
        self._mode = mode
        self._gid = gid
        self._sock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = False
        cfg = registry.config
        self._connections = Counts(
            "data-socket connections", cfg.max_connections_per_uid, "--max-connections-per-uid"
        )
        self._handshakes = Counts(
            "data-socket connections that have not attached",
            cfg.max_handshakes_per_uid,
            "--max-handshakes-per-uid",
            cfg.max_handshakes,
            "--max-handshakes",
        )
        self._attach_timeout_s = cfg.attach_timeout_s
        # When accept() last failed, and why; cleared by the next success.
        self.accept_error: tuple[float, str] | None = None
        self._accept_running = False

    def healthy(self) -> tuple[bool, str]:
        """Whether new ranks can connect, and why not."""
        if not self._accept_running and not self._stopping:
            return False, "the data socket's accept loop has stopped"
        error = self.accept_error
        if error is not None and time.monotonic() - error[0] < ACCEPT_STALL_S:
            return False, f"the data socket cannot accept connections: {error[1]}"
        return True, "ready"

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
        self._accept_running = True
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
        backoff = ACCEPT_BACKOFF_S
        try:
            while not self._stopping:
                try:
                    conn, _ = self._sock.accept()
                except OSError as exc:
                    if self._stopping or exc.errno in (errno.EBADF, errno.EINVAL):
                        return  # the socket was closed: stop() ends the loop this way
                    # EMFILE, ENFILE, ENOBUFS, ENOMEM, ECONNABORTED...: the next try may pass.
                    self.accept_error = (
                        time.monotonic(),
                        f"{exc.strerror or exc} (errno {exc.errno})",
                    )
                    refusals.log(
                        log,
                        logging.WARNING,
                        f"data-socket accept failing ({errno.errorcode.get(exc.errno or 0, exc.errno)})",  # noqa: E501
                        "the data socket cannot accept a connection: %s; retrying",
                        exc,
                    )
                    time.sleep(backoff)
                    backoff = min(backoff * 2, ACCEPT_BACKOFF_MAX_S)
                    continue
                backoff = ACCEPT_BACKOFF_S
                self.accept_error = None
                # A thread that cannot start, say: this connection closes, the loop goes on.
                with supervise.unit(
                    "admitting a data-socket connection", on_error=supervise.closing(conn)
                ):
                    self._admit(conn)
        finally:
            self._accept_running = False

    def _admit(self, conn: socket.socket) -> None:
        """Counts a new connection against its uid and serves it, or refuses it at once."""
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        try:
            self._connections.take(uid)
            try:
                self._handshakes.take(uid)
            except LimitExceeded:
                self._connections.give(uid)
                raise
        except LimitExceeded as exc:
            refusals.log(
                log,
                logging.WARNING,
                "data-socket connection refused (limit)",
                "refused a data-socket connection of uid %d (pid %d): %s",
                uid,
                pid,
                exc,
            )
            self._send_attach_reply(conn, pb.AttachReply(ok=False, error=str(exc)))
            conn.close()
            return
        with self._lock:
            self._conns.add(conn)
        try:
            threading.Thread(
                target=self._serve, args=(conn, pid, uid), name="smddp-data-conn", daemon=True
            ).start()
        except BaseException:
            with self._lock:
                self._conns.discard(conn)
            self._handshakes.give(uid)
            self._connections.give(uid)
            raise

    def _serve(self, conn: socket.socket, pid: int, uid: int) -> None:
        session: Session | None = None
        detail = "connection closed"
        try:
            try:
                attached = self._attach(conn, pid, uid)
            finally:
                self._handshakes.give(uid)  # attached or not, its handshake is over
            if isinstance(attached, _FreeChannel):
                # Not the rank's op channel: its loss fails nothing (session stays None).
                gpu_free.serve(self._gpu, conn, pid, attached.label)
                return
            session = attached
            if session is None:
                return
            buf = bytearray(MAX_MESSAGE_BYTES)  # reused: a fresh 1 MiB object per op is costly
            view = memoryview(buf)
            asking = threading.Event()  # a peer-arenas request of this connection is in flight
            while True:
                n, _anc, flags, _addr = conn.recvmsg_into([buf])
                if not n:
                    break
                if flags & socket.MSG_TRUNC:
                    # The kernel cut it to fit: parsing the rest could even succeed.
                    detail = f"a message of more than {MAX_MESSAGE_BYTES} bytes on the data socket"
                    break
                if buf[0] == MSG_PEER_ARENAS:
                    if asking.is_set():
                        detail = "a second peer-arenas request on the data socket before the first was answered (one at a time)"  # noqa: E501
                        break
                    # In a thread of its own: it waits for the other ranks to attach, while
                    # this one must keep reading (an EOF here is the rank's death, which
                    # ends that wait too).
                    asking.set()
                    threading.Thread(
                        target=self._send_peer_arenas,
                        args=(conn, session, asking),
                        name="smddp-peer-arenas",
                        daemon=True,
                    ).start()
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
        except Exception as exc:  # a bug met serving it: this connection closes, nothing else
            about = session.comm.name() if session is not None else f"uid {uid} pid {pid}"
            fields = session.log_fields() if session is not None else None
            supervise.report("serving a data-socket connection", exc, about, fields)
            detail = (
                f"internal error in smddpd serving its connection ({type(exc).__name__}: {exc})"
            )
        finally:
            # Each step whatever the ones before raised: a connection left open here is a
            # descriptor and a count of its uid held for good.
            steps = supervise.Steps("closing a data-socket connection", f"uid {uid} pid {pid}")
            if session is not None:
                lost = session
                steps.run("removing its rank", lambda: self._registry.connection_lost(lost, detail))
            steps.run("forgetting it", lambda: self._forget(conn))
            steps.run("giving back its uid's count", lambda: self._connections.give(uid))
            steps.run("closing it", conn.close)

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._conns.discard(conn)

    def _attach(self, conn: socket.socket, pid: int, uid: int) -> Session | _FreeChannel | None:
        # A connection that sends nothing must not hold its thread and descriptor for ever.
        conn.settimeout(self._attach_timeout_s)
        try:
            msg, fds, flags, _addr = socket.recv_fds(conn, MAX_MESSAGE_BYTES, 4)
        except TimeoutError:
            refusals.log(
                log,
                logging.INFO,
                "data-socket handshake timed out",
                "closed a data-socket connection of uid %d (pid %d): "
                "no AttachRequest within %.0f s (--attach-timeout-s)",
                uid,
                pid,
                self._attach_timeout_s,
            )
            return None
        conn.settimeout(None)
        try:
            if not msg:
                return None
            msg_type, payload = unpack(msg)
            if msg_type in (MSG_STATUS, MSG_METRICS) and payload.startswith(QUERY_MAGIC):
                self._answer_query(conn, uid, msg_type)
                return None
            if msg_type == MSG_FREE_ATTACH:
                return self._attach_free(conn, pid, payload, fds)
            if msg_type != MSG_ATTACH:
                raise ValueError(f"expected an AttachRequest, got message type {msg_type}")
            if flags & socket.MSG_CTRUNC:
                # The kernel could not pass the descriptors it was sent: out of them here, or
                # more than the 4 a message may carry. Not the rank's fault in the first case.
                raise ValueError(
                    "the AttachRequest's memfd did not arrive (MSG_CTRUNC): "
                    "the daemon may be out of file descriptors (RLIMIT_NOFILE), or the message carried more than 4"  # noqa: E501
                )
            if len(fds) != 1:
                raise ValueError(f"an AttachRequest carries exactly one memfd, not {len(fds)}")
            try:
                req = pb.AttachRequest.FromString(payload)
            except DecodeError:
                raise ValueError("undecodable AttachRequest") from None
            session = self._registry.authenticate(req.session_id, req.session_secret)
            fd = fds.pop()
            self._registry.attach(session, fd, uid, pid)
        except (ValueError, SmddpError) as exc:
            self._send_attach_reply(conn, pb.AttachReply(ok=False, error=str(exc)))
            refusals.log(
                log,
                logging.INFO,
                f"data-socket attach refused ({type(exc).__name__})",
                "refused a data-socket attach from uid %d (pid %d): %s",
                uid,
                pid,
                exc,
            )
            return None
        finally:
            for fd in fds:
                os.close(fd)
        session.channel = SocketChannel(conn)
        self._send_attach_reply(conn, pb.AttachReply(ok=True))
        return session

    def _attach_free(
        self, conn: socket.socket, pid: int, payload: bytes, fds: list[int]
    ) -> _FreeChannel:
        """A rank's free channel (``smddp.server.gpu_free``): the AttachRequest of a session
        already attached from this very process; no descriptors.

        Raises:
            ValueError, SmddpError: refused (``_attach`` answers and logs).
        """
        if fds:
            raise ValueError("a free channel's AttachRequest carries no descriptors")
        try:
            req = pb.AttachRequest.FromString(payload)
        except DecodeError:
            raise ValueError("undecodable AttachRequest") from None
        session = self._registry.authenticate(req.session_id, req.session_secret)
        if session.peer_pid != pid:
            raise ValueError(
                f"a free channel must come from the process of an attached session (pid {pid}, the session's {session.peer_pid or 'not attached'})"  # noqa: E501
            )
        self._send_attach_reply(conn, pb.AttachReply(ok=True))
        return _FreeChannel(session.label())

    def _answer_query(self, conn: socket.socket, uid: int, msg_type: int) -> None:
        """smddpctl's status or metrics, of the jobs the asker may see (``viewer``), as a memfd."""
        registry = self._registry
        viewer = None if may_see_all(conn, uid, registry.config.admin_group) else uid
        try:
            if msg_type == MSG_STATUS:
                data = registry.status(__version__, viewer).SerializeToString()
            else:
                metrics = registry.metrics
                text = metrics.exposition(registry.job_visible(viewer)) if metrics else b""
                data = pb.MetricsReply(exposition=text.decode()).SerializeToString()
        except Exception as exc:  # whatever went wrong, the asker hears it and the daemon goes on
            log.warning("could not answer smddpctl (uid %d): %r", uid, exc)
            reply = pb.AttachReply(ok=False, error=f"smddpd could not answer: {exc!r}"[:4096])
            self._send_query_reply(conn, reply, None)
            return
        fd = os.memfd_create("smddp-reply", os.MFD_CLOEXEC)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.lseek(fd, 0, os.SEEK_SET)
            self._send_query_reply(conn, pb.AttachReply(ok=True), fd)
        finally:
            os.close(fd)

    def _send_query_reply(self, conn: socket.socket, reply: pb.AttachReply, fd: int | None) -> None:
        conn.settimeout(self._attach_timeout_s)  # an asker that never reads holds nothing long
        try:
            socket.send_fds(
                conn, [pack(MSG_QUERY_REPLY, reply.SerializeToString())], [] if fd is None else [fd]
            )
        except OSError:
            pass

    @staticmethod
    def _send_peer_arenas(conn: socket.socket, session: Session, asking: threading.Event) -> None:
        """Answers a peer-arenas request once every local rank attached, or with why not
        (the communicator failed or closed, this rank left, the timeout passed)."""
        try:
            fds = session.comm.arena_fds(session)
            reply, sent = pb.AttachReply(ok=True), fds
        except SmddpError as exc:
            reply, sent = pb.AttachReply(ok=False, error=str(exc)), []
        except Exception as exc:  # a bug (or no memory for the region): answered, not a hang
            supervise.report(
                "answering a peer-arenas request", exc, session.comm.name(), session.log_fields()
            )
            error = (
                f"{session.comm.name()}: "
                f"internal error in smddpd while answering {session.label()}'s peer-arenas request ({type(exc).__name__}: {exc})"  # noqa: E501
            )
            reply, sent = pb.AttachReply(ok=False, error=error), []
        channel = session.channel
        lock = channel.lock if isinstance(channel, SocketChannel) else threading.Lock()
        # Before the reply: a client that has it may ask again at once.
        asking.clear()
        with lock:
            try:
                socket.send_fds(
                    conn, [pack(MSG_PEER_ARENAS_REPLY, reply.SerializeToString())], sent
                )
            except OSError:
                pass

    @staticmethod
    def _send_attach_reply(conn: socket.socket, reply: pb.AttachReply) -> None:
        try:
            conn.sendall(pack(MSG_ATTACH_REPLY, reply.SerializeToString()))
        except OSError:
            pass


def may_see_all(conn: socket.socket, uid: int, admin_group: str) -> bool:
    """Whether the process at the other end of ``conn`` (uid ``uid``, the kernel's word) may
    see every job: root, the daemon's own uid, or a member of ``admin_group`` (its primary
    or a supplementary group, as the kernel names them; else as the group database does)."""
    if uid == 0 or uid == os.geteuid():
        return True
    if not admin_group:
        return False
    try:
        group = grp.getgrnam(admin_group)
    except KeyError:
        return False  # load() checked it; a group deleted since admits nobody
    _pid, _uid, gid = struct.unpack(
        "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    )
    if gid == group.gr_gid:
        return True
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, PEERGROUPS_BYTES)
        return group.gr_gid in struct.unpack(f"{len(raw) // 4}I", raw)
    except OSError:  # an old kernel, or more than 256 groups: the group database says
        try:
            user = pwd.getpwuid(uid)
        except KeyError:
            return False
        return user.pw_gid == group.gr_gid or user.pw_name in group.gr_mem
