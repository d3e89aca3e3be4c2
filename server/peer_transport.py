"""Daemon-to-daemon data connections, per communicator.

For every pair of nodes of a communicator the lower node asks the higher one's Peer service
(gRPC, ``peer_control``) to join, which checks the job token and the layout and answers with
its data port; the lower node then opens ``CONNECTIONS_PER_PEER`` data connections there, TCP
(TLS when configured) or UCX (``--peer-transport``), and proves the token again on each.
Frames then flow both ways: DATA (a header and the chunk's bytes, received straight into a
buffer), HEARTBEAT (every second; a connection silent for ``HEARTBEAT_TIMEOUT_S`` means the
peer is gone, which a partition or a crashed host would otherwise hide for minutes) and BYE.

Liveness is judged on the data connections on purpose: if the data path to a node is broken,
the node counts as lost, whatever its control service says. Aborts travel over the Peer
service, so that they reach a node whose data connections are not up yet.
"""

from __future__ import annotations

import errno
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
from typing import TYPE_CHECKING, Protocol

import grpc
import numpy as np

from smddp.server.logthrottle import refusals
from smddp.server.tls import TlsSocket
from smddp.v1 import smddp_pb2 as pb
from smddp.wire import rank_list

if TYPE_CHECKING:
    from smddp.server.communicator import Communicator
    from smddp.server.metrics import Metrics
    from smddp.server.peer_control import PeerControl
    from smddp.server.ucx_transport import UcxNode

log = logging.getLogger(__name__)

CONNECTIONS_PER_PEER = 2
HEARTBEAT_PERIOD_S = 1.0
HEARTBEAT_TIMEOUT_S = 5.0
CONNECT_RETRY_S = 0.1
ABORT_WAIT_S = 2.0  # how long a failing node waits for its Abort calls to be answered
STATUS_WAIT_S = 2.0  # how long a timed-out receive waits for the silent node's status

FRAME_DATA = 1
FRAME_HEARTBEAT = 3
FRAME_BYE = 4  # the sender's ranks have all left; its EOF that follows is not a failure

# magic, type, kind, dtype, reserved (0; it carried an ABORT frame's error kind before aborts
# moved to the Peer service), seq, part, parts, round, src rank, dst rank, count, root, reduce
# op, payload bytes, source node
HEADER = struct.Struct("!4sBBBBQIIIiiQiIQI")
MAGIC = b"SMDP"
HELLO = struct.Struct("!4sHHI")
HELLO_MAGIC = b"SMDH"
HELLO_OK, HELLO_RETRY, HELLO_REFUSED = 0, 1, 2
MAX_PAYLOAD = 1 << 34


