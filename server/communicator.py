"""A communicator: the ranks of one process group, its numbered ops and their matching.

Every rank sends the chunks of op #k in order. When all ranks' requests for a chunk have
arrived, they must agree on kind, dtype, count, root and reduce op; then the chunk runs and
every rank gets a reply. A mismatch, a dead rank or a timeout fails the communicator: every
pending and later op of it fails on every rank with a message naming who did what.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

from smddp.core.region import S_DONE, S_SEQ
from smddp.core.wire import (
    COMBINED_KINDS,
    KIND_NAMES,
    P2P_KINDS,
    REDUCING_KINDS,
    ROOTED_KINDS,
    WIRE_CODES,
    describe_request,
    dtype_name,
    numpy_dtype,
    rank_list,
    reduce_op_check,
)
from smddp.server import hierarchical, host_collectives, supervise
from smddp.server.algorithms import Selector
from smddp.server.arena import Arena
from smddp.server.config import DaemonConfig
from smddp.server.control_region import ControlRegion, ImpossibleCounters, known_kind
from smddp.server.domain import Layout, NodeSpec, request_signature
from smddp.server.errors import (
    FailedPrecondition,
    InvalidRequest,
    OpMismatch,
    PeerError,
    SmddpError,
)
from smddp.server.logthrottle import refusals
from smddp.server.peer_wire import FRAME_DATA, Frame
from smddp.v1 import smddp_pb2 as pb

log = logging.getLogger(__name__)

# How often an ``arena_fds`` waiter looks again without being woken: every change it waits
# for (an attach, a failure, a rank leaving, the close) wakes it, so this only guards against
# a wake-up missed by some future path.
ARENA_WAIT_POLL_S = 5.0
# The longest a Failure call waits for the daemons of a communicator spanning nodes to have
# heard from each other (a peer that never answers is dead, and its ranks are then named by
# the lost-node failure each survivor's daemon detects for itself).
AGREE_WAIT_S = 5.0
# The longest one Failure call waits for that agreement: the rank asks again until it has it
# (or its own AGREE_WAIT_S is up), so no call holds a gRPC thread longer than this.
AGREE_SLICE_S = 0.5
# The longest error text a reply carries (characters; UTF-8 takes at most 4 bytes each), well
# inside the data socket's message limit (MAX_MESSAGE_BYTES, 1 MiB).
MAX_ERROR_CHARS = 64 << 10

if TYPE_CHECKING:
    from smddp.server.limits import BufferAccount
    from smddp.server.metrics import Metrics
    from smddp.server.peer_transport import CommPeers


class ReplyChannel(Protocol):
    """Where a session's op replies are written: the data socket or a gRPC Ops stream."""

    def send_reply(self, reply: pb.OpReply) -> None:
        """Delivers one reply; must not raise when the peer is gone."""


@dataclass(eq=False)
class Session:
    """A registered rank: identity, arena, reply channel and op bookkeeping."""

    session_id: str
    secret: bytes
    comm: Communicator
    rank: int
    global_rank: int
    # The rank's process as the kernel names it (SO_PEERCRED of its data-socket connection,
    # set at attach); 0 until then. Messages and status name this one.
    pid: int
    node_id: str
    arena_bytes: int
    arena: Arena | None = None
    channel: ReplyChannel | None = None
    uid: int | None = None  # the kernel's word, at attach; counted against it from then on
    peer_pid: int = 0  # the attached process as the kernel names it (SO_PEERCRED)
    # The pid the rank claimed at Register (any number it liked): named only until it attaches.
    claimed_pid: int = 0
    registered_at: float = field(default_factory=time.monotonic)
    ops_completed: int = 0
    closed: bool = False
    # The next (seq, part) this rank may send for collectives, and per (peer, kind) for p2p.
    next_collective: tuple[int, int] = (1, 0)
    next_p2p: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Held by this rank's Failure call while it waits for the daemons' agreement: one at a
    # time, so a rank cannot hold many of the daemon's gRPC threads (every job's) waiting.
    asking_failure: threading.Lock = field(default_factory=threading.Lock)

    def label(self) -> str:
        """``rank 2 (pid 4711, node n1)``, the way errors name a rank: the pid the kernel
        gave at attach; before it attached (a rank that never did, say), the one it claimed
        at Register, all there is (its registration's log line says it is unverified)."""
        return f"rank {self.rank} (pid {self.pid or self.claimed_pid}, node {self.node_id})"

    def log_fields(self) -> dict[str, object]:
        """``extra=`` for a log record about this rank: the JSON log's job, comm, rank, node."""
        return {
            "job": self.comm.job_id,
            "comm": self.comm.comm_id,
            "rank": self.rank,
            "node": self.node_id,
        }

    def reply(self, reply: pb.OpReply) -> None:
        """Sends a reply if the rank still has a channel."""
        channel = self.channel
        if channel is not None:
            channel.send_reply(reply)


class GpuOps(Protocol):
    """What a communicator asks of the daemon's GPU side (``gpu.GpuOps``)."""

    def execute(
        self,
        comm: Communicator,
        ranks: Sequence[int],
        sessions: Sequence[Session],
        reqs: Sequence[pb.OpRequest],
    ) -> None: ...

    def execute_across(
        self,
        comm: Communicator,
        ranks: Sequence[int],
        sessions: Sequence[Session],
        reqs: Sequence[pb.OpRequest],
        exchange: Callable[[dict[int, pb.OpRequest], dict[int, Arena]], None],
    ) -> None: ...

    def send_across(
        self,
        comm: Communicator,
        session: Session,
        req: pb.OpRequest,
        deliver: Callable[[pb.OpRequest, np.ndarray], None],
    ) -> None: ...

    def recv_across(
        self,
        comm: Communicator,
        session: Session,
        req: pb.OpRequest,
        subscribe: Callable[[int, Callable[[Frame], None]], None],
    ) -> None: ...

    def execute_p2p(
        self,
        comm: Communicator,
        sender: tuple[Session, pb.OpRequest],
        receiver: tuple[Session, pb.OpRequest],
    ) -> None: ...

    def release_rank(self, session: Session) -> None: ...

    def abort_comm(self, comm: Communicator) -> None: ...

    def release_comm(self, comm: Communicator) -> None: ...


class GpuSupply(Protocol):
    """The daemon's GPU side, owned by the daemon and handed down (``gpu_supply.DaemonGpu``)."""

    def ops(self, node_id: str = "") -> GpuOps:
        """The GPU ops, made at the first GPU op; FailedPrecondition where there are none."""
        ...

    def active(self) -> GpuOps | None:
        """The GPU ops if a GPU op has run, else None."""
        ...


class NoGpu:
    """A ``GpuSupply`` for a daemon made without one: GPU requests are refused."""

    def ops(self, node_id: str = "") -> GpuOps:
        raise FailedPrecondition(f"smddpd on node {node_id or '?'} was started without GPU support")

    def active(self) -> GpuOps | None:
        return None


@dataclass
class Pending:
    """One chunk that some ranks have submitted and others not yet."""

    key: tuple[object, ...]
    seq: int
    part: int
    participants: tuple[int, ...]
    first_arrival: float
    arrivals: dict[int, tuple[Session, pb.OpRequest, float]] = field(default_factory=dict)
    # A send that arrived before its recv: a copy of its data; the sender was answered already.
    sent: np.ndarray | None = None
    held_back: str = ""  # why such a send was not copied (the daemon's buffer limit)

    def missing(self) -> list[int]:
        return [r for r in self.participants if r not in self.arrivals]


