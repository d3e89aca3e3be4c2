"""Daemon-to-daemon data connections over UCX, shaped like the blocking sockets of the peer transport.

``UcxNode`` holds the daemon's one UCX context and worker, the worker's progress thread, and a
listener; ``UcxConnection`` is a UCX stream endpoint that offers what ``peer_transport`` calls on
a TCP socket (``settimeout``, ``sendall``, ``recv_into``, ``shutdown``, ``close``), so that the
same framing code runs over either.

Handshake. The accepting node speaks first: it sends ``HANDSHAKE`` (5 bytes) on every new
endpoint, and the connecting node answers with the same 5 bytes. ``connect()`` returns once the
greeting arrived and the answer left; the accepting node calls ``on_connection`` (on a thread of
its own) once the answer arrived. The connecting side must not send first: UCX creates client
endpoints lazily, and a stream send posted on an endpoint whose connection then fails before it
was ever established (nobody listens on the port yet, which is routine while the other daemon
starts) spins forever inside ``ucp_request_send`` (UCX 1.21, ucxx 0.52), taking the whole
process with it. A receive posted on such an endpoint fails cleanly instead, so the connecting
side waits for the greeting and sends only on an endpoint that has carried data.

End of stream. UCX has no half-close, and ucxx closes an endpoint that has error handling
(needed to notice a dead peer) with ``UCP_EP_CLOSE_FLAG_FORCE``, which drops bytes still in
flight and any the peer has not yet posted a receive for. So the end travels as UCX active
messages beside the stream: ``shutdown(SHUT_WR)`` sends END with the number of stream bytes
sent; the peer's ``recv_into`` raises ``ConnectionError`` once it has consumed exactly that many
(a socket's EOF) and answers ACK. ``close()`` shuts down writing if that was not done, and
lingers (at most ``LINGER_S``) until the peer's ACK, the peer's own close, or a dead endpoint,
before the forced close. Two nodes closing at once each answer the other's END, so neither waits.

Timeouts. ``settimeout`` bounds how long a transfer may make no progress, like the timeout of a
socket's ``recv_into``: transfers travel in pieces of at most ``PIECE_BYTES``, and each piece
that completes restarts the clock. A timeout or an error leaves the connection broken; every
later call raises ``ConnectionError`` at once. The buffers of requests abandoned that way stay
referenced until the endpoint's close cancelled them (or, for one that never completes, until
the node stops), so UCX never writes into freed memory.

Threads. ucxx's Python API has no blocking wait with a timeout, so a caller polls its request
(``_Backoff``); UCX's progress thread runs the transfers and submits every request (delayed
submission), so one thread may receive while others send on the same connection. Sends are
serialized by a lock of the connection.
"""

from __future__ import annotations

import ctypes
import logging
import os
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

HANDSHAKE = b"SMDU\x01"  # magic and protocol version; the accepting side sends it first

HANDSHAKE_TIMEOUT_S = 5.0  # how long an accepted endpoint may take to answer the greeting
LINGER_S = 5.0  # most a clean close() waits for the peer to confirm it has read everything
CLOSE_PERIOD_NS = 1_000_000_000  # most ucxx waits for its progress thread to close an endpoint

# Transfers travel in pieces so that a timeout means "no progress", not "slower than the
# whole buffer needs"; a few pieces stay posted so that the wire never waits for Python.
# Measured with UCX_TLS=tcp over loopback between two processes (2 cores): 64 MiB in one
# piece and in 4 MiB pieces, 4 posted, ran at the same ~1 GB/s.
PIECE_BYTES = 4 << 20
PIECES_IN_FLIGHT = 4

# Waiting for a request: yield for SPIN_S (a reply to a small message comes within a few tens
# of microseconds), then sleep from SLEEP_MIN_S doubling up to SLEEP_MAX_S. Measured (UCX_TLS=tcp,
# loopback, two processes): 64-byte round trip ~70 us median; a receive thread idle for 10 s
# used ~1% of one core at a 1 ms cap.
SPIN_S = 200e-6
SLEEP_MIN_S = 20e-6
SLEEP_MAX_S = 1e-3

_CONTROL = struct.Struct("<BQ")  # active message beside the stream: kind, stream byte count
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
        f"UCX transport unavailable: importing ucxx failed ({type(_IMPORT_ERROR).__name__}: "
        f"{_IMPORT_ERROR}); install it with pip install 'smddp[ucx]'"
    )


