"""Daemon-to-daemon data connections, per communicator.

For every pair of nodes of a communicator the lower node asks the higher one's Peer service
(gRPC, ``peer_control``) to join, which checks the job token and the layout and answers with
its data port; the lower node then opens ``CONNECTIONS_PER_PEER`` data connections there, TCP
(TLS when configured, ``tcp_transport``) or UCX (``ucx_transport``, ``--peer-transport``), and
proves the token again on each. Frames then flow both ways (``peer_wire``): DATA, HEARTBEAT
(every second; a connection silent for ``HEARTBEAT_TIMEOUT_S`` means the peer is gone, which a
partition or a crashed host would otherwise hide for minutes) and BYE.

Liveness is judged on the data connections on purpose: if the data path to a node is broken,
the node counts as lost, whatever its control service says. Aborts travel over the Peer
service, so that they reach a node whose data connections are not up yet.

``CommPeers`` knows nothing of the communicator it serves: it is given the layout, the token
and a callback through which it reports a lost node (or a mailbox over budget); the
communicator calls ``abort``, ``failed`` and ``close`` on it.
"""

from __future__ import annotations

import functools
import hmac
import itertools
import logging
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Protocol

import grpc
import numpy as np

from smddp.core.wire import rank_list
from smddp.server import supervise
from smddp.server.domain import Layout
from smddp.server.errors import PeerError
from smddp.server.peer_control import PeerControl
from smddp.server.peer_wire import (
    FRAME_BYE,
    FRAME_DATA,
    FRAME_HEARTBEAT,
    HEADER,
    HELLO_OK,
    HELLO_REFUSED,
    HELLO_RETRY,
    Connection,
    Frame,
    answer,
    pack_header,
    pack_hello,
    parse_address,
    read_answer,
    read_hello,
    recv_exact,
    recv_into,
    token_proof,
    unpack_header,
)
from smddp.server.tcp_transport import TcpNode
from smddp.v1 import smddp_pb2 as pb

if TYPE_CHECKING:
    from smddp.server.limits import BufferAccount
    from smddp.server.metrics import Metrics

__all__ = [
    "CommPeers",
    "FRAME_DATA",
    "Frame",
    "PeerError",
    "PeerNetwork",
    "parse_address",
    "token_proof",
]

log = logging.getLogger(__name__)

CONNECTIONS_PER_PEER = 2
HEARTBEAT_PERIOD_S = 1.0
HEARTBEAT_TIMEOUT_S = 5.0
# An accepted connection's whole HELLO must arrive within this long (a peer daemon sends it
# at once, in one write).
HELLO_TIMEOUT_S = 5.0
CONNECT_RETRY_S = 0.1
ABORT_WAIT_S = 2.0  # how long a failing node waits for its Abort calls to be answered
# A frame up to this size (header included) goes out in one write; larger ones write their
# payloads where they lie, without a copy.
ONE_WRITE_BYTES = 64 << 10
STATUS_WAIT_S = 2.0  # how long a timed-out receive waits for the silent node's status

