"""Daemon-to-daemon data connections over UCX, shaped like the peer transport's blocking sockets.

``UcxNode`` holds the daemon's one UCX context and worker, the worker's progress thread, and a
listener; ``UcxConnection`` is a UCX stream endpoint that offers what ``peer_transport`` calls on
a TCP socket (``settimeout``, ``sendall``, ``recv_into``, ``shutdown``, ``close``), so that the
same framing code runs over either.

Handshake. The accepting node speaks first: it sends ``HANDSHAKE_MAGIC`` and the tag it will
receive this connection's control messages on (13 bytes, ``_HELLO``) on every new endpoint, and
the connecting node answers the same way with its own tag. ``connect()`` returns once the
greeting arrived and the answer left; the accepting node calls ``on_connection`` (on a thread of
its own) once the answer arrived. The connecting side must not send first: UCX creates client
endpoints lazily, and a stream send posted on an endpoint whose connection then fails before it
was ever established (nobody listens on the port yet, which is routine while the other daemon
starts) spins forever inside ``ucp_request_send`` (UCX 1.21, ucxx 0.52), taking the whole
process with it. A receive posted on such an endpoint fails cleanly instead, so the connecting
side waits for the greeting and sends only on an endpoint that has carried data.

End of stream. UCX has no half-close, and ucxx closes an endpoint that has error handling
(needed to notice a dead peer) with ``UCP_EP_CLOSE_FLAG_FORCE``, which drops bytes still in
flight and any the peer has not yet posted a receive for. So the end travels as tagged
messages beside the stream, on the tags exchanged in the handshake: ``shutdown(SHUT_WR)`` sends
END with the number of stream bytes sent; the peer's ``recv_into`` raises ``ConnectionError``
once it has consumed exactly that many (a socket's EOF) and answers ACK. ``close()`` shuts down
writing if that was not done and returns; a thread lingers (at most ``LINGER_S``) until the
peer's ACK, the peer's own close, or a dead endpoint, before the forced close. A closing side
answers the END it gets, so two sides closing at once do not wait for each other. Tags, not
active messages: ucxx files an active message that arrives for no posted receive under the
UCP endpoint's handle and hands it to the next endpoint that reuses the address. A tag is
random per connection; a control message that comes after its connection closed stays in the
worker's unexpected queue (9 bytes, at most two per connection).

Timeouts. ``settimeout`` bounds how long a transfer may make no progress, like the timeout of a
socket's ``recv_into``: transfers travel in pieces of at most ``PIECE_BYTES``, and each piece
that completes restarts the clock. A timeout or an error leaves the connection broken; every
later call raises ``ConnectionError`` at once. The buffers of requests abandoned that way stay
referenced until the endpoint's close cancelled them (or, for one that never completes, until
the node stops), so UCX never writes into freed memory.

Threads. ucxx's Python API has no blocking wait with a timeout, so a caller posts its request
itself and polls it (``_Backoff``) while UCX's progress thread, asleep on the worker's events,
moves the bytes; one thread may receive while others send on the same connection. Sends are
serialized by a lock of the connection.
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

# ucxx sets UCX_MEMTYPE_CACHE, which UCX then reports as an unused environment variable.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# ucxx logs every endpoint failure at ERROR, e.g. each retry to reach a daemon still starting;
# every one of them also fails a request, which this module raises naming the peer.
os.environ.setdefault("UCXX_LOG_LEVEL", "FATAL")

try:
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib.arr import Array
except Exception as exc:  # ImportError, or a shared library of UCX that does not load
    ucx_api = None
    Array = None
    _IMPORT_ERROR: Exception | None = exc
else:
    _IMPORT_ERROR = None

log = logging.getLogger(__name__)

HANDSHAKE_MAGIC = b"SMDU\x01"  # and the protocol version; the accepting side sends it first
_HELLO = struct.Struct("<5sQ")  # magic, tag the sender receives its control messages on

HANDSHAKE_TIMEOUT_S = 5.0  # how long an accepted endpoint may take to answer the greeting
LINGER_S = 5.0  # most a clean close() waits for the peer to confirm it has read everything
CLOSE_PERIOD_NS = 1_000_000_000  # most ucxx waits for its progress thread to close an endpoint
STOP_GRACE_S = 1.0  # most stop() waits for connections closed before it to finish lingering

# Transfers travel in pieces so that a timeout means "no progress", not "slower than the
# whole buffer needs"; a few pieces stay posted so that the wire never waits for Python.
# Measured with UCX_TLS=tcp over loopback between two processes (2 cores): 64 MiB went at
# 1.1-1.9 GB/s in one piece and in 1, 4 or 16 MiB pieces alike (runs differed more than sizes).
PIECE_BYTES = 4 << 20
PIECES_IN_FLIGHT = 4

# Waiting for a request: yield for SPIN_S, then sleep from SLEEP_MIN_S doubling up to
# SLEEP_MAX_S, and up to IDLE_SLEEP_MAX_S once the wait has lasted IDLE_AFTER_S (a connection
# between bursts, waiting for the next frame or heartbeat). Measured with UCX_TLS=tcp over
# loopback between two processes on a 2-core VM: every wake-up costs ~18 us of CPU there (a bare
# 1 ms sleep loop alone used 1.8% of a core), so an idle receive thread costs ~1% of a core at a
# 2 ms cap (1.8% at 1 ms), and the first frame after a silence waits at most 2 ms more. A
# 64-byte round trip (header and payload each way) took ~0.12 ms median whatever the spin when
# the callers' threads posted their requests, ~0.3 ms with delayed submission (``UcxNode``);
# plain TCP sockets: 0.02 ms. 64 MiB went at ~1.4 GB/s either way.
SPIN_S = 50e-6
SLEEP_MIN_S = 20e-6
SLEEP_MAX_S = 1e-3
IDLE_AFTER_S = 0.1
IDLE_SLEEP_MAX_S = 2e-3

_CONTROL = struct.Struct("<BQ")  # tagged message beside the stream: kind, stream byte count
_END = 1  # the sender has shut down writing after this many stream bytes
_ACK = 2  # the sender has read all it wants; the receiver of the ACK may close


def unavailable_reason() -> str | None:
    """Why UCX cannot be used here, or None when it can.

    Returns:
        None when ucxx imports; else a sentence naming the import error and how to install it.
    """
    if _IMPORT_ERROR is None:
        return None
    return (
        "UCX transport unavailable: "
        f"importing ucxx failed ({type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}); "
        "install smddp's ucx extra where smddpd runs (pip install '.[ucx]' in smddp's checkout)"
    )


class _Backoff:
    """Paces a thread polling a request: yields first, then sleeps longer and longer."""

    def __init__(self) -> None:
        now = time.monotonic()
        self._spin_until = now + SPIN_S
        self._idle_from = now + IDLE_AFTER_S
        self._sleep = SLEEP_MIN_S

    def pause(self) -> None:
        now = time.monotonic()
        if now < self._spin_until:
            time.sleep(0)
            return
        time.sleep(self._sleep)
        cap = SLEEP_MAX_S if now < self._idle_from else IDLE_SLEEP_MAX_S
        self._sleep = min(self._sleep * 2, cap)


class UcxConnection:
    """A UCX stream endpoint that behaves like the blocking TCP socket the peer code expects.

    One thread may receive while others send. Errors: ``TimeoutError`` when a transfer made no
    progress within the timeout, ``ConnectionError`` when the peer is gone, closed or shut down
    writing (the end of its stream), or when this connection broke or was closed before.
    """

    def __init__(self, node: UcxNode, endpoint: Any, peer: str) -> None:
        self._node = node
        self._ep = endpoint
        self._peer = peer
        self._timeout: float | None = None
        self._send_lock = threading.Lock()  # one sender at a time keeps the stream's bytes in order
        self._recv_lock = threading.Lock()
        self._lock = threading.Lock()  # the fields below
        self._requests: list[tuple[Any, Any]] = []  # posted requests and the buffers they use
        self._broken: str | None = None
        self._closing = False  # close() began: no new transfers
        self._closed = False  # the endpoint is closed: nothing is posted any more
        self._write_shut = False
        self._sent = 0  # stream bytes whose sends completed
        self._received = 0  # stream bytes that receives completed
        self._eof = False  # a receive met the end of the peer's stream
        self._tag = secrets.randbits(64)  # this side receives END and ACK on it
        self._peer_tag: int | None = None  # ... and sends them on this one (from the handshake)
        self._peer_end: int | None = None  # the peer's stream length, from its END
        self._peer_acked = False
        self._acked = False
        self._control: tuple[Any, bytearray] | None = None  # the posted receive of END or ACK
        self._lingered: threading.Event | None = None  # set once a clean close() is through
        self._post_control()

    # -- the socket interface ---------------------------------------------------------------

    def settimeout(self, seconds: float | None) -> None:
        """How long a transfer may make no progress before ``TimeoutError``; None: forever."""
        if seconds is not None and seconds < 0:
            raise ValueError(f"timeout must be None or >= 0, not {seconds}")
        self._timeout = seconds

    def getpeername(self) -> str:
        """The peer: the ``host:port`` connected to, or the address an accepted peer came from."""
        return self._peer

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        """Sends every byte of ``data`` (any C-contiguous buffer).

        Raises:
            TimeoutError: no piece completed within the timeout (the connection is then broken).
            ConnectionError: the peer is gone, or this side shut down writing, closed or broke.
        """
        view = memoryview(data).cast("B")
        with self._send_lock:
            self._check_usable("send to")
            if self._write_shut:
                raise BrokenPipeError(f"UCX connection to {self._peer}: shut down for writing")
            if len(view):
                self._transfer(self._ep.stream_send, view, receiving=False)

    def recv_into(self, view: memoryview) -> int:
        """Fills all of ``view`` from the stream.

        Returns:
            ``len(view)``; 0 at once for an empty view.

        Raises:
            TimeoutError: no piece completed within the timeout (the connection is then broken).
            ConnectionError: the peer ended its stream (its shutdown or close) before ``view``
                was full, the peer is gone, or this connection was closed or broke.
        """
        view = memoryview(view).cast("B")
        if view.readonly:
            raise TypeError("recv_into() needs a writable buffer")
        if not len(view):
            return 0
        with self._recv_lock:
            self._check_usable("receive from")
            self._poll_control()
            if self._eof or self._peer_end == self._received:
                self._at_end()
                raise ConnectionError(f"UCX connection to {self._peer}: closed by the peer")
            self._transfer(self._ep.stream_recv, view, receiving=True)
        return len(view)

    def shutdown(self, how: int) -> None:
        """``SHUT_WR``/``SHUT_RDWR``: ends this side's stream; the peer's receive then ends.

        ``SHUT_RD`` alone does nothing: UCX cannot refuse the peer's bytes, and those not read
        are dropped when the connection closes, as a socket's would be.

        Raises:
            ConnectionError: the connection broke or was closed.
        """
        if how not in (socket.SHUT_RD, socket.SHUT_WR, socket.SHUT_RDWR):
            raise ValueError(f"unknown shutdown mode {how}")
        self._check_usable("shut down")
        if how != socket.SHUT_RD:
            self._shutdown_write(self._timeout)

    def close(self) -> None:
        """Ends the stream if needed and closes; idempotent.

        Returns at once, like a socket's close: a thread of its own waits (at most ``LINGER_S``)
        for the peer to confirm it read everything before the endpoint closes. A broken
        connection closes at once (whatever was in flight is lost, as with a reset).
        """
        with self._lock:
            if self._closing:
                return
            clean = self._broken is None
            self._closing = True
        if clean and self._ep.alive:
            deadline = time.monotonic() + (
                LINGER_S if self._timeout is None else min(self._timeout, LINGER_S)
            )
            try:
                self._shutdown_write(max(0.0, deadline - time.monotonic()))
            except OSError:
                pass  # the close is abortive after all
            else:
                self._lingered = done = threading.Event()
                threading.Thread(
                    target=self._linger, args=(deadline, done), name="smddp-ucx-linger", daemon=True
                ).start()
                return
        self._abort()

    # -- transfers --------------------------------------------------------------------------

    def _transfer(self, post: Callable[[Any], Any], view: memoryview, receiving: bool) -> None:
        """Posts ``view`` in pieces and waits for them in order; the caller holds its lock."""
        n, posted, done = len(view), 0, 0
        start = self._received if receiving else self._sent
        in_flight: deque[tuple[Any, int]] = deque()
        deadline = self._deadline()
        while done < n:
            while posted < n and len(in_flight) < PIECES_IN_FLIGHT:
                end = min(posted + PIECE_BYTES, n)
                buffer = Array(view[posted:end])
                with self._lock:
                    if self._closing:
                        raise ConnectionError(f"UCX connection to {self._peer}: closed")
                    request = post(buffer)
                    self._requests.append((request, buffer))
                in_flight.append((request, end))
                posted = end
            request, end = in_flight[0]
            self._wait(request, deadline, start + end if receiving else None)
            in_flight.popleft()
            with self._lock:
                if receiving:
                    self._received += end - done
                else:
                    self._sent += end - done
            done = end
            deadline = self._deadline()
        self._prune()

    def _deadline(self) -> float | None:
        return None if self._timeout is None else time.monotonic() + self._timeout

    def _wait(self, request: Any, deadline: float | None, stream_end: int | None) -> None:
        """Waits for ``request``; ``stream_end``: where a receive ends in the peer's stream.

        Raises:
            TimeoutError, ConnectionError: the connection is broken from then on.
        """
        backoff = _Backoff()
        while not request.completed:
            if stream_end is not None:
                self._poll_control()
                if self._peer_end is not None and self._peer_end < stream_end:
                    self._at_end()
                    detail = "closed by the peer in the middle of a message"
                    raise ConnectionError(f"UCX connection to {self._peer}: {detail}")
            if not self._ep.alive:
                # A request posted after the endpoint failed may never complete: do not wait for it.
                raise self._fail(f"connection broke ({self._endpoint_error()})")
            if self._closing:
                raise self._fail("closed while a transfer was waiting")
            if deadline is not None and time.monotonic() >= deadline:
                what = "receiving" if stream_end is not None else "sending"
                raise self._fail(f"no progress {what} for {self._timeout:g} s", timeout=True)
            backoff.pause()
        try:
            request.check_error()
        except Exception as exc:  # ucxx's exceptions do not share a base class with OSError
            detail = (
                self._endpoint_error() if not self._ep.alive else f"{type(exc).__name__}: {exc}"
            )
            raise self._fail(f"connection broke ({detail})") from None

    def _fail(self, detail: str, timeout: bool = False) -> OSError:
        """Marks the connection broken; returns the exception to raise."""
        with self._lock:
            if self._broken is None:
                self._broken = detail
        message = f"UCX connection to {self._peer}: {detail}"
        return TimeoutError(message) if timeout else ConnectionError(message)

    def _check_usable(self, what: str) -> None:
        with self._lock:
            if self._closing:
                raise ConnectionError(f"cannot {what} {self._peer}: the UCX connection is closed")
            if self._broken is not None:
                raise ConnectionError(
                    f"cannot {what} {self._peer}: the UCX connection broke ({self._broken})"
                )

    def _endpoint_error(self) -> str:
        """What UCX says went wrong with the endpoint, without ucxx's endpoint address."""
        try:
            self._ep.raise_on_error()
        except Exception as exc:
            return f"{type(exc).__name__}: {str(exc).rpartition(' error: ')[2]}"
        return "endpoint closed"

    def _prune(self) -> None:
        with self._lock:
            self._requests = [(r, b) for r, b in self._requests if not r.completed]

    # -- handshake and end of stream --------------------------------------------------------

    def _hello(self) -> bytes:
        """This side's handshake message."""
        return _HELLO.pack(HANDSHAKE_MAGIC, self._tag)

    def _take_hello(self, data: bytes) -> None:
        """Checks the peer's handshake message and learns its tag."""
        magic, tag = _HELLO.unpack(data)
        if magic != HANDSHAKE_MAGIC:
            raise ConnectionError(f"not an smddp UCX peer (it sent {data!r})")
        self._peer_tag = tag

    def _post_control(self) -> None:
        """Posts the receive of the next END or ACK; the caller may hold _lock."""
        data = bytearray(_CONTROL.size)
        buffer = Array(data)
        request = self._ep.tag_recv(buffer, ucx_api.UCXXTag(self._tag))
        self._control = (request, data)
        self._requests.append((request, buffer))

    def _poll_control(self) -> None:
        """Takes in an END or ACK that arrived, and posts the receive of the next one."""
        with self._lock:
            if self._control is None or not self._control[0].completed:
                return
            request, data = self._control
            self._control = None
            try:
                request.check_error()
                kind, count = _CONTROL.unpack(data)
            except Exception:
                return  # canceled by the endpoint's end: no more control messages
            if kind == _END:
                self._peer_end = count
            elif kind == _ACK:
                self._peer_acked = True
            if not self._closed:
                self._post_control()

    def _at_end(self) -> None:
        """The peer's stream ended here: no more receives; tell the peer it may close."""
        self._eof = True
        self._send_control(_ACK, self._received)

    def _send_control(self, kind: int, count: int) -> None:
        """Sends END or ACK (once each) without waiting for it to complete."""
        with self._lock:
            if self._closed or self._peer_tag is None or (kind == _ACK and self._acked):
                return  # no handshake, no peer that could wait for it
            self._acked = self._acked or kind == _ACK
            buffer = Array(bytearray(_CONTROL.pack(kind, count)))
            self._requests.append(
                (self._ep.tag_send(buffer, ucx_api.UCXXTag(self._peer_tag)), buffer)
            )

    def _shutdown_write(self, timeout: float | None) -> None:
        """Sends END once every send that started has completed."""
        if not self._send_lock.acquire(timeout=-1 if timeout is None else timeout):
            raise self._fail("shutdown waited too long for a send in progress", timeout=True)
        try:
            if not self._write_shut:
                self._write_shut = True
                self._send_control(_END, self._sent)
        finally:
            self._send_lock.release()

    def _linger(self, deadline: float, done: threading.Event) -> None:
        """After our END: waits for the peer's ACK, its close or the deadline; then closes."""
        try:
            backoff = _Backoff()
            while self._ep.alive and not self._closed and time.monotonic() < deadline:
                self._poll_control()
                if self._peer_end is not None:
                    self._send_control(_ACK, self._received)  # we read no more: the peer may close
                if self._peer_acked:
                    break
                backoff.pause()
        finally:
            self._abort()
            done.set()

    def _abort(self) -> None:
        """Closes the endpoint (canceling what is posted) and keeps what is still in flight."""
        with self._lock:
            if self._closed:
                return
            self._closing = self._closed = True
            if self._broken is None:
                self._broken = "closed"
        try:
            self._ep.close_blocking(CLOSE_PERIOD_NS, 1)
        except Exception as exc:
            log.debug("closing the UCX endpoint to %s: %s", self._peer, exc)
        with self._lock:
            stuck = [(r, b) for r, b in self._requests if not r.completed]
            self._requests = []
        self._node._forget(self, stuck)