class _Backoff:
    """Paces a thread polling a request: yields first, then sleeps longer and longer."""

    def __init__(self) -> None:
        self._spin_until = time.monotonic() + SPIN_S
        self._sleep = SLEEP_MIN_S

    def pause(self) -> None:
        if time.monotonic() < self._spin_until:
            time.sleep(0)
            return
        time.sleep(self._sleep)
        self._sleep = min(self._sleep * 2, SLEEP_MAX_S)


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
        self._peer_end: int | None = None  # the peer's stream length, from its END
        self._peer_acked = False
        self._acked = False
        self._control: Any = None  # the posted receive of the next active message
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
        """Ends the stream if needed, lingers for the peer's ACK, and closes; idempotent.

        A broken connection closes at once (whatever was in flight is lost, as with a reset).
        """
        with self._lock:
            if self._closing:
                return
            clean = self._broken is None
            self._closing = True
        try:
            if clean and self._ep.alive:
                linger = LINGER_S if self._timeout is None else min(self._timeout, LINGER_S)
                self._linger(time.monotonic() + linger)
        except OSError:
            pass  # the close is abortive after all
        finally:
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
                    raise ConnectionError(
                        f"UCX connection to {self._peer}: closed by the peer in the middle of a message"
                    )
            if not self._ep.alive:
                # A request posted after the endpoint failed may never complete: do not wait for it.
                raise self._fail(f"connection broke ({self._endpoint_error()})")
            if self._closing:
                raise self._fail("closed while a transfer was waiting")
            if deadline is not None and time.monotonic() >= deadline:
                what = "receive from" if stream_end is not None else "send to"
                raise self._fail(f"{what} made no progress in {self._timeout:g} s", timeout=True)
            backoff.pause()
        try:
            request.check_error()
        except Exception as exc:  # ucxx's exceptions do not share a base class with OSError
            detail = self._endpoint_error() if not self._ep.alive else f"{type(exc).__name__}: {exc}"
            raise self._fail(f"connection broke ({detail})") from None

    def _fail(self, detail: str, timeout: bool = False) -> OSError:
        """Marks the connection broken; returns the exception to raise."""
        message = f"UCX connection to {self._peer}: {detail}"
        with self._lock:
            if self._broken is None:
                self._broken = message
        return TimeoutError(message) if timeout else ConnectionError(message)

    def _check_usable(self, what: str) -> None:
        with self._lock:
            if self._closing:
                raise ConnectionError(f"cannot {what} {self._peer}: the UCX connection is closed")
            if self._broken is not None:
                raise ConnectionError(f"cannot {what} {self._peer}: {self._broken}")

    def _endpoint_error(self) -> str:
        try:
            self._ep.raise_on_error()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "endpoint closed"

    def _prune(self) -> None:
        with self._lock:
            self._requests = [(r, b) for r, b in self._requests if not r.completed]

    # -- end of stream ----------------------------------------------------------------------

    def _post_control(self) -> None:
        """Posts the receive of the next active message (END or ACK); the caller may hold _lock."""
        request = self._ep.am_recv()
        self._control = request
        self._requests.append((request, None))

    def _poll_control(self) -> None:
        """Takes in an END or ACK that arrived, and posts the receive of the next one."""
        with self._lock:
            request = self._control
            if request is None or not request.completed:
                return
            self._control = None
            try:
                request.check_error()
                kind, count = _CONTROL.unpack(bytes(request.recv_buffer))
            except Exception:
                return  # canceled by the endpoint's end, or not ours: no more control messages
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
            if self._closed or (kind == _ACK and self._acked):
                return
            self._acked = self._acked or kind == _ACK
            buffer = Array(bytearray(_CONTROL.pack(kind, count)))
            self._requests.append((self._ep.am_send(buffer), buffer))

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

    def _linger(self, deadline: float) -> None:
        """Ends our stream and waits until the peer confirms it read it, closes, or time is up."""
        self._shutdown_write(max(0.0, deadline - time.monotonic()))
        backoff = _Backoff()
        while self._ep.alive and time.monotonic() < deadline:
            self._poll_control()
            if self._peer_end is not None:
                self._send_control(_ACK, self._received)  # we read no more: the peer may close
            if self._peer_acked:
                return
            backoff.pause()

    def _abort(self) -> None:
        """Closes the endpoint (canceling what is posted) and keeps what is still in flight."""
        with self._lock:
            self._closing = self._closed = True
            if self._broken is None:
                self._broken = f"UCX connection to {self._peer}: closed"
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
        RuntimeError: ucxx is not installed.
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
        self._context = ucx_api.UCXContext(feature_flags=(feature.STREAM, feature.AM, feature.WAKEUP))
        # Delayed submission: requests are posted by the progress thread, the one thread that
        # drives the worker, whichever thread asks.
        self._worker = ucx_api.UCXWorker(self._context, enable_delayed_submission=True)
        self._worker.start_progress_thread(polling_mode=False)
        try:
            self._listener = ucx_api.UCXListener.create(self._worker, port, self._on_request)
        except Exception as exc:
            self._worker.stop_progress_thread()
            raise OSError(f"cannot listen for UCX connections on port {port}: {exc}") from None
        self.port: int = self._listener.port

    def connect(self, host: str, port: int, timeout: float) -> UcxConnection:
        """Connects to the node listening at ``host:port`` and completes the handshake.

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
            greeting = bytearray(len(HANDSHAKE))
            conn.recv_into(memoryview(greeting))
            if greeting != HANDSHAKE:
                raise ConnectionError(f"it is not an smddp UCX listener (it sent {bytes(greeting)!r})")
            conn.sendall(HANDSHAKE)
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
        threading.Thread(target=self._accept, args=(endpoint, peer), name="smddp-ucx-accept", daemon=True).start()

    def _accept(self, endpoint: Any, peer: str) -> None:
        try:
            conn = self._adopt(endpoint, peer)
        except Exception as exc:
            log.debug("dropped a UCX connection from %s: %s", peer, exc)
            return
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            conn.sendall(HANDSHAKE)
            answer = bytearray(len(HANDSHAKE))
            conn.recv_into(memoryview(answer))
            if answer != HANDSHAKE:
                raise ConnectionError(f"not an smddp UCX peer (it sent {bytes(answer)!r})")
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
