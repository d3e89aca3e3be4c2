"""Data connections between node daemons over TCP, with mutual TLS when configured.

``TcpNode`` has the shape of ``ucx_transport.UcxNode``: a listener that hands each accepted
connection to ``on_connection`` on a thread of its own, ``connect`` to another node's
listener, ``port`` and ``stop``. What flows on a connection (HELLO, frames) is
``peer_wire``'s; the transport only moves bytes.
"""

from __future__ import annotations

import errno
import logging
import socket
import ssl
import threading
import time

from smddp.server import supervise
from smddp.server.logthrottle import refusals
from smddp.server.peer_wire import HELLO_MAGIC, HELLO_REFUSED, Connection, OnConnection, answer
from smddp.server.tls import TlsSocket

log = logging.getLogger(__name__)

ACCEPT_TIMEOUT_S = 5.0  # for the whole TLS handshake of an accepted connection
# Accepted connections still in their TLS handshake or HELLO, at most: each holds a thread
# and a descriptor until it is adopted or refused, and anyone who can reach the port can
# open them. Past this a new connection is closed at once (a real peer retries); a real
# node daemon dials a handful per job, and each handshake takes milliseconds.
MAX_HANDSHAKING = 64


class TcpNode:
    """This daemon's TCP listener for data connections, and its dialer.

    Args:
        host: the address to listen on ("" or "0.0.0.0": every IPv4 interface).
        port: the port to listen on (0: one the system picks).
        on_connection: called with each accepted connection (after TLS, before its HELLO)
            and a description of its peer, on a new thread of its own.
        tls: the server and client contexts of mutual TLS (``tls.contexts``), or None.

    Raises:
        OSError: the port cannot be bound (the message names ``--data-port``).
    """

    def __init__(
        self,
        host: str,
        port: int,
        on_connection: OnConnection,
        tls: tuple[ssl.SSLContext, ssl.SSLContext] | None = None,
    ) -> None:
        self._on_connection = on_connection
        self._server_tls: ssl.SSLContext | None
        self._client_tls: ssl.SSLContext | None
        self._server_tls, self._client_tls = tls if tls is not None else (None, None)
        self._stopping = False
        self._handshaking = threading.BoundedSemaphore(MAX_HANDSHAKING)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host or "0.0.0.0", port))
        except OSError as exc:
            self._sock.close()
            what = f"cannot listen for data connections on {host}:{port} (--data-port)"
            raise OSError(exc.errno, f"{what}: {exc.strerror}") from None
        self._sock.listen(256)
        self.port: int = self._sock.getsockname()[1]

    def start(self) -> None:
        """Starts accepting connections."""
        threading.Thread(target=self._accept_loop, name="smddp-peer-accept", daemon=True).start()

    def stop(self) -> None:
        """Stops listening; connections already handed over stay with their owners."""
        self._stopping = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def connect(self, host: str, port: int, timeout: float, server_name: str = "") -> Connection:
        """A data connection to the node listening at ``host:port``, before its HELLO.

        Args:
            server_name: the node id the other daemon's certificate must name (TLS only).

        Raises:
            OSError: no connection (retry); ssl.SSLError: the TLS handshake failed.
        """
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._client_tls is None:
            return sock
        tls = TlsSocket(sock, self._client_tls, server_side=False, server_hostname=server_name)
        try:
            tls.handshake()
        except BaseException:
            sock.close()
            raise
        return tls

    def _accept_loop(self) -> None:
        backoff = 0.01
        while not self._stopping:
            try:
                sock, addr = self._sock.accept()
            except OSError as exc:
                if self._stopping or exc.errno in (errno.EBADF, errno.EINVAL):
                    return  # closed by stop()
                # EMFILE and the like pass: wait and try again rather than stop for good.
                refusals.log(
                    log, logging.WARNING, "peer accept failing",
                    "cannot accept a peer data connection: %s; retrying", exc,
                )  # fmt: skip
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            backoff = 0.01
            who = f"{addr[0]}:{addr[1]}"
            # One connection that raises (a thread that cannot start) closes; the loop goes on.
            with supervise.unit(
                "admitting a peer data connection", who, on_error=supervise.closing(sock)
            ):
                self._admit(sock, who)

    def _admit(self, sock: socket.socket, who: str) -> None:
        if not self._handshaking.acquire(blocking=False):
            refusals.log(
                log, logging.WARNING, "peer handshakes at their limit",
                "closed a peer data connection from %s at once: "
                "%d others are still in their handshake", who, MAX_HANDSHAKING,
            )  # fmt: skip
            sock.close()
            return
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self._accept, args=(sock, who), name="smddp-peer-hello", daemon=True
            ).start()
        except BaseException:
            self._handshaking.release()
            raise

    def _accept(self, sock: socket.socket, who: str) -> None:
        try:
            with supervise.unit(
                "taking a peer data connection", who, on_error=supervise.closing(sock)
            ):
                self._handshake(sock, who)
        finally:
            self._handshaking.release()

    def _handshake(self, sock: socket.socket, who: str) -> None:
        try:
            sock.settimeout(ACCEPT_TIMEOUT_S)
            if self._server_tls is not None:
                peek = sock.recv(len(HELLO_MAGIC), socket.MSG_PEEK | socket.MSG_WAITALL)
                if peek == HELLO_MAGIC:
                    answer(
                        sock,
                        HELLO_REFUSED,
                        "this daemon takes peer connections over TLS only (--tls-cert)",
                    )
                    sock.close()
                    return
                tls = TlsSocket(sock, self._server_tls, server_side=True)
                # The whole handshake within ACCEPT_TIMEOUT_S, not each of its reads: past
                # it the socket is shut, which ends a read that a trickling client holds.
                cutoff = threading.Timer(ACCEPT_TIMEOUT_S, _shut, args=(sock,))
                cutoff.start()
                try:
                    tls.handshake()
                finally:
                    cutoff.cancel()
                self._on_connection(tls, who)
                return
        except (OSError, ConnectionError) as exc:
            log.warning("refused a peer connection from %s: %s", who, exc)
            sock.close()
            return
        self._on_connection(sock, who)


def _shut(sock: socket.socket) -> None:
    """Ends whatever read or write waits on ``sock`` (it then fails with an OSError)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # closed already
