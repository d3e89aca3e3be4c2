"""Mutual TLS on the connections between node daemons (``--tls-cert/--tls-key/--tls-ca``).

Both ends present a certificate and require one from the other, signed by the configured
CA. The connecting daemon also checks that the other's certificate names the node id that
the job's layout gives for that address (as a DNS subject alternative name): daemons reach
each other by bare IPs, but every node has an id.

``TlsSocket`` runs TLS through memory BIOs over a connected TCP socket. The peer transport
receives on one thread while others send; an ``ssl.SSLSocket`` is a single OpenSSL object,
which OpenSSL does not allow two threads to use at once. Here the TLS object is only
touched under a lock, and the socket reads and writes happen outside it.
"""

from __future__ import annotations

import socket
import ssl
import threading

RECORD_BYTES = 1 << 20  # plaintext encrypted per lock hold: bounds the ciphertext buffered
READ_BYTES = 1 << 18


def contexts(cert: str, key: str, ca: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """The server and client contexts of mutual TLS between daemons.

    Raises:
        OSError, ssl.SSLError: a file is missing or unreadable, or the key does not match.
    """
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for ctx in (server, client):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(cafile=ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    client.check_hostname = True  # against the node id: TlsSocket(server_hostname=...)
    return server, client


class TlsSocket:
    """A TLS connection over a connected TCP socket; one receiving thread, any sending ones.

    Offers the socket methods the peer transport uses: ``sendall``, ``recv_into``,
    ``settimeout``, ``setsockopt``, ``shutdown`` and ``close``.
    """

    def __init__(
        self,
        sock: socket.socket,
        context: ssl.SSLContext,
        server_side: bool,
        server_hostname: str | None = None,
    ) -> None:
        self._sock = sock
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        self._tls = context.wrap_bio(
            self._in, self._out, server_side=server_side, server_hostname=server_hostname
        )
        self._lock = threading.Lock()  # the TLS object and its BIOs
        self._flush_lock = threading.Lock()  # ciphertext leaves in the order it was made

    def handshake(self) -> None:
        """Runs the TLS handshake (within the socket's timeout).

        Raises:
            ssl.SSLError: the peer's certificate is refused, or it refused ours, or it hung up
                (a daemon without TLS does, on the bytes of a handshake).
            OSError: the connection timed out.
        """
        while True:
            with self._lock:
                try:
                    self._tls.do_handshake()
                    done = True
                except ssl.SSLWantReadError:
                    done = False
            try:
                self._flush()
                if done:
                    return
                more = self._fill()
            except (ConnectionResetError, BrokenPipeError) as exc:
                raise ssl.SSLEOFError(
                    ssl.SSL_ERROR_EOF, f"the peer hung up during the TLS handshake ({exc})"
                ) from None
            if not more:
                raise ssl.SSLEOFError(
                    ssl.SSL_ERROR_EOF, "the peer hung up during the TLS handshake"
                )

    def _flush(self) -> None:
        with self._flush_lock:
            with self._lock:
                data = self._out.read()
            if data:
                self._sock.sendall(data)

    def _flush_if_idle(self) -> None:
        """Sends what reading produced (a TLS 1.3 key update's answer, say) unless a sender
        is busy: the receiver must never wait on a send, or two daemons sending to each other
        would both stop reading; a busy sender, or the next heartbeat, sends it instead."""
        with self._lock:
            if not self._out.pending:
                return
        if self._flush_lock.acquire(blocking=False):
            try:
                with self._lock:
                    data = self._out.read()
                if data:
                    self._sock.sendall(data)
            finally:
                self._flush_lock.release()

    def _fill(self) -> bool:
        """Reads ciphertext from the socket into the TLS object; False at end of stream."""
        data = self._sock.recv(READ_BYTES)
        if not data:
            return False
        with self._lock:
            self._in.write(data)
        return True

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), RECORD_BYTES):
            with self._lock:
                self._tls.write(view[start : start + RECORD_BYTES])
            self._flush()

    def recv_into(self, buffer: memoryview | bytearray, nbytes: int = 0) -> int:
        n = nbytes or len(buffer)
        while True:
            with self._lock:
                try:
                    # typeshed: read() takes a bytearray and returns bytes; given any writable
                    # buffer it fills that and returns the count, as the ssl docs say.
                    return self._tls.read(n, buffer)  # type: ignore[arg-type, return-value]
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLZeroReturnError:
                    return 0
            self._flush_if_idle()
            if not self._fill():
                return 0

    def settimeout(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)

    def setsockopt(self, level: int, option: int, value: int) -> None:
        self._sock.setsockopt(level, option, value)

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()
