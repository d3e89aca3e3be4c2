"""Daemon-to-daemon data connections over TCP, per communicator.

For every pair of nodes of a communicator the lower node opens ``SOCKETS_PER_PEER`` TCP
connections to the higher one and proves it knows the job token. Frames then flow both
ways: DATA (a header and the chunk's bytes, received with ``recv_into`` straight into a
buffer), ABORT (a failure on one node fails the communicator on all), and HEARTBEAT (every
second; a connection silent for ``HEARTBEAT_TIMEOUT_S`` means the peer is gone, which a
partition or a crashed host would otherwise hide for minutes).

Control travels on the same connections as the data on purpose: if the data path to a node
is broken, its control path must count as broken too.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from smddp.server.tls import TlsSocket
from smddp.v1 import smddp_pb2 as pb

if TYPE_CHECKING:
    from smddp.server.communicator import Communicator
    from smddp.server.metrics import Metrics

log = logging.getLogger(__name__)

SOCKETS_PER_PEER = 2
HEARTBEAT_PERIOD_S = 1.0
HEARTBEAT_TIMEOUT_S = 5.0
CONNECT_RETRY_S = 0.1

FRAME_DATA = 1
FRAME_ABORT = 2
FRAME_HEARTBEAT = 3
FRAME_BYE = 4  # the sender's ranks have all left; its EOF that follows is not a failure

# magic, type, kind, dtype, error kind, seq, part, parts, round, src rank, dst rank, count,
# root, reduce op, payload bytes, source node
HEADER = struct.Struct("!4sBBBBQIIIiiQiIQI")
MAGIC = b"SMDP"
HELLO = struct.Struct("!4sHHI")
HELLO_MAGIC = b"SMDH"
HELLO_OK, HELLO_RETRY, HELLO_REFUSED = 0, 1, 2
MAX_PAYLOAD = 1 << 34


class PeerError(Exception):
    """A peer exchange could not complete; the message names the node."""


@dataclass
class Frame:
    """One received frame: its header fields and payload."""

    ftype: int
    kind: int
    dtype: int
    error_kind: int
    seq: int
    part: int
    parts: int
    round: int
    src_rank: int
    dst_rank: int
    count: int
    root: int
    reduce_op: int
    src_node: int
    payload: np.ndarray

    def signature(self) -> tuple[int, ...]:
        count = 0 if self.kind == pb.ALL_TO_ALL else self.count
        return (self.kind, self.dtype, count, self.root, self.reduce_op, self.parts)


def token_proof(token: bytes, job_id: str, comm_id: str) -> bytes:
    """What a connecting daemon shows to prove it knows the job's token."""
    return hmac.new(token, f"smddp-peer-v1/{job_id}/{comm_id}".encode(), hashlib.sha256).digest()


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fills ``view`` from ``sock``; raises ConnectionError if the peer closes first."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        got += k


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` to a tuple (``[v6]:PORT`` too)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class CommPeers:
    """The connections of one communicator to its other nodes, and its mailbox."""

    def __init__(
        self,
        comm: Communicator,
        my_node: int,
        node_ids: Sequence[str],
        addresses: Sequence[str],
        metrics: Metrics | None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.comm = comm
        self._tls = tls
        self.my_node = my_node
        self.node_ids = list(node_ids)
        self.addresses = list(addresses)
        self._metrics = metrics
        self._proof = token_proof(comm.token, comm.job_id, comm.comm_id)
        self._socks: dict[int, list[socket.socket]] = {}
        self._send_locks: dict[socket.socket, threading.Lock] = {}
        self._rr = itertools.count()
        self._mail: dict[tuple, Frame] = {}
        self._waiters: dict[tuple, Callable[[Frame], None]] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._failure: str | None = None
        self._gone: set[int] = set()  # nodes that said BYE on every connection
        self._byes: dict[int, int] = {}  # BYEs received per node
        for node in range(len(node_ids)):
            if node > my_node:
                threading.Thread(target=self._connect, args=(node,), name="smddp-peer-connect", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="smddp-peer-heartbeat", daemon=True).start()

    # -- connections --------------------------------------------------------------------------

    def peer_nodes(self) -> list[int]:
        return [n for n in range(len(self.node_ids)) if n != self.my_node]

    def _connect(self, node: int) -> None:
        host, port = parse_address(self.addresses[node])
        deadline = time.monotonic() + self.comm.timeout_s
        for _ in range(SOCKETS_PER_PEER):
            while not self._closed:
                try:
                    sock = socket.create_connection((host, port), timeout=HEARTBEAT_TIMEOUT_S)
                    if self._tls is not None:
                        sock = TlsSocket(sock, self._tls, server_side=False)  # type: ignore[assignment]
                        sock.handshake()
                    job, comm = self.comm.job_id.encode(), self.comm.comm_id.encode()
                    sock.sendall(HELLO.pack(HELLO_MAGIC, len(job), len(comm), self.my_node) + job + comm + self._proof)
                    status = _recv_exact(sock, 1)[0]
                    (n,) = struct.unpack("!H", _recv_exact(sock, 2))
                    message = _recv_exact(sock, n).decode(errors="replace")
                except ssl.SSLError as exc:
                    # Certificates do not change by retrying; TLS on one side only does not either.
                    hint = "" if isinstance(exc, ssl.SSLCertVerificationError) else (
                        " (do both daemons run with --tls-cert, --tls-key and --tls-ca of the same CA?)"
                    )
                    status, message = HELLO_REFUSED, f"TLS handshake failed: {exc}{hint}"
                except OSError as exc:
                    status, message = HELLO_RETRY, str(exc)
                    sock = None  # type: ignore[assignment]
                if status == HELLO_OK:
                    self.adopt(node, sock)
                    break
                if sock is not None:
                    sock.close()
                if status == HELLO_REFUSED:
                    self._lost(node, f"refused our connection: {message}")
                    return
                if time.monotonic() > deadline:
                    if self._metrics is not None:
                        self._metrics.peer_errors.labels(self.node_ids[node]).inc()
                    self._lost(node, f"did not accept a connection within {self.comm.timeout_s:.0f} s ({message})")
                    return
                time.sleep(CONNECT_RETRY_S)

    def adopt(self, node: int, sock: socket.socket) -> None:
        """Takes an established, authenticated connection to ``node`` into service."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(HEARTBEAT_TIMEOUT_S)
        with self._cond:
            if self._closed:
                sock.close()
                return
            self._socks.setdefault(node, []).append(sock)
            self._send_locks[sock] = threading.Lock()
            self._cond.notify_all()
        threading.Thread(target=self._receive, args=(node, sock), name="smddp-peer-recv", daemon=True).start()

    def _lost(self, node: int, detail: str) -> None:
        if self._closed or node in self._gone:
            return
        message = (
            f"{self.comm.name()}: lost node {self.node_ids[node]} (daemon at {self.addresses[node]}): {detail}"
        )
        self.comm.fail(pb.RANK_FAILED, message, propagate=True)

    # -- sending ------------------------------------------------------------------------------

    def _socket_for(self, node: int, deadline: float) -> socket.socket:
        with self._cond:
            while not self._socks.get(node):
                self._check_open()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PeerError(
                        f"no connection to node {self.node_ids[node]} ({self.addresses[node]}) "
                        f"within {self.comm.timeout_s:.0f} s"
                    )
                self._cond.wait(min(remaining, 0.5))
            socks = self._socks[node]
            return socks[next(self._rr) % len(socks)]

    def send(
        self,
        node: int,
        ftype: int,
        req: pb.OpRequest | None,
        round_: int = 0,
        payloads: Sequence[np.ndarray | bytes] = (),
        src_rank: int = -1,
        dst_rank: int = -1,
        error_kind: int = 0,
    ) -> None:
        """Sends one frame to ``node``; ``req`` gives the op fields of the header.

        Raises:
            PeerError: the node is unreachable or the communicator failed.
        """
        nbytes = sum(p.nbytes if isinstance(p, np.ndarray) else len(p) for p in payloads)
        r = req or pb.OpRequest()
        header = HEADER.pack(
            MAGIC, ftype, r.kind, r.dtype, error_kind, r.seq, r.part, r.parts, round_,
            src_rank, dst_rank, r.count, r.root, r.reduce_op, nbytes, self.my_node,
        )
        sock = self._socket_for(node, time.monotonic() + self.comm.timeout_s)
        with self._send_locks[sock]:
            try:
                sock.sendall(header)
                for p in payloads:
                    if len(p):
                        # As bytes: a memoryview cannot carry ml_dtypes' bfloat16 ('E').
                        sock.sendall(memoryview(np.ascontiguousarray(p).view(np.uint8)) if isinstance(p, np.ndarray) else p)
            except OSError as exc:
                raise PeerError(f"sending to node {self.node_ids[node]} ({self.addresses[node]}) failed: {exc}") from None
        if self._metrics is not None and nbytes:
            self._metrics.peer_bytes_sent.labels(self.node_ids[node]).inc(nbytes)

    def abort(self, kind: int, message: str) -> None:
        """Tells every peer node that the communicator failed (best effort)."""
        data = message.encode()[:65536]
        for node in self.peer_nodes():
            with self._cond:
                socks = list(self._socks.get(node, ()))
            if not socks:
                continue
            header = HEADER.pack(MAGIC, FRAME_ABORT, 0, 0, kind, 0, 0, 0, 0, -1, -1, 0, 0, 0, len(data), self.my_node)
            with self._send_locks[socks[0]]:
                try:
                    socks[0].sendall(header + data)
                except OSError:
                    pass

    def _heartbeat(self) -> None:
        header = HEADER.pack(MAGIC, FRAME_HEARTBEAT, 0, 0, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 0, self.my_node)
        while not self._closed:
            time.sleep(HEARTBEAT_PERIOD_S)
            with self._cond:
                socks = [s for group in self._socks.values() for s in group]
            for sock in socks:
                lock = self._send_locks[sock]
                if lock.acquire(blocking=False):  # a socket busy sending is evidently alive
                    try:
                        sock.sendall(header)
                    except OSError:
                        pass
                    finally:
                        lock.release()

    # -- receiving ----------------------------------------------------------------------------

    def _receive(self, node: int, sock: socket.socket) -> None:
        said_bye = False  # this connection's end, announced: its EOF is no failure
        try:
            while True:
                fields = HEADER.unpack(_recv_exact(sock, HEADER.size))
                (magic, ftype, kind, dtype, error_kind, seq, part, parts, round_, src_rank, dst_rank,
                 count, root, reduce_op, nbytes, src_node) = fields
                if magic != MAGIC or src_node != node or nbytes > MAX_PAYLOAD:
                    raise ConnectionError("malformed frame header")
                payload = np.empty(nbytes, dtype=np.uint8)
                _recv_into(sock, memoryview(payload))
                if ftype == FRAME_HEARTBEAT:
                    continue
                if ftype == FRAME_BYE:
                    said_bye = True
                    with self._cond:
                        # The node's last frames may still travel on its other connections;
                        # it is gone once each of them has brought its BYE.
                        self._byes[node] = self._byes.get(node, 0) + 1
                        if self._byes[node] >= len(self._socks.get(node, ())):
                            self._gone.add(node)
                        self._cond.notify_all()
                    continue
                if self._metrics is not None and nbytes:
                    self._metrics.peer_bytes_received.labels(self.node_ids[node]).inc(nbytes)
                if ftype == FRAME_ABORT:
                    # Another node failed the communicator; it warns there. Here it is news only if an op
                    # was waiting (fail() then warns anyway), e.g. not when its ranks simply left.
                    self.comm.fail(error_kind or pb.ABORTED, payload.tobytes().decode(errors="replace"), propagate=False, log_level=logging.INFO)
                    continue
                frame = Frame(ftype, kind, dtype, error_kind, seq, part, parts, round_, src_rank, dst_rank,
                              count, root, reduce_op, src_node, payload)
                self._deliver(frame)
        except TimeoutError:
            if not said_bye:
                self._lost(node, f"silent for {HEARTBEAT_TIMEOUT_S:.0f} s (no heartbeat: partitioned or hung)")
        except (OSError, ConnectionError, struct.error) as exc:
            if not said_bye:
                self._lost(node, f"connection broke ({exc})")
        finally:
            sock.close()

    def _deliver(self, frame: Frame) -> None:
        if frame.kind in (pb.SEND, pb.RECV):
            key: tuple = ("p", frame.src_rank, frame.dst_rank, frame.seq, frame.part)
        else:
            key = ("c", frame.seq, frame.part, frame.round, frame.src_node)
        with self._cond:
            waiter = self._waiters.pop(key, None)
            if waiter is None:
                self._mail[key] = frame
                self._cond.notify_all()
        if waiter is not None:
            waiter(frame)

    def recv(self, seq: int, part: int, round_: int, node: int) -> Frame:
        """Blocks until node ``node``'s frame for (seq, part, round) arrives.

        Raises:
            PeerError: timeout or communicator failure.
        """
        key = ("c", seq, part, round_, node)
        deadline = time.monotonic() + self.comm.timeout_s
        with self._cond:
            while key not in self._mail:
                self._check_open()
                if node in self._gone:
                    raise PeerError(f"op #{seq}: the ranks of node {self.node_ids[node]} have all left the communicator")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PeerError(
                        f"op #{seq}: node {self.node_ids[node]} sent nothing within "
                        f"{self.comm.timeout_s:.0f} s (its ranks never arrived?)"
                    )
                self._cond.wait(min(remaining, 0.5))
            return self._mail.pop(key)

    def on_p2p(self, src_rank: int, dst_rank: int, seq: int, part: int, callback: Callable[[Frame], None]) -> None:
        """Calls ``callback`` with the matching p2p frame, now or when it arrives."""
        key = ("p", src_rank, dst_rank, seq, part)
        with self._cond:
            frame = self._mail.pop(key, None)
            if frame is None:
                self._waiters[key] = callback
                return
        callback(frame)

    def _check_open(self) -> None:
        if self._failure is not None:
            raise PeerError(self._failure)
        if self._closed:
            raise PeerError("the communicator is closed")

    # -- end ----------------------------------------------------------------------------------

    def failed(self, message: str) -> None:
        """Wakes every waiter: the communicator failed."""
        with self._cond:
            self._failure = message
            self._cond.notify_all()

    def close(self) -> None:
        """Says BYE on every connection and half-closes it.

        The receive threads keep reading until the peer closes its side too, so that nothing
        the peer still sends is answered with a reset that could destroy data in flight.
        """
        bye = HEADER.pack(MAGIC, FRAME_BYE, 0, 0, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 0, self.my_node)
        with self._cond:
            self._closed = True
            socks = [s for group in self._socks.values() for s in group]
            self._socks.clear()
            self._cond.notify_all()
        for sock in socks:
            with self._send_locks[sock]:
                try:
                    sock.sendall(bye)
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass


class PeerListener:
    """Accepts other daemons' connections and hands them to their communicators."""

    def __init__(
        self, bind: str, find_comm: Callable[[str, str], Communicator | None], tls: ssl.SSLContext | None = None
    ) -> None:
        host, port = parse_address(bind)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host or "0.0.0.0", port))
        self._sock.listen(256)
        self.port = self._sock.getsockname()[1]
        self._find = find_comm
        self._tls = tls
        self._stopping = False

    def start(self) -> None:
        threading.Thread(target=self._accept_loop, name="smddp-peer-accept", daemon=True).start()

    def stop(self) -> None:
        self._stopping = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._hello, args=(sock, addr), name="smddp-peer-hello", daemon=True).start()

    def _hello(self, sock: socket.socket, addr: tuple) -> None:
        def answer(status: int, message: str) -> None:
            data = message.encode()
            sock.sendall(bytes([status]) + struct.pack("!H", len(data)) + data)

        try:
            sock.settimeout(HEARTBEAT_TIMEOUT_S)
            if self._tls is not None:
                if sock.recv(len(HELLO_MAGIC), socket.MSG_PEEK | socket.MSG_WAITALL) == HELLO_MAGIC:
                    answer(HELLO_REFUSED, "this daemon takes peer connections over TLS only (--tls-cert)")
                    sock.close()
                    return
                sock = TlsSocket(sock, self._tls, server_side=True)  # type: ignore[assignment]
                sock.handshake()
            magic, job_len, comm_len, node = HELLO.unpack(_recv_exact(sock, HELLO.size))
            if magic != HELLO_MAGIC:
                tls_hint = " (it speaks TLS: this daemon has no --tls-cert)" if magic[:2] == b"\x16\x03" else ""
                raise ConnectionError(f"not an smddp peer{tls_hint}")
            job_id = _recv_exact(sock, job_len).decode()
            comm_id = _recv_exact(sock, comm_len).decode()
            proof = _recv_exact(sock, 32)
            comm = self._find(job_id, comm_id)
            peers = comm.peers if comm is not None else None
            if comm is None or peers is None:
                answer(HELLO_RETRY, f"job {job_id} comm {comm_id} is not registered here yet")
                sock.close()
                return
            if not hmac.compare_digest(proof, token_proof(comm.token, job_id, comm_id)):
                log.warning("refused a peer connection from %s: wrong job token for job %s", addr, job_id)
                answer(HELLO_REFUSED, f"wrong job token for job {job_id}")
                sock.close()
                return
            if not 0 <= node < len(peers.node_ids) or node == peers.my_node:
                log.warning("refused a peer connection from %s: node index %d is not a peer", addr, node)
                answer(HELLO_REFUSED, f"node index {node} is not a peer of this node")
                sock.close()
                return
            answer(HELLO_OK, "")
            peers.adopt(node, sock)
        except (OSError, ConnectionError, UnicodeDecodeError, struct.error) as exc:
            log.warning("refused a peer connection from %s: %s", addr, exc)
            sock.close()