class UcxNode:
    """One UCX context and worker for the daemon, its progress thread, and a listener.

    Args:
        port: the port to listen on, on every interface (0: one the system picks).
        on_connection: called with each accepted connection and a description of its peer,
            on a new thread of its own, after the handshake.

    Raises:
        RuntimeError: ucxx is not installed, or UCX does not start (its configuration).
        OSError: the listener could not be created (the message names the port).
    """

    def __init__(self, port: int, on_connection: Callable[[UcxConnection, str], None]) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        self._on_connection = on_connection
        self._lock = threading.Lock()
        self._connections: set[UcxConnection] = set()
        self._in_flight: list[tuple[Any, Any]] = []  # of closed connections, until stop()
        self._stopped = False
        feature = ucx_api.Feature
        try:
            self._context = ucx_api.UCXContext(
                feature_flags=(feature.STREAM, feature.TAG, feature.WAKEUP)
            )
            # Delayed submission: the progress thread posts every request. Posting from the
            # callers' threads (the worker is thread-safe, UCS_THREAD_MODE_MULTI) was faster (a
            # 64-byte round trip ~0.12 ms against ~0.3 ms) but left a send stuck now and then
            # while the progress thread slept: the peer then saw its connection silent and the
            # job failed at its first op (6 of 45 runs of the node-loss test in namespaces;
            # 0 of 35 with delayed submission).
            self._worker = ucx_api.UCXWorker(self._context, enable_delayed_submission=True)
            self._worker.start_progress_thread(polling_mode=False)
        except Exception as exc:  # e.g. UCX_TLS names no transport this host has
            raise RuntimeError(f"cannot start UCX: {type(exc).__name__}: {exc}") from None
        try:
            self._listener = ucx_api.UCXListener.create(self._worker, port, self._on_request)
        except Exception as exc:
            self._worker.stop_progress_thread()
            hint = " (is the port in use?)" if port else ""
            raise OSError(
                f"cannot listen for UCX connections on port {port}: {exc}{hint}"
            ) from None
        self.port: int = self._listener.port

    def connect(self, host: str, port: int, timeout: float, server_name: str = "") -> UcxConnection:
        """Connects to the node listening at ``host:port`` and completes the handshake.

        ``server_name`` is the node id a TLS certificate would have to name; UCX carries no
        TLS, so it is unused (it keeps ``tcp_transport.TcpNode``'s shape).

        Returns:
            The connection, in blocking mode (no timeout).

        Raises:
            TimeoutError: no greeting came from ``host:port`` within ``timeout`` seconds.
            ConnectionError: ``host:port`` refused, is unreachable, or is not an smddp node.
        """
        with self._lock:
            if self._stopped:
                raise ConnectionError(f"cannot connect to {host}:{port}: the UCX node is stopped")
        try:
            endpoint = ucx_api.UCXEndpoint.create(self._worker, host, port, True)
        except Exception as exc:
            raise ConnectionError(f"cannot connect to {host}:{port} over UCX: {exc}") from None
        conn = self._adopt(endpoint, f"{host}:{port}")
        conn.settimeout(timeout)
        try:
            greeting = bytearray(_HELLO.size)
            conn.recv_into(memoryview(greeting))
            conn._take_hello(bytes(greeting))
            conn.sendall(conn._hello())
        except TimeoutError:
            conn.close()
            raise TimeoutError(f"no UCX answer from {host}:{port} within {timeout:g} s") from None
        except OSError as exc:
            conn.close()
            raise ConnectionError(f"cannot connect to {host}:{port} over UCX: {exc}") from None
        conn.settimeout(None)
        return conn

    def stop(self) -> None:
        """Closes every connection and the listener, and stops the progress thread; idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            connections = list(self._connections)
        grace = time.monotonic() + STOP_GRACE_S
        for conn in connections:
            # Closed before: give each peer a moment to read the rest.
            if conn._lingered is not None:
                conn._lingered.wait(max(0.0, grace - time.monotonic()))
        for conn in connections:
            conn._abort()
        self._listener = None  # its destruction stops listening
        self._worker.stop_progress_thread()
        with self._lock:
            # Nothing progresses the worker any more: UCX writes into none of these buffers.
            self._in_flight.clear()

    # -- internals --------------------------------------------------------------------------

    def _adopt(self, endpoint: Any, peer: str) -> UcxConnection:
        conn = UcxConnection(self, endpoint, peer)
        with self._lock:
            self._connections.add(conn)
        return conn

    def _forget(self, conn: UcxConnection, in_flight: list[tuple[Any, Any]]) -> None:
        with self._lock:
            self._connections.discard(conn)
            self._in_flight = [(r, b) for r, b in self._in_flight if not r.completed] + in_flight

    def _on_request(self, conn_request: int) -> None:
        """The listener's callback, on UCX's progress thread: make the endpoint, hand it over."""
        try:
            if self._stopped:
                return
            peer = _client_address(conn_request)
            endpoint = self._listener.create_endpoint_from_conn_request(conn_request, True)
        except Exception as exc:  # the client gave up already; nothing must escape into ucxx
            log.debug("dropped a UCX connection request: %s", exc)
            return
        threading.Thread(
            target=self._accept, args=(endpoint, peer), name="smddp-ucx-accept", daemon=True
        ).start()

    def _accept(self, endpoint: Any, peer: str) -> None:
        try:
            conn = self._adopt(endpoint, peer)
        except Exception as exc:
            log.debug("dropped a UCX connection from %s: %s", peer, exc)
            return
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            conn.sendall(conn._hello())
            answer = bytearray(_HELLO.size)
            conn.recv_into(memoryview(answer))
            conn._take_hello(bytes(answer))
        except OSError as exc:
            log.info("dropped a UCX connection from %s: %s", peer, exc)
            conn.close()
            return
        conn.settimeout(None)
        try:
            self._on_connection(conn, peer)
        except Exception:
            log.exception("handling the UCX connection from %s failed", peer)
            conn.close()


class _ConnRequestAttr(ctypes.Structure):
    # ucp_conn_request_attr_t of ucp.h. UCX fills only the fields named in field_mask, so the
    # struct may grow in later versions without breaking this.
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("client_address", ctypes.c_ubyte * 128),  # struct sockaddr_storage
        ("client_id", ctypes.c_uint64),
    ]


_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR = 1
_conn_request_query: Any = None


def _client_address(conn_request: int) -> str:
    """``ip:port`` a connection request came from (ucxx does not expose it; UCX's C API does)."""
    global _conn_request_query
    try:
        if _conn_request_query is None:
            import libucx  # the wheel that ships the UCX libraries ucxx loaded

            libucp = ctypes.CDLL(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so"))
            query = libucp.ucp_conn_request_query
            query.argtypes = [ctypes.c_void_p, ctypes.POINTER(_ConnRequestAttr)]
            query.restype = ctypes.c_int8  # ucs_status_t is a packed enum
            _conn_request_query = query
        attr = _ConnRequestAttr(field_mask=_CONN_REQUEST_ATTR_FIELD_CLIENT_ADDR)
        if _conn_request_query(ctypes.c_void_p(conn_request), ctypes.byref(attr)) == 0:
            raw = bytes(attr.client_address)
            (family,) = struct.unpack_from("=H", raw)
            port = int.from_bytes(raw[2:4], "big")
            if family == socket.AF_INET:
                return f"{socket.inet_ntop(socket.AF_INET, raw[4:8])}:{port}"
            if family == socket.AF_INET6:
                return f"[{socket.inet_ntop(socket.AF_INET6, raw[8:24])}]:{port}"
    except Exception as exc:  # a UCX without the call, or another layout of its files
        log.debug("cannot tell where a UCX connection request came from: %s", exc)
    return "an unknown address"