@dataclass
class AnyWait:
    """A receive from any source that no send has matched yet (one per rank at most: the
    client sends its next receive only once this one has its reply)."""

    session: Session
    req: pb.OpRequest
    since: float  # time.monotonic() when it arrived


# The ``next_p2p`` slot that numbers a rank's receives from any source.
ANY_SOURCE = -1


def _gpu_bytes(req: pb.OpRequest) -> int:
    """Bytes a rank's GPU request contributes (its inputs), for the metrics."""
    return sum(b.nbytes for b in req.cuda.inputs)


class _P2PMessage(Protocol):
    @property
    def dtype(self) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def parts(self) -> int: ...
    @property
    def tag(self) -> int: ...


def p2p_signature(message: _P2PMessage) -> tuple[int, int, int, int]:
    """What a send and the receive it meets must agree on (a request, or a peer's frame)."""
    return (message.dtype, message.count, message.parts, message.tag)


class Communicator:
    """The ranks of one process group of one job, as registered with this daemon."""

    # The job's share of the bytes the daemon may hold for sends that wait for their
    # receives (set by the registry; None: unbounded).
    buffers: BufferAccount | None = None
    # Most entries of ``_pending`` (--max-pending-ops; set by the registry from the daemon's
    # configuration): a rank that runs further ahead of the others fails the communicator
    # rather than grow the daemon without bound.
    max_pending_ops: int = DaemonConfig.max_pending_ops

    def __init__(
        self,
        job_id: str,
        comm_id: str,
        world_size: int,
        token: bytes,
        timeout_s: float,
        chunk_bytes: int,
        metrics: Metrics | None = None,
        nodes: list[list[int]] | None = None,
        my_node: int = 0,
        specs: tuple[NodeSpec, ...] = (),
        gpu: GpuSupply | None = None,
    ) -> None:
        self.job_id = job_id
        self.comm_id = comm_id
        self.world_size = world_size
        self.token = token
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self.members: dict[int, Session] = {}
        # The communicator's ranks per node (all on this node unless the job spans nodes).
        self.nodes = nodes or [list(range(world_size))]
        self.my_node = my_node
        self.local_ranks = tuple(self.nodes[my_node])
        self._gpu: GpuSupply = gpu or NoGpu()
        self.layout = Layout(job_id, comm_id, tuple(tuple(r) for r in self.nodes), my_node, specs)
        # The algorithm between nodes per op and size (the registry sets SMDDP_ALGO's pins).
        self.algorithms = Selector(self.layout.name())
        self._remote = set(range(world_size)) - set(self.local_ranks)
        self.peers: CommPeers | None = None
        self._work: queue.Queue[Pending | None] | None = None
        self.ops_completed = 0
        self._metrics = metrics
        # Per op in progress: (time the first rank arrived at chunk 0, bytes so far).
        self._progress: dict[tuple[object, ...], tuple[float, int]] = {}
        self._pending: dict[tuple[object, ...], Pending] = {}
        # Receives from any source waiting for a send, by receiving rank (``_match_any``).
        self._any_waiting: dict[int, AnyWait] = {}
        self._failed: tuple[int, str] | None = None
        self._closed = False  # the last local rank left: nothing waits on it any more
        self._failure_counted = False  # smddp_errors_total has this communicator's failure
        self._left: list[str] = []
        # Set by the registry for a communicator made by shrink_group: the communicator it
        # replaces, the parent's ranks left out (parent numbering) and its generation.
        self.parent_comm_id = ""
        self.excluded: tuple[int, ...] = ()
        self.generation = 0
        # Set by the registry for a communicator made by smddp.grow: its ranks that joined.
        self.joined: tuple[int, ...] = ()
        # The ranks that left or died (a clean leave fails the others as well) and, once
        # failed, the set every survivor is told: this node's finding merged with each peer
        # node's until every peer has been heard from (``_agreed``), then frozen, so that every
        # rank that asks, whenever, hears the same set.
        self._gone: set[int] = set()
        self._failed_ranks: set[int] = set()
        self._heard: set[int] = set()  # peer nodes whose failed ranks are merged in
        self._agreed = threading.Event()
        self._lock = threading.Lock()
        self._attached = threading.Condition(self._lock)
        # The control region of a single-node communicator, made when a rank first asks.
        self.region: ControlRegion | None = None

    # -- membership -------------------------------------------------------------------------

    def name(self) -> str:
        """``job J comm C``, the prefix of every message about this communicator."""
        return f"job {self.job_id} comm {self.comm_id}"

    def add(self, session: Session) -> None:
        """Adds a registered rank (the registry has checked that its slot is free)."""
        with self._lock:
            self.members[session.rank] = session

    def remove(
        self,
        session: Session,
        why: str,
        kind: int,
        log_level: int = logging.WARNING,
        fail: bool = True,
        gone: bool = True,
    ) -> bool:
        """Removes a rank. Others' pending and later ops fail, since they can no longer complete.

        Args:
            fail: False for a rank that never took part (refused at attach): nobody fails.
            gone: False for a rank that left for the survivors' new group (shrink_group): it
                is not one of the failed ranks.

        Returns:
            True when no rank is left and the communicator can be forgotten.
        """
        with self._lock:
            if self.members.get(session.rank) is session:
                del self.members[session.rank]
            empty = not self.members
            if not empty and fail:
                self._left.append(why)
                if gone:
                    self._gone.add(session.rank)
            self._attached.notify_all()  # a peer-arenas request of the leaving rank ends
        gpu_ops = self._gpu.active()
        if gpu_ops is not None:
            gpu_ops.release_rank(session)  # its CUDA IPC mappings and events
        if not empty and fail:
            self.fail(kind, why, log_level, culprit=session)
        return empty

    def attached(self) -> None:
        """Called once a rank has mapped its arena: wakes ``arena_fds`` waiters."""
        with self._attached:
            self._attached.notify_all()

    def arena_fds(self, asker: Session | None = None) -> list[int]:
        """The arena memfds of the communicator's ranks on this node (all of them, unless it
        spans nodes) in rank order, then the control region's memfd, once all have attached.
        The region has one slot per rank on this node, in that order (``local_ranks``).

        Args:
            asker: the rank that asks; the wait ends when it leaves (its connection closed).

        Raises:
            FailedPrecondition: the communicator failed or closed, the asker left, or ranks
                did not attach within the timeout.
        """
        deadline = time.monotonic() + self.timeout_s
        with self._attached:
            while True:
                if self._failed is not None:
                    raise FailedPrecondition(self._failed[1])
                if self._closed:
                    raise FailedPrecondition(f"{self.name()}: the communicator was closed")
                if asker is not None and self.members.get(asker.rank) is not asker:
                    raise FailedPrecondition(
                        f"{self.name()}: "
                        f"{asker.label()} left while waiting for the other ranks' arenas"
                    )
                ready = [self.members.get(r) for r in self.local_ranks]
                if all(s is not None and s.arena is not None for s in ready):
                    if self.region is None:
                        self.region = ControlRegion(len(self.local_ranks))
                    return [s.arena.fd for s in ready] + [self.region.fd]  # type: ignore[union-attr]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = [
                        r for r, s in zip(self.local_ranks, ready) if s is None or s.arena is None
                    ]
                    raise FailedPrecondition(
                        f"{self.name()}: "
                        f"{rank_list(missing)} did not attach within {self.timeout_s:.0f} s"
                    )
                self._attached.wait(min(remaining, ARENA_WAIT_POLL_S))

    def failed(self) -> tuple[int, str] | None:
        """The error kind and message that failed the communicator, or None."""
        return self._failed

    def failure_record(
        self, wait_s: float = AGREE_WAIT_S
    ) -> tuple[int, str, tuple[int, ...], bool] | None:
        """The failure as every surviving rank is told it: kind, message, the failed ranks
        (ascending) and whether the daemons agreed on them; None while healthy.

        On several nodes it first waits, up to ``wait_s``, until every peer node's daemon has
        been heard from (its Abort received, or its answer to ours): from then on the set is
        frozen, the same on every node, whichever rank asks first.
        """
        if self._failed is None:
            return None
        agreed = self._agreed.wait(wait_s)
        with self._lock:
            assert self._failed is not None
            kind, message = self._failed
            # The kind may come from a rank's slot: one of the wire's, for the reply's enum.
            return known_kind(kind), message, tuple(sorted(self._failed_ranks)), agreed

    def merge_failed(self, node: int, ranks: Iterable[int]) -> tuple[int, ...]:
        """Takes in node ``node``'s failed ranks (from its Abort, or its answer to ours) while
        the set is not yet frozen; returns this node's set after it."""
        with self._lock:
            if not self._agreed.is_set():
                self._failed_ranks.update(r for r in ranks if 0 <= r < self.world_size)
                self._heard.add(node)
                self._agree_if_heard()
            return tuple(sorted(self._failed_ranks))

    def _agree_if_heard(self) -> None:
        """Freezes the failed set once every peer node has been heard from (lock held)."""
        peers = self.peers
        if self._failed is not None and (
            peers is None or self._heard.issuperset(peers.peer_nodes())
        ):
            self._agreed.set()

    # -- ops ----------------------------------------------------------------------------------

    def submit(self, session: Session, req: pb.OpRequest) -> None:
        """Takes one chunk from one rank; runs it when it is the last rank to arrive."""
        now = time.monotonic()
        failure = self._failed
        if failure is not None:
            # Once failed, every op gets the cause; a rank that gave up on an op midway
            # (a direct all_reduce) would otherwise be told its next op is out of order.
            self._reply_error(session, req, *failure)
            return
        try:
            self._validate(session, req)
        except SmddpError as exc:
            # A rank that sends an impossible op leaves the others waiting forever: fail all.
            self.fail(
                exc.kind,
                f"{self.name()}: {session.label()} sent an invalid op: {exc}",
                culprit=session,
            )
            self._count_op_failure()
            self._reply_error(session, req, exc.kind, str(exc))
            return
        with self._lock:
            failure = self._failed
            ready = None
            early = False
            too_far = ""
            if failure is None and req.any_source:
                bound = self._match_any(session, req, now)
                if bound is None:
                    return  # it waits for a send (``_offer_any``); check_timeouts bounds it
                req = bound
            if failure is None:
                key, participants = self._key(session, req)
                pending = self._pending.get(key)
                if pending is None and len(self._pending) >= self.max_pending_ops:
                    too_far = self._too_far_ahead(session, req)
            if failure is None and not too_far:
                if pending is None:
                    pending = Pending(key, req.seq, req.part, participants, now)
                    self._pending[key] = pending
                pending.arrivals[session.rank] = (session, req, now)
                if req.kind == pb.SEND and req.part == 0 and pending.missing():
                    self._offer_any(pending, session.rank, req.root, req.seq, req.tag)
                if not pending.missing():
                    del self._pending[key]
                    ready = pending
                elif req.kind == pb.SEND and len(participants) == 2 and not req.HasField("cuda"):
                    # Eager send: copy the chunk out and let the sender go on. Otherwise two
                    # ranks that isend to each other before receiving block on full arenas.
                    # Within the job's budget only: beyond it the send waits for its recv.
                    if self.buffers is None or self.buffers.try_take(req.input.nbytes):
                        try:
                            pending.sent = session.arena.view(  # type: ignore[union-attr]
                                req.input, numpy_dtype(req.dtype)
                            ).copy()
                            early = True
                        except SmddpError:
                            if self.buffers is not None:
                                self.buffers.give(
                                    req.input.nbytes
                                )  # a bad region is reported when the recv meets it
                    else:
                        pending.held_back = self.buffers.limit_text(req.input.nbytes)
                        refusals.log(
                            log,
                            logging.INFO,
                            "send held back",
                            "%s: %s's send of %d bytes to rank %d waits for its receive: %s",
                            self.name(),
                            session.label(),
                            req.input.nbytes,
                            req.root,
                            pending.held_back,
                        )
        if too_far:
            # As for an invalid op: the others would wait for ever, and this rank could go on
            # until the daemon runs out of memory. fail() drops every pending op and tells all.
            self.fail(pb.INVALID, too_far, culprit=session)
            self._count_op_failure()
            failure = self._failed
        if failure is not None:
            self._reply_error(session, req, *failure)
        elif ready is not None:
            self._run(ready)
        elif early:
            session.reply(pb.OpReply(request_id=req.request_id, ok=True))

    # -- receives from any source ---------------------------------------------------------
    #
    # Messages between two ranks are numbered by both (``seq``, per pair and direction), and
    # a plain receive meets the send of the same number. A receive from any source has its
    # own numbering; the daemon binds it to the sender whose next message to the receiver
    # (the number the receiver's next receive from it would have) came first, with the same
    # tag, and from then on it is that plain receive: the same number, matched, checked and
    # run by the usual paths, its reply naming the sender (``source_rank``). The client sends
    # nothing behind it until that reply is in, so the numbers it gives its later receives
    # from each rank agree with the daemon's, and a rank has one such receive waiting at most.
    # As gloo does, a message is taken by the receive posted first that accepts it, and the
    # tag selects: a sender whose next message has another tag is passed over.

    def _next_from(self, session: Session, src: int) -> int | None:
        """The number of the next message ``session``'s rank receives from ``src``, or None
        while a message from ``src`` is received part way (no whole message is next)."""
        with session.lock:
            seq, part = session.next_p2p.get((src, pb.RECV), (1, 0))
        return seq if part == 0 else None

    def _bind_any(self, session: Session, req: pb.OpRequest, src: int) -> pb.OpRequest:
        """``req`` (a receive from any source) as the plain receive of the next message from
        ``src``; the receiver's next receive from ``src`` comes after it. Lock held."""
        bound = pb.OpRequest()
        bound.CopyFrom(req)
        with session.lock:
            seq, _ = session.next_p2p.get((src, pb.RECV), (1, 0))
            session.next_p2p[(src, pb.RECV)] = (seq, 1) if req.parts > 1 else (seq + 1, 0)
        bound.root, bound.seq = src, seq
        return bound

    def _next_sends(self, session: Session) -> list[tuple[float, int, int]]:
        """(arrival time, sender, tag) of each rank's next message to ``session``'s rank
        that has come (its first chunk): from this node in ``_pending``, from another in the
        peers' mailbox. Lock held."""
        me = session.rank
        found = []
        for src in range(self.world_size):
            seq = self._next_from(session, src) if src != me else None
            if seq is None:
                continue
            if src in self._remote:
                frame = self.peers.peek_p2p(src, me, seq) if self.peers is not None else None
                if frame is not None:
                    found.append((frame.arrived, src, frame.tag))
            else:
                pending = self._pending.get(("p", src, me, seq, 0))
                sent = pending.arrivals.get(src) if pending is not None else None
                if sent is not None:
                    found.append((sent[2], src, sent[1].tag))
        return found

    def _match_any(self, session: Session, req: pb.OpRequest, now: float) -> pb.OpRequest | None:
        """A receive from any source, bound to the sender of the send that came first among
        those that can meet it now (``_bind_any``); or None, when none can and it waits in
        ``_any_waiting``. Lock held."""
        candidates = [(came, src) for came, src, tag in self._next_sends(session) if tag == req.tag]
        if not candidates:
            self._any_waiting[session.rank] = AnyWait(session, req, now)
            return None
        return self._bind_any(session, req, min(candidates)[1])

    def _offer_any(self, pending: Pending, src: int, dst: int, seq: int, tag: int) -> None:
        """A send from ``src`` on this node has come (its first chunk, in ``pending``): the
        receive from any source that ``dst`` has waiting takes it if it is ``dst``'s next
        message from ``src`` and has its tag. Lock held."""
        wait = self._any_waiting.get(dst)
        if wait is None or wait.req.tag != tag or self._next_from(wait.session, src) != seq:
            return
        del self._any_waiting[dst]
        bound = self._bind_any(wait.session, wait.req, src)
        pending.arrivals[dst] = (wait.session, bound, wait.since)

    def _offer_any_remote(self, frame: Frame) -> None:
        """A send from another node has come before its receive (``CommPeers.on_p2p_mail``):
        a receive from any source waiting for it binds to it and runs like any receive."""
        with self._lock:
            wait = self._any_waiting.get(frame.dst_rank)
            if (
                self._failed is not None
                or wait is None
                or wait.req.tag != frame.tag
                or self._next_from(wait.session, frame.src_rank) != frame.seq
            ):
                return
            del self._any_waiting[frame.dst_rank]
            req = self._bind_any(wait.session, wait.req, frame.src_rank)
            key, participants = self._key(wait.session, req)
            pending = Pending(key, req.seq, 0, participants, wait.since)
            pending.arrivals[wait.session.rank] = (wait.session, req, wait.since)
        self._run(pending)

    def _any_timed_out(self, now: float) -> str | None:
        """The message that fails the communicator for a receive from any source that no
        send met within the timeout; None if none is overdue. Lock held."""
        late = [w for w in self._any_waiting.values() if now - w.since > self.timeout_s]
        if not late:
            return None
        wait = min(late, key=lambda w: w.since)
        tag = wait.req.tag
        # Sends that came with another tag are passed over; saying so names the likely bug.
        came = sorted(self._next_sends(wait.session))
        others = [f"rank {src}'s has tag {t}" for _, src, t in came]
        message = (
            f"{self.name()}: "
            f"{wait.session.label()}'s receive #{wait.req.seq} from any source {describe_request(wait.req)} (tag {tag}) timed out: "  # noqa: E501
            f"no rank sent it a message with tag {tag} within the group's timeout of {self.timeout_s:.1f} s (it waited {now - wait.since:.1f} s)"  # noqa: E501
        )
        if others:
            message += f"; the next messages that came for it: {', '.join(others)}"
        return message

    def _too_far_ahead(self, session: Session, req: pb.OpRequest) -> str:
        """Why ``req`` may not wait for the other ranks: the communicator holds
        ``max_pending_ops`` already. Called with the lock held."""
        oldest = min(self._pending.values(), key=lambda p: (p.seq, p.part))
        behind = oldest.missing()
        sent = f"{describe_request(req)} as op #{req.seq} chunk {req.part}"
        who, n = session.label(), len(self._pending)
        oldest_op = f"the oldest, op #{oldest.seq}, for {rank_list(behind)}"
        limit = f"{self.max_pending_ops} pending op chunks per communicator"
        return (
            f"{self.name()}: "
            f"{who} sent {sent} while {n} op chunks already wait for other ranks ({oldest_op}): "
            f"past the limit of {limit} (--max-pending-ops, SMDDP_MAX_PENDING_OPS); "
            "a rank runs too far ahead of the others"
        )

    def _key(
        self, session: Session, req: pb.OpRequest
    ) -> tuple[tuple[object, ...], tuple[int, ...]]:
        if req.kind == pb.SEND:
            src, dst = session.rank, req.root
        elif req.kind == pb.RECV:
            src, dst = req.root, session.rank
        elif req.node_combined:
            return ("c", req.seq, req.part), (session.rank,)  # it carries the node's share
        else:
            return ("c", req.seq, req.part), self.local_ranks
        here = tuple(r for r in (src, dst) if r not in self._remote)
        return ("p", src, dst, req.seq, req.part), here

    def _validate(self, session: Session, req: pb.OpRequest) -> None:
        if req.kind not in KIND_NAMES:
            raise InvalidRequest(f"unknown op kind {req.kind}")
        if req.kind != pb.BARRIER and req.dtype not in WIRE_CODES:
            raise InvalidRequest(f"unknown dtype {req.dtype} in {KIND_NAMES[req.kind]}")
        if req.parts < 1 or req.part >= req.parts:
            raise InvalidRequest(f"chunk {req.part} of {req.parts} is impossible")
        if req.any_source:
            self._validate_any(session, req)
        elif (
            req.kind in ROOTED_KINDS or req.kind in P2P_KINDS
        ) and not 0 <= req.root < self.world_size:
            raise InvalidRequest(
                f"{describe_request(req)}: rank {req.root} is outside a world of {self.world_size}"
            )
        if req.kind in P2P_KINDS and req.root == session.rank and not req.any_source:
            raise InvalidRequest(
                f"{describe_request(req)}: a rank cannot send to or receive from itself"
            )
        if req.kind in REDUCING_KINDS:
            problem = reduce_op_check(req.dtype, req.reduce_op)
            if problem:
                raise InvalidRequest(problem)
        if session.arena is None and req.kind != pb.BARRIER:
            raise InvalidRequest("the rank has not attached its arena")
        if req.node_combined and (
            self.peers is None
            or req.kind not in COMBINED_KINDS
            or req.HasField("cuda")
            or session.rank != self.local_ranks[0]
        ):
            lowest = f"the lowest rank of a node (rank {self.local_ranks[0]})"
            raise InvalidRequest(
                f"{describe_request(req)}: "
                f"only {lowest} sends an op its node combined, and only an all_reduce, broadcast or barrier in host memory of a communicator spanning nodes"  # noqa: E501
            )
        # Chunks come in order; anything else is a client bug that would desynchronise ranks.
        with session.lock:
            if req.kind in P2P_KINDS:
                slot = (ANY_SOURCE if req.any_source else req.root, req.kind)
                expected = session.next_p2p.get(slot, (1, 0))
            else:
                expected = session.next_collective
            # Collectives that ran in the control region took sequence numbers too: a new op
            # may skip ahead, a chunk may not.
            skipped = (
                req.kind not in P2P_KINDS
                and req.part == 0
                and expected[1] == 0
                and req.seq > expected[0]
            )
            if (req.seq, req.part) != expected and not skipped:
                raise InvalidRequest(
                    f"{describe_request(req)} arrived as op #{req.seq} chunk {req.part}, but op #{expected[0]} chunk {expected[1]} was next"  # noqa: E501
                )
            following = (req.seq, req.part + 1) if req.part + 1 < req.parts else (req.seq + 1, 0)
            if req.any_source:
                following = (req.seq + 1, 0)  # its other chunks come as plain receives
            if req.kind in P2P_KINDS:
                session.next_p2p[slot] = following
            else:
                session.next_collective = following

    def _validate_any(self, session: Session, req: pb.OpRequest) -> None:
        """What a receive from any source must be (the chunk the client sends as one)."""
        if req.kind != pb.RECV or req.part != 0:
            raise InvalidRequest(
                f"{describe_request(req)} chunk {req.part}: "
                "only the first chunk of a receive comes from any source"
            )
        if req.HasField("cuda"):
            raise InvalidRequest(
                f"{describe_request(req)}: a receive from any source takes host memory only"
            )
        if session.rank in self._any_waiting:
            raise InvalidRequest(
                f"{describe_request(req)} arrived as receive #{req.seq} from any source while the one before it still waits for a send"  # noqa: E501
            )

    def attach_peers(self, peers: CommPeers) -> None:
        """Makes this a multi-node communicator: chunks run in order on a worker thread."""
        self.peers = peers
        peers.on_p2p_mail = self._offer_any_remote
        self._work = queue.Queue()
        threading.Thread(target=self._worker, name="smddp-comm-worker", daemon=True).start()

    def _worker(self) -> None:
        assert self._work is not None
        while True:
            pending = self._work.get()
            if pending is None:
                return
            self._supervised(pending)

    def _supervised(self, pending: Pending) -> None:
        """Runs a matched chunk; whatever it raises fails this communicator, not the thread
        that runs it (the worker, or a rank's connection)."""
        with supervise.unit(
            "running an op",
            self.name(),
            self._log_fields(),
            on_error=lambda exc: self.internal_error(f"running op #{pending.seq}", exc),
        ):
            self._execute(pending)

    def _run(self, pending: Pending) -> None:
        req = next(iter(pending.arrivals.values()))[1]
        if self.peers is None or (req.kind in P2P_KINDS and len(pending.participants) == 2):
            self._supervised(pending)
        elif req.kind in P2P_KINDS:
            self._run_remote_p2p(pending)
        else:
            # Network exchanges block; keep them off the ranks' reader threads and in order.
            assert self._work is not None
            self._work.put(pending)

    def _run_remote_p2p(self, pending: Pending) -> None:
        session, req, _ = next(iter(pending.arrivals.values()))
        assert self.peers is not None and session.arena is not None
        if req.HasField("cuda"):
            self._run_remote_gpu_p2p(pending, session, req)
            return
        if req.kind == pb.SEND:
            node = next(i for i, ranks in enumerate(self.nodes) if req.root in ranks)
            data = session.arena.view(req.input, numpy_dtype(req.dtype))

            def send() -> None:
                try:
                    self.peers.send(  # type: ignore[union-attr]
                        node, FRAME_DATA, req, 0, [data], src_rank=session.rank, dst_rank=req.root
                    )
                except PeerError as exc:
                    why = f"{self.name()}: {exc}"
                    self.fail(pb.RANK_FAILED, why, failed_ranks=exc.failed_ranks)
                    self._reply_error(session, req, pb.RANK_FAILED, f"{self.name()}: {exc}")
                    return
                self._finish(pending, [session], [req])

            assert self._work is not None
            threading.Thread(target=send, name="smddp-p2p-send", daemon=True).start()
            return

        def arrived(frame: Frame) -> None:
            try:
                if p2p_signature(frame) != p2p_signature(req):
                    sent = f"{frame.count} x {dtype_name(frame.dtype)} (tag {frame.tag})"
                    src = f"rank {req.root} as message #{req.seq}"
                    ours = f"{describe_request(req)} (tag {req.tag}) on {session.label()}"
                    raise InvalidRequest(f"send of {sent} from {src} meets {ours}")
                out = session.arena.view(req.output, numpy_dtype(req.dtype))  # type: ignore[union-attr]
                data = frame.payload.view(out.dtype)
                if data.size != out.size:
                    raise InvalidRequest(
                        f"send of {data.size} elements meets a recv of {out.size} elements"
                    )
                out[:] = data
            except SmddpError as exc:
                msg = f"{self.name()}: {exc}"
                self.fail(exc.kind, msg)
                self._reply_error(session, req, exc.kind, msg)
                return
            self._finish(pending, [session], [req])

        self.peers.on_p2p(req.root, session.rank, req.seq, req.part, arrived)

    def _run_remote_gpu_p2p(self, pending: Pending, session: Session, req: pb.OpRequest) -> None:
        """A GPU send or recv whose peer is on another node, on a thread of its own: the
        GPU ops stage it through pinned host memory, chunk by chunk, as frames of the same
        shape as a host send's."""
        peers = self.peers
        assert peers is not None

        def deliver(part: pb.OpRequest, data: np.ndarray) -> None:
            node = next(i for i, ranks in enumerate(self.nodes) if req.root in ranks)
            peers.send(node, FRAME_DATA, part, 0, [data], src_rank=session.rank, dst_rank=req.root)

        def subscribe(part: int, callback: Callable[[Frame], None]) -> None:
            peers.on_p2p(req.root, session.rank, req.seq, part, callback)

        def run() -> None:
            try:
                gpu_ops = self._gpu.ops(session.node_id)
                if req.kind == pb.SEND:
                    gpu_ops.send_across(self, session, req, deliver)
                else:
                    gpu_ops.recv_across(self, session, req, subscribe)
            except SmddpError as exc:
                msg = str(exc) if str(exc).startswith(self.name()) else f"{self.name()}: {exc}"
                self.fail(exc.kind, msg)
                self._count_op_failure()
                failure = self._failed or (exc.kind, msg)
                self._reply_error(session, req, *failure)
                return
            except Exception as exc:  # a bug in the daemon must fail the op, not hang the job
                what = describe_request(req)
                log.exception("%s: GPU %s failed", self.name(), what)
                msg = f"{self.name()}: internal error in smddpd running {what}: {exc!r}"
                self.fail(pb.INVALID, msg)
                self._count_op_failure()
                self._reply_error(session, req, pb.INVALID, msg)
                return
            self._finish(pending, [session], [req])

        threading.Thread(target=run, name="smddp-gpu-p2p", daemon=True).start()

    def _between_nodes(self, reqs: dict[int, pb.OpRequest], arenas: dict[int, Arena]) -> None:
        """Phase 2 of a collective among the node daemons, on this node's share: its ranks'
        requests and arenas, or the staging buffers of a GPU op (``GpuOps.execute_across``)."""
        assert self.peers is not None
        hierarchical.execute(self.layout, self.peers, reqs, arenas, self.algorithms)

    def _execute(self, pending: Pending) -> None:
        arrivals = [pending.arrivals[r] for r in pending.participants]
        reqs = [a[1] for a in arrivals]
        sessions = [a[0] for a in arrivals]
        try:
            if reqs[0].kind in P2P_KINDS:
                self._run_p2p(sessions, reqs, pending.sent)
            else:
                self._check_match(pending, reqs)
                arenas = [s.arena for s in sessions]
                if any(r.HasField("cuda") for r in reqs):
                    gpu_ops = self._gpu.ops(sessions[0].node_id)
                    if self.peers is None:
                        gpu_ops.execute(self, pending.participants, sessions, reqs)
                    else:  # combined on the GPU, staged in host memory, then phase 2
                        gpu_ops.execute_across(
                            self, pending.participants, sessions, reqs, self._between_nodes
                        )
                elif self.peers is None:
                    host_collectives.execute(reqs, arenas)  # type: ignore[arg-type]
                else:
                    self._between_nodes(
                        dict(zip(pending.participants, reqs)),
                        dict(zip(pending.participants, arenas)),  # type: ignore[arg-type]
                    )
        except PeerError as exc:
            msg = f"{self.name()}: {exc}"
            self.fail(exc.kind, msg, failed_ranks=exc.failed_ranks)
            self._count_op_failure()
            for s, r in zip(sessions, reqs):
                self._reply_error(
                    s,
                    r,
                    self._failed[0] if self._failed else exc.kind,
                    self._failed[1] if self._failed else msg,
                )
            return
        except SmddpError as exc:
            msg = str(exc) if str(exc).startswith(self.name()) else f"{self.name()}: {exc}"
            self.fail(exc.kind, msg)
            self._count_op_failure()
            for s, r in zip(sessions, reqs):
                self._reply_error(s, r, exc.kind, msg)
            return
        except Exception as exc:  # a bug in the daemon must fail the op, not hang the job
            log.exception("%s: op #%d failed", self.name(), pending.seq, extra=self._log_fields())
            msg = f"{self.name()}: internal error in smddpd running op #{pending.seq}: {exc!r}"
            self.fail(pb.INVALID, msg)
            self._count_op_failure()
            for s, r in zip(sessions, reqs):
                self._reply_error(s, r, pb.INVALID, msg)
            return
        self._finish(pending, sessions, reqs)

    def _finish(self, pending: Pending, sessions: list[Session], reqs: list[pb.OpRequest]) -> None:
        arrivals = [pending.arrivals[s.rank] for s in sessions]
        last = max(arrivals, key=lambda a: a[2])
        op_key = pending.key[:-1]
        start, nbytes = self._progress.pop(op_key, (pending.first_arrival, 0))
        nbytes += sum(
            r.input.nbytes + sum(b.nbytes for b in r.send_blocks) + _gpu_bytes(r) for r in reqs
        )
        final = reqs[0].part + 1 == reqs[0].parts
        # An op the node combined in the region is counted there, by every rank of the node.
        counted = reqs[0].node_combined
        if final and not counted:
            with self._lock:
                self.ops_completed += 1
            for s in sessions:
                s.ops_completed += 1
        else:
            self._progress[op_key] = (start, nbytes)
        # Count the op before any rank hears of it, so that a scrape after wait() sees it.
        if final and not counted and self._metrics is not None:
            skew = last[2] - pending.first_arrival
            self._metrics.op_done(
                self.job_id,
                self.world_size,
                reqs[0],
                time.monotonic() - start,
                last[0].rank,
                skew,
                nbytes,
            )
        for s, r in zip(sessions, reqs):
            if pending.sent is None or r.kind != pb.SEND:
                reply = pb.OpReply(request_id=r.request_id, ok=True)
                if r.any_source:
                    reply.source_rank = r.root  # bound to its sender (``_bind_any``)
                s.reply(reply)

    def _run_p2p(
        self, sessions: list[Session], reqs: list[pb.OpRequest], sent: np.ndarray | None = None
    ) -> None:
        if sent is not None and self.buffers is not None:
            self.buffers.give(
                sent.nbytes
            )  # the copy is dropped once this call returns, whatever it does
        send, recv = (reqs[0], reqs[1]) if reqs[0].kind == pb.SEND else (reqs[1], reqs[0])
        s_send, s_recv = (
            (sessions[0], sessions[1]) if reqs[0].kind == pb.SEND else (sessions[1], sessions[0])
        )
        if recv.kind != pb.RECV or send.kind != pb.SEND:
            raise InvalidRequest("a send must meet a recv")
        if p2p_signature(send) != p2p_signature(recv):
            sender = f"{describe_request(send)} (tag {send.tag}) as message #{send.seq}"
            receiver = f"{describe_request(recv)} (tag {recv.tag})"
            raise InvalidRequest(
                f"{s_send.label()} called {sender} to rank {s_recv.rank}, which called {receiver}"
            )
        if send.HasField("cuda") or recv.HasField("cuda"):
            self._gpu.ops(s_send.node_id).execute_p2p(self, (s_send, send), (s_recv, recv))
            return
        if sent is None:
            host_collectives.execute_p2p(send, recv, s_send.arena, s_recv.arena)  # type: ignore[arg-type]
            return
        out = s_recv.arena.view(recv.output, sent.dtype)  # type: ignore[union-attr]
        if out.size != sent.size:
            raise InvalidRequest(
                f"send of {sent.size} elements from rank {s_send.rank} meets a recv of {out.size} elements"  # noqa: E501
            )
        out[:] = sent

    def _check_match(self, pending: Pending, reqs: list[pb.OpRequest]) -> None:
        groups: dict[tuple[int, ...], list[int]] = {}
        by_rank = dict(zip(pending.participants, reqs))
        for rank, req in by_rank.items():
            groups.setdefault(request_signature(req), []).append(rank)
        if len(groups) == 1:
            return
        # Name the minority first: "rank 3 called X as op #17 while ranks 0-2 called Y".
        ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1][0]))
        calls = [
            f"{rank_list(ranks)} called {describe_request(by_rank[ranks[0]])}"
            for _, ranks in ordered
        ]
        text = f"{calls[0]} as op #{pending.seq} while " + " and ".join(calls[1:])
        raise OpMismatch(f"{self.name()}: {text}")

    def _reply_error(self, session: Session, req: pb.OpRequest, kind: int, msg: str) -> None:
        # Whatever the kind and message came from (a rank's slot in the control region, say),
        # the reply must be built and must reach the rank: a kind outside the enum would make
        # the constructor raise in whichever thread answers (the watchdog), and a reply over
        # the data socket's message limit would be dropped, leaving the rank to wait.
        if len(msg) > MAX_ERROR_CHARS:
            msg = msg[:MAX_ERROR_CHARS] + " [cut]"
        # cast: protoc's stubs type an enum field as its enum class alone; an int is what it holds.
        reply = pb.OpReply(
            request_id=req.request_id,
            ok=False,
            error_kind=cast("pb.ErrorKind", known_kind(kind)),
            error=msg,
        )
        session.reply(reply)

    # -- failure ------------------------------------------------------------------------------

    def _log_fields(self, culprit: Session | None = None) -> dict[str, object]:
        if culprit is not None:
            return culprit.log_fields()
        return {"job": self.job_id, "comm": self.comm_id}

    def fail(
        self,
        kind: int,
        message: str,
        log_level: int = logging.WARNING,
        culprit: Session | None = None,
        propagate: bool = True,
        failed_ranks: Iterable[int] = (),
        from_node: int | None = None,
    ) -> None:
        """Fails every pending and later op of the communicator on every rank.

        Args:
            culprit: the one rank that caused the failure, when there is one; its rank and
                node go into the log record (and, for RANK_FAILED, into the failed ranks).
            propagate: tell the other nodes (False when they told us).
            failed_ranks: ranks known gone (a lost node's; a peer's Abort's), besides the
                ones that left this node.
            from_node: the peer node whose Abort this is: it is not told back.
        """
        with self._lock:
            if self._failed is not None:
                return
            self._failed = (kind, message)
            ranks = {r for r in failed_ranks if 0 <= r < self.world_size}
            if kind == pb.RANK_FAILED:
                ranks |= self._gone
                if culprit is not None:
                    ranks.add(culprit.rank)
            self._failed_ranks |= ranks
            if from_node is not None:
                self._heard.add(from_node)
            self._agree_if_heard()
            told = sorted(self._failed_ranks)
            pending = list(self._pending.values())
            self._pending.clear()
            waiting = list(self._any_waiting.values())
            self._any_waiting.clear()
            region = self.region
            self._attached.notify_all()  # peer-arenas requests get the error now
        gpu_ops = self._gpu.active()
        if gpu_ops is not None:
            # GPU ops already queued, gated on ranks' ready events (a dead rank's never
            # fires), go ahead now: survivors whose hosts wait on their streams get free.
            gpu_ops.abort_comm(self)
        in_region = region is not None and self._region_waits_on(region, culprit)
        if region is not None:
            region.fail(kind, message)  # every rank waiting in the region wakes and raises it
        if self.peers is not None:
            # Every node tells every node it has not heard from, and takes in their answers:
            # two daemons that each found a dead rank end with the same set of both.
            skip = {from_node} if from_node is not None else set()
            if propagate or len(self.peers.peer_nodes()) > 1:
                self.peers.abort(kind, message, told, self.merge_failed, skip)
            self.peers.failed(message)
        # Counted once: here when an op waited, else by _count_op_failure for the op that failed.
        with self._lock:
            count = bool(pending or waiting or in_region) and not self._failure_counted
            self._failure_counted = self._failure_counted or count
        if self._metrics is not None and count:
            self._metrics.error(kind)
        log.log(
            logging.WARNING if pending or waiting or in_region else log_level,
            "%s",
            message,
            extra=self._log_fields(culprit),
        )
        for p in pending:
            for session, req, _ in p.arrivals.values():
                if p.sent is not None and req.kind == pb.SEND:
                    if self.buffers is not None:
                        self.buffers.give(p.sent.nbytes)
                    continue  # answered when it arrived
                self._reply_error(session, req, kind, message)
        for wait in waiting:
            self._reply_error(wait.session, wait.req, kind, message)

    def _region_waits_on(self, region: ControlRegion, culprit: Session | None) -> bool:
        """Whether a rank inside an op of the region waits for what ``culprit`` (the rank that
        left or failed) has not given: True when it is itself inside an op, or another rank is
        inside a later op than the last it entered. A rank still finishing an op that the
        culprit finished (its done mark lags by a moment after a clean destroy_process_group)
        waits for nothing of it. Without a culprit on this node: any rank inside an op."""
        if culprit is None or culprit.rank not in self.local_ranks:
            return not region.all_done()
        slots = region.view.slots
        mine = self.local_ranks.index(culprit.rank)
        my_seq = int(slots[mine, S_SEQ])
        if my_seq != int(slots[mine, S_DONE]):
            return True
        return any(
            int(slots[r, S_SEQ]) != int(slots[r, S_DONE]) and int(slots[r, S_SEQ]) > my_seq
            for r in range(len(self.local_ranks))
        )

    def _count_op_failure(self) -> None:
        """Counts the communicator's failure for an op that failed outside ``_pending`` (while
        it ran: a mismatch, a node lost mid-exchange; or refused on arrival), once."""
        with self._lock:
            if self._failed is None or self._failure_counted:
                return
            self._failure_counted = True
            kind = self._failed[0]
        if self._metrics is not None:
            self._metrics.error(kind)

    def check_timeouts(self, now: float) -> None:
        """Fails the communicator if an op has waited longer than the timeout, or if a rank
        found an error (a mismatch) in the control region."""
        if self.region is not None and self._failed is None:
            self._check_region(now)
        with self._lock:
            late = self._any_timed_out(now) if self._failed is None else None
        if late is not None:
            self.fail(pb.TIMEOUT, late)
            return
        with self._lock:
            overdue = [p for p in self._pending.values() if now - p.first_arrival > self.timeout_s]
            if not overdue or self._failed is not None:
                return
            p = min(overdue, key=lambda x: x.first_arrival)
            missing = p.missing()
            labels = [
                self.members[r].label() if r in self.members else f"rank {r} (not registered)"
                for r in missing
            ]
            req = next(iter(p.arrivals.values()))[1]
            culprit = self.members.get(missing[0]) if len(missing) == 1 else None
            held_back = next((q.held_back for q in self._pending.values() if q.held_back), "")
        waited = now - p.first_arrival
        arrived = sorted(p.arrivals)
        absent = f"{rank_list(missing)} never arrived ({', '.join(labels)})"
        stayed = f"{rank_list(arrived)} waited {waited:.1f} s"
        message = (
            f"{self.name()}: "
            f"op #{p.seq} {describe_request(req)} timed out: "
            f"{absent} while {stayed}, past the group's timeout of {self.timeout_s:.1f} s"
        )
        if held_back:
            # A rank that sends more than the daemon holds before receiving waits for its
            # receives; if it never posts them first, this is why.
            message += f"; sends wait for their receives since {held_back}"
        self.fail(pb.TIMEOUT, message, culprit=culprit)

    def _labels(self, ranks: list[int]) -> list[str]:
        return [
            self.members[r].label() if r in self.members else f"rank {r} (not registered)"
            for r in ranks
        ]

    def _check_region(self, now: float) -> None:
        region = self.region
        assert region is not None
        found = region.rank_error()
        if found is not None:
            kind, message = found
            if not message.startswith(f"{self.name()}: "):
                # The slot's text is the rank's: it names no other job in the daemon's log.
                message = f"{self.name()}: a rank recorded in the control region: {message}"
            self.fail(kind, message)
            return
        p = region.pending(int(now * 1e9), inside=len(self.nodes) <= 1)
        if p is None:
            return
        missing = [self.local_ranks[i] for i in p.missing]
        arrived = [self.local_ranks[i] for i in p.arrived]
        with self._lock:
            # Ranks that sent op #k to the daemon while others run it in the region called
            # different ops (a size on either side of the region's, a GPU tensor and a host one).
            elsewhere = {
                r: req
                for q in self._pending.values()
                if q.key[0] == "c" and q.seq == p.seq
                for r, (_, req, _) in q.arrivals.items()
                if r in missing
            }
            labels = self._labels(missing)
            culprit = self.members.get(missing[0]) if len(missing) == 1 else None
        if elsewhere:
            ranks = sorted(elsewhere)
            self.fail(
                pb.MISMATCH,
                f"{self.name()}: "
                f"{rank_list(ranks)} called {describe_request(elsewhere[ranks[0]])} as op #{p.seq} while {rank_list(arrived)} called {p.description}",  # noqa: E501
            )
            return
        if p.waited_s <= self.timeout_s:
            return
        where = " at a synchronisation inside it" if p.inside else ""
        late = f"{rank_list(missing)} never arrived{where} ({', '.join(labels)})"
        waited = f"{rank_list(arrived)} waited {p.waited_s:.1f} s"
        message = (
            f"{self.name()}: "
            f"op #{p.seq} {p.description} timed out: "
            f"{late} while {waited}, past the group's timeout of {self.timeout_s:.1f} s"
        )
        self.fail(pb.TIMEOUT, message, culprit=culprit)

    def drain_metrics(self) -> None:
        """Adds what the ranks counted in the control region to the daemon's metrics.

        Counters that went backwards or beyond what is possible (``ControlRegion.new_counts``)
        are not added; a real rank never writes such, so the communicator fails, naming the
        rank whose slot held them.
        """
        region = self.region
        if region is None or self._metrics is None:
            return
        with self._lock:  # a scrape and the last rank's departure may both drain
            if self.region is None:
                return
            try:
                counts = region.new_counts()
            except ImpossibleCounters as exc:
                # Its slot and text, not the exception: kept past the except, the exception's
                # traceback would hold this frame, which holds it, a cycle that keeps the
                # region's views, its mapping and the mapping's descriptor until the garbage
                # collector runs, long after the job ended.
                bad: tuple[int, str] | None = (exc.slot, exc.problem)
            else:
                bad = None
                if counts is not None:
                    ops, nbytes, skew, last = counts
                    by_rank = np.zeros(self.world_size, dtype=last.dtype)
                    by_rank[list(self.local_ranks)] = last  # its slots are the node's ranks
                    self._metrics.add_region_counts(
                        self.job_id, self.world_size, ops, nbytes, skew, by_rank
                    )
        if bad is not None:
            slot, problem = bad
            rank = self.local_ranks[slot]
            culprit = self.members.get(rank)
            who = culprit.label() if culprit is not None else f"rank {rank} (not registered)"
            self.fail(
                pb.INVALID,
                f"{self.name()}: "
                f"rank {rank}'s metric counters in the control region {problem}: "
                f"the region was written by something other than smddp ({who})",
                culprit=culprit,
            )

    def close(self) -> None:
        """Stops the worker and closes the peer connections (the last local rank left).

        Ops still pending (sent by ranks that left before the others came) are dropped with
        their copies of early sends: nobody is left to answer. Every step runs whatever the
        ones before raised (metrics a rank's writes made unreadable must not keep the region,
        the worker or the peer connections).

        Raises:
            supervise.Reported: a step raised (logged; every other step ran).
        """
        steps = supervise.Steps("closing the communicator", self.name(), self._log_fields())
        steps.run("reading its last metrics", self.drain_metrics)
        with self._lock:
            region, self.region = self.region, None
            self._closed = True
            dropped = list(self._pending.values())
            self._pending.clear()
            self._attached.notify_all()  # a peer-arenas request still waiting ends now
        buffers = self.buffers
        if buffers is not None:
            held = sum(p.sent.nbytes for p in dropped if p.sent is not None)
            steps.run("giving back its early sends' bytes", lambda: buffers.give(held))
        if region is not None:
            steps.run("closing its control region", region.close)
        steps.run("releasing its GPU streams", self._release_gpu)
        work = self._work
        if work is not None:
            steps.run("stopping its worker", lambda: work.put(None))
        peers = self.peers
        if peers is not None:
            steps.run("closing its connections to other nodes", peers.close)
        steps.raise_first()

    def _release_gpu(self) -> None:
        gpu_ops = self._gpu.active()
        if gpu_ops is not None:
            gpu_ops.release_comm(self)  # its CUDA streams, once their work is done

    def internal_error(self, what: str, exc: BaseException) -> None:
        """Fails the communicator on every rank for an exception the daemon met while
        ``what`` (supervision calls it): a bug, or a rank's input nobody foresaw.

        Every rank hears it, even where an earlier failure was cut short by the same bug:
        the ranks in the control region through the region, the others by a notice on
        their channel (request id 0), which their next wait raises.
        """
        message = (
            f"{self.name()}: "
            f"internal error in smddpd while {what} ({type(exc).__name__}: {exc}); "
            "the communicator cannot go on"
        )
        steps = supervise.Steps("failing the communicator", self.name(), self._log_fields())
        steps.run("failing its ops", lambda: self.fail(pb.INVALID, message))
        region = self.region
        if region is not None:  # a no-op where the failure is written already
            steps.run(
                "writing the failure into its region", lambda: region.fail(pb.INVALID, message)
            )
        notice = pb.OpReply(request_id=0, ok=False, error_kind=pb.INVALID, error=message)
        with self._lock:
            members = list(self.members.values())
        for session in members:
            steps.run("telling a rank", functools.partial(session.reply, notice))

    def status(self) -> pb.CommStatus:
        """A snapshot for smddpctl status.

        What comes from the control region is the ranks' word, which any process of the job
        can write: every such number is clamped into its proto field's range, so that a slot
        written by something other than smddp cannot make the reply unencodable.
        """
        now = time.monotonic()
        with self._lock:
            region = self.region
            st = pb.CommStatus(
                job_id=self.job_id,
                comm_id=self.comm_id,
                world_size=self.world_size,
                generation=self.generation,
                parent_comm_id=self.parent_comm_id,
                excluded_ranks=self.excluded,
                joined_ranks=self.joined,
                failed_ranks=sorted(self._failed_ranks),
                failed=self._failed[1] if self._failed else "",
                ops_completed=_clamp(
                    self.ops_completed + (_clamp(region.ops_completed(0)) if region else 0)
                ),
                algorithms=self.algorithms.choices(),
            )
            slot = {r: i for i, r in enumerate(self.local_ranks)}
            for r, s in sorted(self.members.items()):
                in_region = _clamp(region.ops_completed(slot[r])) if region and r in slot else 0
                st.ranks.add(
                    rank=r,
                    global_rank=s.global_rank,
                    pid=s.pid,
                    node_id=s.node_id,
                    attached=s.arena is not None,
                    ops_completed=_clamp(s.ops_completed + in_region),
                )
            region_op = region.pending() if region is not None and self._failed is None else None
            if region_op is not None:
                st.pending.add(
                    seq=_clamp(region_op.seq),
                    part=0,
                    description=region_op.description,
                    arrived_ranks=[self.local_ranks[i] for i in region_op.arrived],
                    missing_ranks=[self.local_ranks[i] for i in region_op.missing],
                    waited_seconds=region_op.waited_s,
                )
            for p in sorted(self._pending.values(), key=lambda x: (x.seq, x.part)):
                req = next(iter(p.arrivals.values()))[1]
                st.pending.add(
                    seq=p.seq,
                    part=p.part,
                    description=describe_request(req),
                    arrived_ranks=sorted(p.arrivals),
                    missing_ranks=p.missing(),
                    waited_seconds=now - p.first_arrival,
                )
        return st


U64_MAX = (1 << 64) - 1


def _clamp(value: int, top: int = U64_MAX) -> int:
    """``value`` within 0..``top`` (a uint64 proto field's range by default)."""
    return min(max(int(value), 0), top)