# Added to a TLS failure that is not a certificate refusal (e.g. TLS on one side only).
TLS_SETUP_HINT = " (do both daemons run with --tls-cert, --tls-key and --tls-ca of the same CA?)"
RETRYABLE_JOIN = frozenset(
    {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
)


def _frame_bytes(p: np.ndarray | bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
    """A payload as the socket writes it: an array as its bytes, where it lies."""
    if isinstance(p, np.ndarray):
        # As bytes: a memoryview cannot carry ml_dtypes' bfloat16 ('E').
        # (numpy declares ndarray.__buffer__ for Python 3.12+ only: ignore.)
        return memoryview(np.ascontiguousarray(p).view(np.uint8))  # type: ignore[arg-type]
    return p


# How CommPeers reports that the communicator must fail: an ErrorKind and the message.
class OnFailure(Protocol):
    """What fails the communicator (``Communicator.fail``): an ErrorKind, a message and the
    ranks known gone (a lost node's)."""

    def __call__(self, kind: int, message: str, *, failed_ranks: Sequence[int] = ()) -> None: ...


def _tls_refusal(details: str, tls: bool, node_id: str) -> str | None:
    """Why a failed Join will fail again, when gRPC's ``details`` tell of a TLS mismatch."""
    low = details.lower()
    if "hostname verification" in low:
        return (
            "TLS: "
            f"its certificate does not name node {node_id} (a daemon's certificate must carry its node id as a DNS subject alternative name): "  # noqa: E501
            f"{details}"
        )
    if "handshake failed" in low:
        hint = "" if "certificate_verify_failed" in low else TLS_SETUP_HINT
        return f"TLS handshake failed: {details}{hint}"
    if "socket closed" in low:
        # A daemon closes a connection unanswered when the TLS handshake fails on its side.
        if tls:
            return (
                "it closed the connection in the TLS handshake: "
                "does it trust our certificate's CA (--tls-ca)? "
                f"({details})"
            )
        return (
            "it closed our connection unanswered: "
            "it takes peer connections over TLS only (--tls-cert), and this daemon has no TLS"
        )
    return None


class CommPeers:
    """The connections of one communicator to its other nodes, and its mailbox."""

    def __init__(
        self,
        layout: Layout,
        token: bytes,
        timeout_s: float,
        network: PeerNetwork,
        on_failure: OnFailure,
        buffers: BufferAccount | None = None,
        metrics: Metrics | None = None,
        excluded: Sequence[int] = (),
    ) -> None:
        """Starts connecting to the nodes of higher index, and the heartbeat.

        Args:
            layout: the communicator's nodes; ``layout.specs`` names each node's daemon.
            token: the job's token, whose proof every connection and Peer call carries.
            timeout_s: how long connecting, and each receive, may take.
            on_failure: called with an ErrorKind and a message when a node is lost or a send
                arrives that the mailbox may not hold; the communicator fails with them.
            buffers: the job's budget for sends that arrive before their receive is posted.
            excluded: a communicator made by shrink_group: the parent's ranks it left out,
                which every node's daemon must name alike (``Join`` compares them).
        """
        self.layout = layout
        self.excluded = tuple(excluded)
        self.network = network
        self.my_node = layout.my_node
        self.node_ids = layout.node_ids()
        self.addresses = [s.peer_address for s in layout.specs]
        self.timeout_s = timeout_s
        self.proof = token_proof(token, layout.job_id, layout.comm_id)
        self._on_failure = on_failure
        self._buffers = buffers
        self._metrics = metrics
        self._socks: dict[int, list[Connection]] = {}
        self._send_locks: dict[Connection, threading.Lock] = {}
        self._rr = itertools.count()
        self._mail: dict[tuple[object, ...], Frame] = {}
        self._mail_p2p_bytes = 0  # of p2p frames in _mail: counted against the job's budget
        self._waiters: dict[tuple[object, ...], Callable[[Frame], None]] = {}
        # Called (outside the lock) with the first chunk of each message that another node
        # sent before its receive was posted, once it is in the mailbox: the communicator
        # matches it to a receive from any source.
        self.on_p2p_mail: Callable[[Frame], None] | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._failure: str | None = None
        self._gone: set[int] = set()  # nodes that said BYE on every connection
        self._byes: dict[int, int] = {}  # BYEs received per node
        self._lost_nodes: set[int] = set()  # counted once, though each connection may notice
        self._aborts: list[threading.Thread] = []  # Abort calls in flight
        for node in range(len(self.node_ids)):
            if node > self.my_node:
                threading.Thread(
                    target=self._connect, args=(node,), name="smddp-peer-connect", daemon=True
                ).start()
        threading.Thread(target=self._heartbeat, name="smddp-peer-heartbeat", daemon=True).start()

    # -- connections --------------------------------------------------------------------------

    def peer_nodes(self) -> list[int]:
        return [n for n in range(len(self.node_ids)) if n != self.my_node]

    def peer_request(self) -> pb.PeerRequest:
        """What every call to another node's Peer service starts with."""
        return pb.PeerRequest(
            job_id=self.layout.job_id,
            comm_id=self.layout.comm_id,
            node=self.my_node,
            proof=self.proof,
        )

    def accepts(self, proof: bytes, node: int) -> str | None:
        """Why a connection or Peer call from ``node`` with ``proof`` is refused, or None."""
        if not hmac.compare_digest(proof, self.proof):
            return f"wrong job token for job {self.layout.job_id}"
        if not 0 <= node < len(self.node_ids) or node == self.my_node:
            return f"node index {node} is not a peer of this node"
        return None

    def _join(self, node: int, deadline: float) -> int | None:
        """Asks ``node``'s Peer service to join; its data port, or None once the node is lost."""
        control, peer = self.network.control, self.peer_request()
        while not self._closed:
            try:
                timeout = max(0.1, min(HEARTBEAT_TIMEOUT_S, deadline - time.monotonic()))
                return control.join(
                    self.addresses[node],
                    self.node_ids[node],
                    peer,
                    self.node_ids,
                    self.network.transport,
                    self.network.exchange,
                    timeout,
                    self.excluded,
                )
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or str(exc.code())
                details = details.split("last error: ", 1)[
                    -1
                ]  # not gRPC's "failed to connect to all addresses"
            log.debug(
                "%s: joining node %s: %s: %s",
                self.layout.name(),
                self.node_ids[node],
                code,
                details,
            )
            refusal = _tls_refusal(details, self.network.tls, self.node_ids[node])
            if refusal is not None:
                self._lost(node, f"refused our connection: {refusal}")
                return None
            if code not in RETRYABLE_JOIN:
                self._lost(node, f"refused to join: {details}")
                return None
            if time.monotonic() > deadline:
                self._lost(
                    node, f"did not let this node join within {self.timeout_s:.0f} s ({details})"
                )
                return None
            time.sleep(CONNECT_RETRY_S)
        return None

    def _connect(self, node: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        port = self._join(node, deadline)
        if port is None:
            return
        host = parse_address(self.addresses[node])[0]
        hello = pack_hello(self.layout.job_id, self.layout.comm_id, self.my_node, self.proof)
        for _ in range(CONNECTIONS_PER_PEER):
            while not self._closed:
                sock: Connection | None = None
                try:
                    sock = self.network.dial(host, port, self.node_ids[node])
                    sock.sendall(hello)
                    status, message = read_answer(sock)
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
                    self._lost(
                        node,
                        f"did not accept a connection within {self.timeout_s:.0f} s ({message})",
                    )
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
        threading.Thread(
            target=self._receive, args=(node, sock), name="smddp-peer-recv", daemon=True
        ).start()

    def _lost(self, node: int, detail: str) -> None:
        """The connection to ``node`` failed (no answer in time, refused, broken, silent): counted
        as a connection error of that peer, and the communicator fails naming the node."""
        with self._cond:
            if self._closed or node in self._gone or node in self._lost_nodes:
                return
            self._lost_nodes.add(node)
        if self._metrics is not None:
            self._metrics.peer_errors.labels(self.node_ids[node]).inc()
        message = (
            f"{self.layout.name()}: "
            f"lost node {self.node_ids[node]} (daemon at {self.addresses[node]}): "
            f"{detail}"
        )
        self._on_failure(pb.RANK_FAILED, message, failed_ranks=self.layout.nodes[node])

    # -- sending ------------------------------------------------------------------------------

    def _socket_for(self, node: int, deadline: float) -> Connection:
        with self._cond:
            while not self._socks.get(node):
                self._check_open()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PeerError(
                        f"no connection to node {self.node_ids[node]} ({self.addresses[node]}) within {self.timeout_s:.0f} s"  # noqa: E501
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
        header = pack_header(
            ftype,
            self.my_node,
            nbytes,
            kind=r.kind,
            dtype=r.dtype,
            seq=r.seq,
            part=r.part,
            parts=r.parts,
            round_=round_,
            src_rank=src_rank,
            dst_rank=dst_rank,
            count=r.count,
            root=r.root,
            reduce_op=r.reduce_op,
            tag=r.tag,
        )
        sock = self._socket_for(node, time.monotonic() + self.timeout_s)
        small = nbytes <= ONE_WRITE_BYTES
        with self._send_locks[sock]:
            try:
                if small:
                    # One write per small frame: header and payload in one segment wake the
                    # receiving reader once (two writes cost a second syscall and, with
                    # TCP_NODELAY, a second segment); the copy is of 64 KiB at most.
                    sock.sendall(b"".join([header, *(_frame_bytes(p) for p in payloads)]))
                    payloads = []
                else:
                    sock.sendall(header)
                for p in payloads:
                    if len(p):
                        sock.sendall(_frame_bytes(p))
            except OSError as exc:
                raise PeerError(
                    f"sending to node {self.node_ids[node]} ({self.addresses[node]}) failed: {exc}",
                    failed_ranks=self.layout.nodes[node],
                ) from None
        if self._metrics is not None and nbytes:
            self._metrics.peer_bytes_sent.labels(self.node_ids[node]).inc(nbytes)

    def abort(
        self,
        kind: int,
        message: str,
        failed_ranks: Sequence[int] = (),
        on_answer: Callable[[int, Sequence[int]], object] | None = None,
        skip: Collection[int] = (),
    ) -> None:
        """Tells every peer node's Peer service (but those in ``skip``) that the communicator
        failed, with the ranks this node holds failed, without waiting.

        ``on_answer(node, ranks)`` gets each node's failed ranks from its answer, or none when
        it cannot be told (it is then dead, or its ranks have all left): either way that node
        has been heard from. ``close`` waits for these calls (up to ``ABORT_WAIT_S``) before it
        says BYE, so that the news arrives before the BYE, which would otherwise read as a
        clean leave. A node that cannot be told learns it anyway: its data connections break
        or fall silent.
        """
        control, peer = self.network.control, self.peer_request()

        def tell(node: int) -> None:
            answer: Sequence[int] = ()
            try:
                answer = control.abort(
                    self.addresses[node],
                    self.node_ids[node],
                    peer,
                    kind,
                    message,
                    ABORT_WAIT_S,
                    failed_ranks,
                )
            except grpc.RpcError as exc:
                log.info(
                    "%s: could not tell node %s of the failure: %s",
                    self.layout.name(),
                    self.node_ids[node],
                    exc.details(),
                )
            if on_answer is not None:
                on_answer(node, answer)

        for node in self.peer_nodes():
            if node in skip:
                continue
            thread = threading.Thread(
                target=tell, args=(node,), name="smddp-peer-abort", daemon=True
            )
            thread.start()
            self._aborts.append(thread)

    def describe_node(self, node: int) -> str:
        """What ``node`` says it waits for, from its Peer service, as a sentence."""
        name = f"node {self.node_ids[node]}"
        try:
            status = self.network.control.status(
                self.addresses[node], self.node_ids[node], self.peer_request(), STATUS_WAIT_S
            )
        except grpc.RpcError as exc:
            return f"{name} does not answer either ({exc.details() or exc.code()})"
        if status.failed:
            return f"{name} says the communicator failed there: {status.failed}"
        if not status.pending:
            ranks = list(self.layout.nodes[node])
            return f"{name} says {rank_list(ranks)} {'has' if len(ranks) == 1 else 'have'} not called it ({status.ops_completed} ops completed there)"  # noqa: E501
        waits = [
            f"op #{p.seq} {p.description} waits for {rank_list(list(p.missing_ranks))} since {p.waited_seconds:.1f} s"  # noqa: E501
            for p in status.pending
        ]
        return f"{name} says " + "; ".join(waits)

    def _heartbeat(self) -> None:
        header = pack_header(FRAME_HEARTBEAT, self.my_node)
        while not self._closed:
            time.sleep(HEARTBEAT_PERIOD_S)
            with supervise.unit("sending heartbeats to other nodes", self.layout.name()):
                self._beat(header)

    def _beat(self, header: bytes) -> None:
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
                frame, nbytes = unpack_header(recv_exact(sock, HEADER.size))
                if frame.src_node != node:
                    raise ConnectionError("malformed frame header")
                frame.payload = np.empty(nbytes, dtype=np.uint8)
                # numpy declares ndarray.__buffer__ for Python 3.12+ only.
                recv_into(sock, memoryview(frame.payload))  # type: ignore[arg-type]
                frame.arrived = time.monotonic()
                ftype = frame.ftype
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
                # A frame whose delivery raises fails its communicator; the connection reads on.
                with supervise.unit(
                    "delivering a frame from another node",
                    self.layout.name(),
                    on_error=functools.partial(self._internal_error, node),
                ):
                    self._deliver(frame)
        except TimeoutError:
            if not said_bye:
                self._lost(
                    node,
                    f"silent for {HEARTBEAT_TIMEOUT_S:.0f} s (no heartbeat: partitioned or hung)",
                )
        except (OSError, ConnectionError, struct.error) as exc:
            if not said_bye:
                self._lost(node, f"connection broke ({exc})")
        finally:
            sock.close()

    def _internal_error(self, node: int, exc: Exception) -> None:
        """Fails the communicator for an exception met delivering ``node``'s frame."""
        self._on_failure(
            pb.INVALID,
            f"{self.layout.name()}: "
            f"internal error in smddpd while delivering a frame from node {self.node_ids[node]} ({type(exc).__name__}: {exc}); "  # noqa: E501
            "the communicator cannot go on",
        )

    def _deliver(self, frame: Frame) -> None:
        if frame.kind in (pb.SEND, pb.RECV):
            key: tuple[object, ...] = ("p", frame.src_rank, frame.dst_rank, frame.seq, frame.part)
        else:
            key = ("c", frame.seq, frame.part, frame.round, frame.src_node)
        over = ""
        with self._cond:
            waiter = self._waiters.pop(key, None)
            if waiter is None:
                # A send that came before its recv was posted waits here, within the job's
                # budget; beyond it the communicator fails (the sender already went on).
                buffers, nbytes = self._buffers, frame.payload.nbytes
                if key[0] == "p" and buffers is not None:
                    if buffers.try_take(nbytes):
                        self._mail_p2p_bytes += nbytes
                    else:
                        over = buffers.limit_text(nbytes)
                if not over:
                    self._mail[key] = frame
                    self._cond.notify_all()
        if over:
            self._on_failure(
                pb.INVALID,
                f"{self.layout.name()}: "
                f"rank {frame.src_rank} on node {self.node_ids[frame.src_node]} sent {frame.payload.nbytes} bytes to rank {frame.dst_rank} before it posted the receive, and this daemon may hold no more: "  # noqa: E501
                f"{over}",
            )
        if waiter is not None:
            waiter(frame)
        elif not over and key[0] == "p" and frame.kind == pb.SEND and frame.part == 0:
            hook = self.on_p2p_mail
            if hook is not None:
                hook(frame)  # a receive from any source may be waiting for it

    def recv(self, seq: int, part: int, round_: int, node: int) -> Frame:
        """Blocks until node ``node``'s frame for (seq, part, round) arrives.

        Raises:
            PeerError: timeout or communicator failure.
        """
        key = ("c", seq, part, round_, node)
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while key not in self._mail:
                self._check_open()
                if node in self._gone:
                    raise PeerError(
                        f"op #{seq}: "
                        f"the ranks of node {self.node_ids[node]} have all left the communicator",
                        failed_ranks=self.layout.nodes[node],
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(min(remaining, 0.5))
            else:
                return self._mail.pop(key)
        # Outside the lock: ask the silent node what holds it up, to name the rank.
        raise PeerError(
            f"op #{seq}: node {self.node_ids[node]} sent nothing within {self.timeout_s:.0f} s: "
            f"{self.describe_node(node)}",
            kind=pb.TIMEOUT,
        )

    def on_p2p(
        self, src_rank: int, dst_rank: int, seq: int, part: int, callback: Callable[[Frame], None]
    ) -> None:
        """Calls ``callback`` with the matching p2p frame, now or when it arrives."""
        key = ("p", src_rank, dst_rank, seq, part)
        with self._cond:
            frame = self._mail.pop(key, None)
            if frame is None:
                self._waiters[key] = callback
                return
            self._release_p2p(frame.payload.nbytes)
        callback(frame)

    def peek_p2p(self, src_rank: int, dst_rank: int, seq: int) -> Frame | None:
        """The first chunk of message ``seq`` from ``src_rank`` to ``dst_rank`` if it has
        arrived and waits in the mailbox (left there), else None."""
        with self._cond:
            return self._mail.get(("p", src_rank, dst_rank, seq, 0))

    def _release_p2p(self, nbytes: int) -> None:
        """Gives back the budget of a p2p frame that left the mailbox (lock held)."""
        if self._buffers is not None and self._mail_p2p_bytes:
            self._mail_p2p_bytes -= nbytes
            self._buffers.give(nbytes)

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
        if self._buffers is not None and self._mail_p2p_bytes:
            self._buffers.give(self._mail_p2p_bytes)
        self._mail_p2p_bytes = 0

    def close(self) -> None:
        """Says BYE on every connection and half-closes it.

        The receive threads keep reading until the peer closes its side too, so that nothing
        the peer still sends is answered with a reset that could destroy data in flight.
        """
        bye = pack_header(FRAME_BYE, self.my_node)
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
    """This daemon's side of the network between node daemons: the calls to other daemons'
    Peer services, and the transport their data connections arrive on (``TcpNode``, or
    ``UcxNode`` beside it).

    Accepted data connections start with a HELLO naming the job, communicator and node, with
    the token's proof; ``handshake`` hands them to their communicator's ``CommPeers`` or refuses
    them, logging why.
    """

    def __init__(
        self,
        host: str,
        data_port: int,
        transport: pb.Transport,
        find_peers: Callable[[str, str, bytes], CommPeers | None],
        control: PeerControl,
        ucx_port: int = 0,
        tls: tuple[ssl.SSLContext, ssl.SSLContext] | None = None,
        exchange: str = "",
    ) -> None:
        """``exchange``: ``DaemonConfig.exchange_settings()``, which a joining node must share."""
        self.transport = transport
        self.exchange = exchange
        self.control = control
        self.tls = tls is not None
        self._find = find_peers
        self._tcp = TcpNode(host, data_port, self.handshake, tls)
        self._ucx: Transport | None = None
        if transport == pb.UCX:
            from smddp.server.ucx_transport import UcxNode, unavailable_reason

            reason = unavailable_reason()
            if reason is not None:
                self._tcp.stop()
                raise RuntimeError(f"--peer-transport ucx: {reason}")
            self._ucx = UcxNode(ucx_port, self.handshake)
        self._transport: Transport = self._ucx or self._tcp
        self.tcp_port: int = self._tcp.port

    @property
    def data_port(self) -> int:
        """The port other daemons open data connections to, on this daemon's transport."""
        return self._transport.port

    def start(self) -> None:
        """Starts accepting TCP data connections (a UCX node accepts from its start)."""
        self._tcp.start()

    def stop(self) -> None:
        """Stops listening on every transport and closes the Peer channels."""
        self._tcp.stop()
        if self._ucx is not None:
            self._ucx.stop()
        self.control.close()

    def dial(self, host: str, port: int, node_id: str) -> Connection:
        """A data connection to the daemon of ``node_id`` at ``host:port``, before its HELLO.

        Raises:
            OSError: no connection (retry); ssl.SSLError: the TLS handshake failed.
        """
        return self._transport.connect(host, port, HEARTBEAT_TIMEOUT_S, node_id)

    def handshake(self, sock: Connection, who: str) -> None:
        """Reads an accepted data connection's HELLO; adopts the connection or refuses it."""
        try:
            hello = read_hello(sock, time.monotonic() + HELLO_TIMEOUT_S)
            peers = self._find(hello.job_id, hello.comm_id, hello.proof)
            if peers is None:
                answer(
                    sock,
                    HELLO_RETRY,
                    f"job {hello.job_id} comm {hello.comm_id} is not registered here yet",
                )
                sock.close()
                return
            refusal = peers.accepts(hello.proof, hello.node)
            if refusal is not None:
                log.warning("refused a peer connection from %s: %s", who, refusal)
                answer(sock, HELLO_REFUSED, refusal)
                sock.close()
                return
            answer(sock, HELLO_OK, "")
            peers.adopt(hello.node, sock)
        except (OSError, ConnectionError, UnicodeDecodeError, struct.error) as exc:
            log.warning("refused a peer connection from %s: %s", who, exc)
            sock.close()


class Transport(Protocol):
    """What ``TcpNode`` and ``UcxNode`` both offer."""

    port: int

    def connect(
        self, host: str, port: int, timeout: float, server_name: str = ""
    ) -> Connection: ...
    def stop(self) -> None: ...