# Added to a TLS failure that is not a certificate refusal (e.g. TLS on one side only).
TLS_SETUP_HINT = " (do both daemons run with --tls-cert, --tls-key and --tls-ca of the same CA?)"
RETRYABLE_JOIN = frozenset({grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def _tls_refusal(details: str, tls: bool, node_id: str) -> str | None:
    """Why a failed Join will fail again, when gRPC's ``details`` tell of a TLS mismatch."""
    low = details.lower()
    if "hostname verification" in low:
        return (
            f"TLS: its certificate does not name node {node_id} (a daemon's certificate must carry "
            f"its node id as a DNS subject alternative name): {details}"
        )
    if "handshake failed" in low:
        hint = "" if "certificate_verify_failed" in low else TLS_SETUP_HINT
        return f"TLS handshake failed: {details}{hint}"
    if "socket closed" in low:
        # A daemon closes a connection unanswered when the TLS handshake fails on its side.
        if tls:
            return f"it closed the connection in the TLS handshake: does it trust our certificate's CA (--tls-ca)? ({details})"
        return "it closed our connection unanswered: it takes peer connections over TLS only (--tls-cert), and this daemon has no TLS"
    return None


class Connection(Protocol):
    """What a data connection offers: a TCP socket, a ``TlsSocket`` or a ``UcxConnection``."""

    def settimeout(self, seconds: float | None) -> None: ...
    def sendall(self, data: bytes | bytearray | memoryview) -> None: ...
    def recv_into(self, view: memoryview) -> int: ...
    def shutdown(self, how: int) -> None: ...
    def close(self) -> None: ...


class PeerError(Exception):
    """A peer exchange could not complete; the message names the node."""

    def __init__(self, message: str, kind: int = pb.RANK_FAILED) -> None:
        super().__init__(message)
        self.kind = kind  # the ErrorKind the communicator fails with


@dataclass
class Frame:
    """One received frame: its header fields and payload."""

    ftype: int
    kind: int
    dtype: int
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


def _recv_into(sock: Connection, view: memoryview) -> None:
    """Fills ``view`` from ``sock``; raises ConnectionError if the peer closes first."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        got += k


def _recv_exact(sock: Connection, n: int) -> bytes:
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
        network: PeerNetwork,
    ) -> None:
        self.comm = comm
        self.network = network
        self.my_node = my_node
        self.node_ids = list(node_ids)
        self.addresses = list(addresses)
        self._metrics = metrics
        self._proof = token_proof(comm.token, comm.job_id, comm.comm_id)
        self._socks: dict[int, list[Connection]] = {}
        self._send_locks: dict[Connection, threading.Lock] = {}
        self._rr = itertools.count()
        self._mail: dict[tuple, Frame] = {}
        self._mail_p2p_bytes = 0  # of p2p frames in _mail: counted against the job's budget
        self._waiters: dict[tuple, Callable[[Frame], None]] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._failure: str | None = None
        self._gone: set[int] = set()  # nodes that said BYE on every connection
        self._byes: dict[int, int] = {}  # BYEs received per node
        self._aborts: list[threading.Thread] = []  # Abort calls in flight
        for node in range(len(node_ids)):
            if node > my_node:
                threading.Thread(target=self._connect, args=(node,), name="smddp-peer-connect", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="smddp-peer-heartbeat", daemon=True).start()

    # -- connections --------------------------------------------------------------------------

    def peer_nodes(self) -> list[int]:
        return [n for n in range(len(self.node_ids)) if n != self.my_node]

    def peer_request(self) -> pb.PeerRequest:
        """What every call to another node's Peer service starts with."""
        return pb.PeerRequest(job_id=self.comm.job_id, comm_id=self.comm.comm_id, node=self.my_node, proof=self._proof)

    def _join(self, node: int, deadline: float) -> int | None:
        """Asks ``node``'s Peer service to join; its data port, or None once the node is lost."""
        stub = self.network.control.stub(self.addresses[node], self.node_ids[node])
        request = pb.JoinRequest(peer=self.peer_request(), node_ids=self.node_ids, transport=self.network.transport)
        while not self._closed:
            try:
                timeout = max(0.1, min(HEARTBEAT_TIMEOUT_S, deadline - time.monotonic()))
                return stub.Join(request, timeout=timeout).data_port
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or str(exc.code())
                details = details.split("last error: ", 1)[-1]  # not gRPC's "failed to connect to all addresses"
            log.debug("%s: joining node %s: %s: %s", self.comm.name(), self.node_ids[node], code, details)
            refusal = _tls_refusal(details, self.network.tls, self.node_ids[node])
            if refusal is not None:
                self._lost(node, f"refused our connection: {refusal}")
                return None
            if code not in RETRYABLE_JOIN:
                self._lost(node, f"refused to join: {details}")
                return None
            if time.monotonic() > deadline:
                self._timed_out(node, f"did not let this node join within {self.comm.timeout_s:.0f} s ({details})")
                return None
            time.sleep(CONNECT_RETRY_S)
        return None

    def _connect(self, node: int) -> None:
        deadline = time.monotonic() + self.comm.timeout_s
        port = self._join(node, deadline)
        if port is None:
            return
        host = parse_address(self.addresses[node])[0]
        job, comm = self.comm.job_id.encode(), self.comm.comm_id.encode()
        hello = HELLO.pack(HELLO_MAGIC, len(job), len(comm), self.my_node) + job + comm + self._proof
        for _ in range(CONNECTIONS_PER_PEER):
            while not self._closed:
                sock: Connection | None = None
                try:
                    sock = self.network.dial(host, port, self.node_ids[node])
                    sock.sendall(hello)
                    status = _recv_exact(sock, 1)[0]
                    (n,) = struct.unpack("!H", _recv_exact(sock, 2))
                    message = _recv_exact(sock, n).decode(errors="replace")
                except ssl.SSLError as exc:
                    # Certificates do not change by retrying; TLS on one side only does not either.
                    hint = "" if isinstance(exc, ssl.SSLCertVerificationError) else TLS_SETUP_HINT
                    status, message = HELLO_REFUSED, f"TLS handshake failed: {exc}{hint}"
                except OSError as exc:
                    status, message = HELLO_RETRY, f"data connection to {host}:{port}: {exc}"
                if status == HELLO_OK and sock is not None:
                    self.adopt(node, sock)
                    break
                if sock is not None:
                    sock.close()
                if status == HELLO_REFUSED:
                    self._lost(node, f"refused our connection: {message}")
                    return
                if time.monotonic() > deadline:
                    self._timed_out(node, f"did not accept a connection within {self.comm.timeout_s:.0f} s ({message})")
                    return
                time.sleep(CONNECT_RETRY_S)

    def adopt(self, node: int, sock: Connection) -> None:
        """Takes an established, authenticated connection to ``node`` into service."""
        sock.settimeout(HEARTBEAT_TIMEOUT_S)
        with self._cond:
            if self._closed:
                sock.close()
                return
            self._socks.setdefault(node, []).append(sock)
            self._send_locks[sock] = threading.Lock()
            self._cond.notify_all()
        threading.Thread(target=self._receive, args=(node, sock), name="smddp-peer-recv", daemon=True).start()

    def _timed_out(self, node: int, detail: str) -> None:
        """Connecting to ``node`` ran out of time: counted as a connection error, node lost."""
        if self._metrics is not None:
            self._metrics.peer_errors.labels(self.node_ids[node]).inc()
        self._lost(node, detail)

    def _lost(self, node: int, detail: str) -> None:
        if self._closed or node in self._gone:
            return
        message = (
            f"{self.comm.name()}: lost node {self.node_ids[node]} (daemon at {self.addresses[node]}): {detail}"
        )
        self.comm.fail(pb.RANK_FAILED, message, propagate=True)

    # -- sending ------------------------------------------------------------------------------

    def _socket_for(self, node: int, deadline: float) -> Connection:
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
    ) -> None:
        """Sends one frame to ``node``; ``req`` gives the op fields of the header.

        Raises:
            PeerError: the node is unreachable or the communicator failed.
        """
        nbytes = sum(p.nbytes if isinstance(p, np.ndarray) else len(p) for p in payloads)
        r = req or pb.OpRequest()
        header = HEADER.pack(
            MAGIC, ftype, r.kind, r.dtype, 0, r.seq, r.part, r.parts, round_,
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
        """Tells every peer node's Peer service that the communicator failed, without waiting.

        ``close`` waits for these calls (up to ``ABORT_WAIT_S``) before it says BYE, so that
        the news arrives before the BYE, which would otherwise read as a clean leave. A node
        that cannot be told learns it anyway: its data connections break or fall silent.
        """
        request = pb.AbortRequest(peer=self.peer_request(), kind=kind, message=message[:65536])

        def tell(node: int) -> None:
            try:
                self.network.control.stub(self.addresses[node], self.node_ids[node]).Abort(request, timeout=ABORT_WAIT_S)
            except grpc.RpcError as exc:
                log.info("%s: could not tell node %s of the failure: %s", self.comm.name(), self.node_ids[node], exc.details())

        for node in self.peer_nodes():
            thread = threading.Thread(target=tell, args=(node,), name="smddp-peer-abort", daemon=True)
            thread.start()
            self._aborts.append(thread)

    def describe_node(self, node: int) -> str:
        """What ``node`` says it waits for, from its Peer service, as a sentence."""
        name = f"node {self.node_ids[node]}"
        try:
            stub = self.network.control.stub(self.addresses[node], self.node_ids[node])
            status = stub.PeerStatus(pb.PeerStatusRequest(peer=self.peer_request()), timeout=STATUS_WAIT_S).comm
        except grpc.RpcError as exc:
            return f"{name} does not answer either ({exc.details() or exc.code()})"
        if status.failed:
            return f"{name} says the communicator failed there: {status.failed}"
        if not status.pending:
            ranks = self.comm.nodes[node]
            return (
                f"{name} says {rank_list(ranks)} {'has' if len(ranks) == 1 else 'have'} not called it "
                f"({status.ops_completed} ops completed there)"
            )
        waits = [
            f"op #{p.seq} {p.description} waits for {rank_list(list(p.missing_ranks))} since {p.waited_seconds:.1f} s"
            for p in status.pending
        ]
        return f"{name} says " + "; ".join(waits)

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

    def _receive(self, node: int, sock: Connection) -> None:
        said_bye = False  # this connection's end, announced: its EOF is no failure
        try:
            while True:
                fields = HEADER.unpack(_recv_exact(sock, HEADER.size))
                (magic, ftype, kind, dtype, _reserved, seq, part, parts, round_, src_rank, dst_rank,
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
                if ftype != FRAME_DATA:
                    raise ConnectionError(f"unknown frame type {ftype}")
                if self._metrics is not None and nbytes:
                    self._metrics.peer_bytes_received.labels(self.node_ids[node]).inc(nbytes)
                frame = Frame(ftype, kind, dtype, seq, part, parts, round_, src_rank, dst_rank,
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
        over = ""
        with self._cond:
            waiter = self._waiters.pop(key, None)
            if waiter is None:
                # A send that came before its recv was posted waits here, within the job's
                # budget; beyond it the communicator fails (the sender already went on).
                buffers, nbytes = self.comm.buffers, frame.payload.nbytes
                if key[0] == "p" and buffers is not None:
                    if buffers.try_take(nbytes):
                        self._mail_p2p_bytes += nbytes
                    else:
                        over = buffers.limit_text(nbytes)
                if not over:
                    self._mail[key] = frame
                    self._cond.notify_all()
        if over:
            self.comm.fail(
                pb.INVALID,
                f"{self.comm.name()}: rank {frame.src_rank} on node {self.node_ids[frame.src_node]} sent "
                f"{frame.payload.nbytes} bytes to rank {frame.dst_rank} before it posted the receive, and "
                f"this daemon may hold no more: {over}",
            )
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
                    break
                self._cond.wait(min(remaining, 0.5))
            else:
                return self._mail.pop(key)
        # Outside the lock: ask the silent node what holds it up, to name the rank.
        raise PeerError(
            f"op #{seq}: node {self.node_ids[node]} sent nothing within {self.comm.timeout_s:.0f} s: "
            f"{self.describe_node(node)}",
            kind=pb.TIMEOUT,
        )

    def on_p2p(self, src_rank: int, dst_rank: int, seq: int, part: int, callback: Callable[[Frame], None]) -> None:
        """Calls ``callback`` with the matching p2p frame, now or when it arrives."""
        key = ("p", src_rank, dst_rank, seq, part)
        with self._cond:
            frame = self._mail.pop(key, None)
            if frame is None:
                self._waiters[key] = callback
                return
            self._release_p2p(frame.payload.nbytes)
        callback(frame)

    def _release_p2p(self, nbytes: int) -> None:
        """Gives back the budget of a p2p frame that left the mailbox (lock held)."""
        if self.comm.buffers is not None and self._mail_p2p_bytes:
            self._mail_p2p_bytes -= nbytes
            self.comm.buffers.give(nbytes)

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
            self._drop_p2p_mail()
            self._cond.notify_all()

    def _drop_p2p_mail(self) -> None:
        """Forgets the sends no recv will take (lock held): the communicator failed or closed."""
        for key in [k for k in self._mail if k[0] == "p"]:
            del self._mail[key]
        if self.comm.buffers is not None and self._mail_p2p_bytes:
            self.comm.buffers.give(self._mail_p2p_bytes)
        self._mail_p2p_bytes = 0

    def close(self) -> None:
        """Says BYE on every connection and half-closes it.

        The receive threads keep reading until the peer closes its side too, so that nothing
        the peer still sends is answered with a reset that could destroy data in flight.
        """
        bye = HEADER.pack(MAGIC, FRAME_BYE, 0, 0, 0, 0, 0, 0, 0, -1, -1, 0, 0, 0, 0, self.my_node)
        deadline = time.monotonic() + ABORT_WAIT_S
        for thread in self._aborts:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            self._closed = True
            self._drop_p2p_mail()
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


class PeerNetwork:
    """This daemon's side of the network between node daemons: the clients of other daemons'
    Peer services, and where their data connections are accepted (TCP, or UCX).

    Accepted data connections start with a HELLO naming the job, communicator and node, with
    the token's proof; ``handshake`` hands them to their communicator or refuses them,
    logging why.
    """

    def __init__(
        self,
        host: str,
        data_port: int,
        transport: int,
        find_comm: Callable[[str, str, bytes], Communicator | None],
        control: PeerControl,
        ucx_port: int = 0,
        tls: tuple[ssl.SSLContext, ssl.SSLContext] | None = None,
    ) -> None:
        self.transport = transport
        self.control = control
        self._find = find_comm
        self._server_tls, self._client_tls = tls if tls is not None else (None, None)
        self.tls = tls is not None
        self._stopping = False
        self._ucx: UcxNode | None = None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host or "0.0.0.0", data_port))
        except OSError as exc:
            self._sock.close()
            raise OSError(exc.errno, f"cannot listen for data connections on {host}:{data_port} (--data-port): {exc.strerror}") from None
        self._sock.listen(256)
        self.tcp_port: int = self._sock.getsockname()[1]
        if transport == pb.UCX:
            from smddp.server.ucx_transport import UcxNode, unavailable_reason

            reason = unavailable_reason()
            if reason is not None:
                self._sock.close()
                raise RuntimeError(f"--peer-transport ucx: {reason}")
            self._ucx = UcxNode(ucx_port, self.handshake)

    @property
    def data_port(self) -> int:
        """The port other daemons open data connections to, on this daemon's transport."""
        return self._ucx.port if self._ucx is not None else self.tcp_port

    def start(self) -> None:
        threading.Thread(target=self._accept_loop, name="smddp-peer-accept", daemon=True).start()

    def stop(self) -> None:
        self._stopping = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self._ucx is not None:
            self._ucx.stop()
        self.control.close()

    def dial(self, host: str, port: int, node_id: str) -> Connection:
        """A data connection to the daemon of ``node_id`` at ``host:port``, before its HELLO.

        Raises:
            OSError: no connection (retry); ssl.SSLError: the TLS handshake failed.
        """
        if self._ucx is not None:
            return self._ucx.connect(host, port, HEARTBEAT_TIMEOUT_S)
        sock = socket.create_connection((host, port), timeout=HEARTBEAT_TIMEOUT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._client_tls is None:
            return sock
        tls = TlsSocket(sock, self._client_tls, server_side=False, server_hostname=node_id)
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
                refusals.log(log, logging.WARNING, "peer accept failing", "cannot accept a peer data connection: %s; retrying", exc)
                time.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            backoff = 0.01
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._accept_tcp, args=(sock, f"{addr[0]}:{addr[1]}"), name="smddp-peer-hello", daemon=True).start()

    def _accept_tcp(self, sock: socket.socket, who: str) -> None:
        try:
            sock.settimeout(HEARTBEAT_TIMEOUT_S)
            if self._server_tls is not None:
                if sock.recv(len(HELLO_MAGIC), socket.MSG_PEEK | socket.MSG_WAITALL) == HELLO_MAGIC:
                    _answer(sock, HELLO_REFUSED, "this daemon takes peer connections over TLS only (--tls-cert)")
                    sock.close()
                    return
                tls = TlsSocket(sock, self._server_tls, server_side=True)
                tls.handshake()
                self.handshake(tls, who)
                return
        except (OSError, ConnectionError) as exc:
            log.warning("refused a peer connection from %s: %s", who, exc)
            sock.close()
            return
        self.handshake(sock, who)

    def handshake(self, sock: Connection, who: str) -> None:
        """Reads an accepted data connection's HELLO; adopts the connection or refuses it."""
        try:
            sock.settimeout(HEARTBEAT_TIMEOUT_S)
            magic, job_len, comm_len, node = HELLO.unpack(_recv_exact(sock, HELLO.size))
            if magic != HELLO_MAGIC:
                tls_hint = " (it speaks TLS: this daemon has no --tls-cert)" if magic[:2] == b"\x16\x03" else ""
                raise ConnectionError(f"not an smddp peer{tls_hint}")
            job_id = _recv_exact(sock, job_len).decode()
            comm_id = _recv_exact(sock, comm_len).decode()
            proof = _recv_exact(sock, 32)
            comm = self._find(job_id, comm_id, proof)
            peers = comm.peers if comm is not None else None
            if comm is None or peers is None:
                _answer(sock, HELLO_RETRY, f"job {job_id} comm {comm_id} is not registered here yet")
                sock.close()
                return
            if not hmac.compare_digest(proof, token_proof(comm.token, job_id, comm_id)):
                log.warning("refused a peer connection from %s: wrong job token for job %s", who, job_id)
                _answer(sock, HELLO_REFUSED, f"wrong job token for job {job_id}")
                sock.close()
                return
            if not 0 <= node < len(peers.node_ids) or node == peers.my_node:
                log.warning("refused a peer connection from %s: node index %d is not a peer", who, node)
                _answer(sock, HELLO_REFUSED, f"node index {node} is not a peer of this node")
                sock.close()
                return
            _answer(sock, HELLO_OK, "")
            peers.adopt(node, sock)
        except (OSError, ConnectionError, UnicodeDecodeError, struct.error) as exc:
            log.warning("refused a peer connection from %s: %s", who, exc)
            sock.close()


def _answer(sock: Connection, status: int, message: str) -> None:
    data = message.encode()
    sock.sendall(bytes([status]) + struct.pack("!H", len(data)) + data)
