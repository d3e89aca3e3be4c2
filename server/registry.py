"""Who is registered with this daemon: jobs, their communicators and the ranks' sessions."""

from __future__ import annotations

import functools
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from smddp.core.wire import rank_list
from smddp.server import supervise
from smddp.server.algorithms import Selector
from smddp.server.arena import Arena
from smddp.server.communicator import Communicator, GpuSupply, Session
from smddp.server.config import DaemonConfig
from smddp.server.domain import Registration
from smddp.server.errors import (
    FailedPrecondition,
    InvalidRequest,
    LimitExceeded,
    PermissionDenied,
    RemoteRefusal,
    SmddpError,
    Unauthenticated,
)
from smddp.server.fields import COMM_ID, JOB_ID, check_node_id, check_peer_address, quote
from smddp.server.limits import BufferAccount, ByteBudget, Counts, Slots
from smddp.server.logthrottle import refusals
from smddp.server.metrics import Metrics
from smddp.server.peer_transport import CommPeers, PeerNetwork
from smddp.server.peer_wire import parse_address, token_proof
from smddp.server.rendezvous import RendezvousTable, rendezvous_proof
from smddp.v1 import smddp_pb2 as pb

log = logging.getLogger(__name__)

MIN_TOKEN_BYTES = 16
MAX_TOKEN_BYTES = 1024
MIN_ARENA_BYTES = 64 << 10
MAX_TIMEOUT_MS = 7 * 24 * 3600 * 1000


def _check_token(where: str, token: bytes) -> None:
    if not MIN_TOKEN_BYTES <= len(token) <= MAX_TOKEN_BYTES:
        raise InvalidRequest(
            f"{where}: job_token must have {MIN_TOKEN_BYTES}-{MAX_TOKEN_BYTES} bytes"
        )


def _uid_of(pid: int) -> int | None:
    """The real uid of process ``pid`` as /proc shows it here, or None.

    Only a hint: the pid is what the client says, and in another pid namespace it names
    another process. It gives an early "wrong job token"; attach checks the kernel's word.
    """
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass(eq=False)
class Job:
    """A job on this daemon: its id and token, and once a rank attached, the uid it belongs to.

    Jobs are told apart by token as well as id, so that nobody who lacks a job's token can
    take its id from it: a registration with another token is another job, whose id is
    scoped to the uid that attaches to it first.
    """

    job_id: str
    token: bytes
    buffers: BufferAccount
    owner: int | None = None
    comms: dict[str, Communicator] = field(default_factory=dict)


class Registry:
    """Thread-safe tables of communicators and sessions, and the rules for joining them."""

    def __init__(
        self,
        config: DaemonConfig,
        metrics: Metrics | None = None,
        gpu: GpuSupply | None = None,
        network: PeerNetwork | None = None,
        peer_address: str = "",
    ) -> None:
        """``network``: the daemon's connections to other daemons (None when --peer-bind is
        off); ``peer_address``: HOST:PORT they reach this one at ("" then)."""
        self._gpu = gpu
        self.config = config
        self.started = time.time()
        self.metrics = metrics
        if metrics is not None:
            metrics.job_labels = config.metrics_job_labels
        self._jobs: dict[str, list[Job]] = {}  # by job id: jobs of different tokens
        self._sessions: dict[str, Session] = {}
        # Registered ranks that have not attached yet, oldest first: they expire, and the
        # oldest makes room when there are max_unattached of them.
        self._unattached: OrderedDict[str, Session] = OrderedDict()
        self._jobs_per_uid = Counts("jobs", config.max_jobs_per_uid, "--max-jobs-per-uid")
        self._ranks_per_uid = Counts(
            "attached ranks", config.max_ranks_per_uid, "--max-ranks-per-uid"
        )
        self.buffers = ByteBudget(config.max_buffered_bytes_per_uid, config.max_buffered_bytes)
        self.rendezvous_slots = Slots(
            "waiting Rendezvous calls", config.max_pending_rendezvous, "--max-pending-rendezvous"
        )
        # HOST:PORT other daemons reach this one at; "" when the peer listener is off.
        self.peer_address = peer_address
        self.network = network
        self.rendezvous = RendezvousTable(config.max_jobs)
        self._forwarded: set[grpc.Future[pb.RendezvousReply]] = (
            set()
        )  # Meet calls to other daemons in flight
        self._stopping = False
        self._lock = threading.Lock()

    # -- joining ------------------------------------------------------------------------------

    def register(self, req: Registration) -> Session:
        """Adds a rank to its communicator, creating the communicator on first contact.

        Raises:
            SmddpError: bad fields, wrong token, a taken rank slot or an exceeded limit.
        """
        cfg = self.config
        if not JOB_ID.match(req.job_id):
            raise InvalidRequest(
                f"job_id {quote(req.job_id)} must be 1-128 characters of A-Z a-z 0-9 . _ : -"
            )
        if not COMM_ID.match(req.comm_id):
            raise InvalidRequest(
                f"job {req.job_id}: comm_id {quote(req.comm_id)} must be 1-256 printable characters"
            )
        where = f"job {req.job_id} comm {req.comm_id}"
        if self._stopping:
            raise FailedPrecondition(f"{where}: smddpd is shutting down")
        check_node_id(where, "node_id", req.node_id, optional=True)
        _check_token(where, req.job_token)
        if not 1 <= req.world_size <= cfg.max_ranks_per_job:
            raise LimitExceeded(
                f"{where}: "
                f"world_size {req.world_size} is outside 1..{cfg.max_ranks_per_job} (--max-ranks-per-job)"  # noqa: E501
            )
        if req.rank >= req.world_size:
            raise InvalidRequest(f"{where}: rank {req.rank} is outside a world of {req.world_size}")
        if not MIN_ARENA_BYTES <= req.arena_bytes <= cfg.max_arena_bytes:
            raise LimitExceeded(
                f"{where} rank {req.rank}: "
                f"arena_bytes {req.arena_bytes} is outside {MIN_ARENA_BYTES}..{cfg.max_arena_bytes} (--max-arena-bytes)"  # noqa: E501
            )
        timeout_s = self._timeout_s(where, req.timeout_ms)
        nodes, my_node = self._layout(req, where)
        self._check_shrink(req, where)
        claimed_uid = _uid_of(req.pid)
        evicted: list[Session] = []
        mismatch = ""  # a survivor's shrink_group differs from those registered before it
        with self._lock:
            job = self._job(req.job_id, req.job_token)
            if job is None:
                if self._owned_jobs() >= cfg.max_jobs:
                    raise LimitExceeded(
                        f"{where}: the daemon already serves {cfg.max_jobs} jobs (--max-jobs)"
                    )
                if claimed_uid is not None and any(
                    j.owner == claimed_uid for j in self._jobs.get(req.job_id, ())
                ):
                    # The same user's job under this id has another token: a mistake, not a
                    # second job (another user's job of this id is simply another job).
                    raise Unauthenticated(f"{where} rank {req.rank}: wrong job token")
                job = Job(req.job_id, req.job_token, BufferAccount(self.buffers))
                self._jobs.setdefault(req.job_id, []).append(job)
                if self.metrics is not None:
                    self.metrics.job_started(req.job_id)
            comm = job.comms.get(req.comm_id)
            if comm is None:
                # The client keeps half its arena for direct ops; the other half, its ring,
                # must hold two chunks (plus alignment) for them to pipeline.
                chunk = max(4096, min(cfg.chunk_bytes, req.arena_bytes // 4) // 64 * 64)
                comm = Communicator(
                    req.job_id,
                    req.comm_id,
                    req.world_size,
                    req.job_token,
                    timeout_s,
                    chunk,
                    self.metrics,
                    nodes=nodes,
                    my_node=my_node,
                    specs=req.nodes,
                    gpu=self._gpu,
                )
                comm.buffers = job.buffers
                comm.parent_comm_id = req.parent_comm_id
                comm.excluded = req.excluded
                comm.generation = req.generation
                comm.joined = req.joined
                comm.max_pending_ops = self.config.max_pending_ops
                comm.algorithms = Selector(comm.layout.name(), self.config.algo)
                if len(comm.nodes) > 1:
                    assert self.network is not None  # _layout refuses nodes without peers
                    comm.attach_peers(
                        CommPeers(
                            comm.layout,
                            comm.token,
                            comm.timeout_s,
                            self.network,
                            comm.fail,
                            buffers=job.buffers,
                            metrics=self.metrics,
                            excluded=req.excluded,
                        )
                    )
                job.comms[req.comm_id] = comm
                if req.generation and self.metrics is not None:
                    (self.metrics.grows if req.joined else self.metrics.shrinks).inc()
            elif (req.parent_comm_id, req.excluded, req.generation, req.joined) != (
                comm.parent_comm_id,
                comm.excluded,
                comm.generation,
                comm.joined,
            ):
                mismatch = self._shrink_mismatch(comm, req, where)
            else:
                if comm.world_size != req.world_size:
                    raise FailedPrecondition(
                        f"{where}: "
                        f"rank {req.rank} registered with world_size {req.world_size} but the communicator has {comm.world_size} ranks"  # noqa: E501
                    )
                if (
                    comm.nodes != (nodes or [list(range(req.world_size))])
                    or comm.my_node != my_node
                ):
                    raise FailedPrecondition(
                        f"{where}: "
                        f"rank {req.rank} describes the job's nodes differently than the ranks registered before it"  # noqa: E501
                    )
                if req.rank in comm.members:
                    other = comm.members[req.rank]
                    raise FailedPrecondition(
                        f"{where}: rank {req.rank} is already registered ({other.label()})"
                    )
                if req.arena_bytes // 4 < comm.chunk_bytes:
                    raise InvalidRequest(
                        f"{where} rank {req.rank}: "
                        f"arena of {req.arena_bytes} bytes is smaller than 4 x the communicator's chunk of {comm.chunk_bytes} bytes"  # noqa: E501
                    )
            if mismatch:
                mismatched: Communicator | None = comm
            else:
                mismatched = None
                session = Session(
                    session_id=secrets.token_hex(16),
                    secret=secrets.token_bytes(32),
                    comm=comm,
                    rank=req.rank,
                    global_rank=req.global_rank,
                    pid=0,  # the kernel's, at attach
                    claimed_pid=req.pid,
                    node_id=req.node_id or "?",
                    arena_bytes=req.arena_bytes,
                )
                comm.add(session)
                self._sessions[session.session_id] = session
                self._unattached[session.session_id] = session
                while len(self._unattached) > cfg.max_unattached:
                    evicted.append(self._unattached.popitem(last=False)[1])
        if mismatched is not None:
            # The ranks registered before it would otherwise wait for it until the group's
            # timeout: the communicator fails for them too, with the same message.
            mismatched.fail(pb.MISMATCH, mismatch)
            raise FailedPrecondition(mismatch)
        for old in evicted:
            self._drop(
                old,
                f"{old.comm.name()}: {old.label()} was dropped before it attached its arena: "
                f"{cfg.max_unattached} newer registrations arrived first (--max-unattached)",
                pb.RANK_FAILED,
                logging.INFO,
                fail=self._others_attached(old),
            )
        log.info(
            "%s: "
            "registered rank %d (node %s), which says it is pid %d (unverified until it attaches)",
            where,
            session.rank,
            session.node_id,
            req.pid,
            extra=session.log_fields(),
        )
        return session

    @staticmethod
    def _check_shrink(req: Registration, where: str) -> None:
        """Checks the lineage fields of a registration: shrink_group's (excluded ranks) or
        smddp.grow's (joined ranks), all empty for any other."""
        if not req.parent_comm_id:
            if req.excluded or req.generation or req.joined:
                raise InvalidRequest(
                    f"{where}: excluded_ranks, joined_ranks and generation come with a parent_comm_id (shrink_group, grow)"  # noqa: E501
                )
            return
        if not COMM_ID.match(req.parent_comm_id) or req.parent_comm_id == req.comm_id:
            raise InvalidRequest(
                f"{where}: parent_comm_id {quote(req.parent_comm_id)} must name another communicator"  # noqa: E501
            )
        if req.joined:
            Registry._check_grow(req, where)
            return
        excluded = list(req.excluded)
        parent_size = req.world_size + len(excluded)
        if not excluded or excluded != sorted(set(excluded)) or excluded[-1] >= parent_size:
            raise InvalidRequest(
                f"{where}: "
                f"excluded_ranks {excluded[:16]} must be ascending, distinct ranks of the parent's {parent_size}"  # noqa: E501
            )
        if req.generation < 1:
            raise InvalidRequest(f"{where}: a shrunk communicator's generation is at least 1")

    @staticmethod
    def _check_grow(req: Registration, where: str) -> None:
        """Checks smddp.grow's fields: the joiners are the last ranks, after the parent's."""
        joined = list(req.joined)
        first = req.world_size - len(joined)
        if req.excluded:
            raise InvalidRequest(
                f"{where}: a communicator made by grow excludes no ranks (joined_ranks {joined[:16]}, excluded_ranks {list(req.excluded)[:16]})"  # noqa: E501
            )
        if first < 1 or joined != list(range(first, req.world_size)):
            raise InvalidRequest(
                f"{where}: "
                f"joined_ranks {joined[:16]} must be the last ranks of the {req.world_size}, after at least one rank of the parent"  # noqa: E501
            )
        if req.generation < 1:
            raise InvalidRequest(f"{where}: a grown communicator's generation is at least 1")

    @staticmethod
    def _shrink_mismatch(comm: Communicator, req: Registration, where: str) -> str:
        """The error for a survivor whose shrink_group (or grow) differs from the ranks'
        before it."""
        before = sorted(comm.members)
        if req.joined or comm.joined:
            return (
                f"{where}: "
                f"rank {req.rank} called grow on comm {req.parent_comm_id or '(none)'} admitting ranks {list(req.joined)} (generation {req.generation}), but {rank_list(before)} admitted ranks {list(comm.joined)} to comm {comm.parent_comm_id or '(none)'} (generation {comm.generation}): "  # noqa: E501
                "every rank of a grown group must name the same joiners"
            )
        return (
            f"{where}: "
            f"rank {req.rank} called shrink_group on comm {req.parent_comm_id or '(none)'} excluding ranks {list(req.excluded)} (generation {req.generation}), but {rank_list(before)} excluded ranks {list(comm.excluded)} of comm {comm.parent_comm_id or '(none)'} (generation {comm.generation}): "  # noqa: E501
            "every surviving rank must exclude the same ranks"
        )

    def _layout(self, req: Registration, where: str) -> tuple[list[list[int]] | None, int]:
        """Checks the node layout of a registration; returns (ranks per node, this node's index)."""
        if not req.nodes:
            return None, 0
        if len(req.nodes) > req.world_size:
            raise InvalidRequest(
                f"{where}: the layout lists {len(req.nodes)} nodes for {req.world_size} ranks"
            )
        for i, spec in enumerate(req.nodes):
            check_node_id(where, f"nodes[{i}].node_id", spec.node_id)
            check_peer_address(where, f"nodes[{i}].peer_address", spec.peer_address)
        seen: set[int] = set()
        nodes: list[list[int]] = []
        ids = [n.node_id for n in req.nodes]
        if len(set(ids)) != len(ids):
            raise InvalidRequest(f"{where}: node ids repeat in the layout: {ids}")
        for spec in req.nodes:
            ranks = list(spec.ranks)
            if (
                not ranks
                or ranks != sorted(set(ranks))
                or any(r >= req.world_size for r in ranks)
                or seen & set(ranks)
            ):
                raise InvalidRequest(
                    f"{where}: "
                    f"node {spec.node_id} lists ranks {ranks[:16]}: "
                    f"expected ascending, distinct ranks below {req.world_size} that no other node lists"  # noqa: E501
                )
            seen |= set(ranks)
            nodes.append(ranks)
        if len(seen) != req.world_size:
            raise InvalidRequest(
                f"{where}: the layout places {len(seen)} of {req.world_size} ranks"
            )
        my_node = next(i for i, ranks in enumerate(nodes) if req.rank in ranks)
        if len(nodes) > 1:
            if not self.peer_address or self.network is None:
                raise FailedPrecondition(
                    f"{where}: "
                    f"the job spans {len(nodes)} nodes but this daemon accepts no peer connections (--peer-bind off)"  # noqa: E501
                )
            for spec in req.nodes:
                try:
                    parse_address(spec.peer_address)
                except ValueError:
                    raise InvalidRequest(
                        f"{where}: "
                        f"node {spec.node_id} has no valid peer address ({quote(spec.peer_address)})"  # noqa: E501
                    ) from None
        return nodes, my_node

    def meet(
        self, req: pb.RendezvousRequest, active: Callable[[], bool] = lambda: True
    ) -> list[pb.NodeSpec]:
        """A local rank's rendezvous (``Node.Rendezvous``): hosted here or forwarded to the root.

        Args:
            active: False once the caller has gone (its call was cancelled): stop waiting.

        Raises:
            SmddpError: bad fields, a refusal of the root, too many waiting calls, or ranks
                missing at the timeout.
        """
        where = f"rendezvous of job {req.job_id[:64]}"
        if not JOB_ID.match(req.job_id):
            raise InvalidRequest(
                f"rendezvous of job {quote(req.job_id)}: "
                "job_id must be 1-128 characters of A-Z a-z 0-9 . "
                "_ : "
                "-"
            )
        _check_token(where, req.job_token)
        if req.root:
            check_peer_address(where, "root", req.root)
        check_node_id(where, "root_node_id", req.root_node_id, optional=True)
        timeout_s = min(self._timeout_s(where, req.timeout_ms), self.config.max_rendezvous_wait_s)
        proof = rendezvous_proof(req.job_token, req.job_id)
        node_id, address = self.config.node_id, self.peer_address or "none"
        if not req.root or req.root == self.peer_address:
            with self.rendezvous_slots.held(where):
                return self.rendezvous.meet(
                    req.job_id, proof, req.rank, req.world_size, node_id, address, timeout_s, active
                )
        if self.network is None:
            raise FailedPrecondition(
                f"{where}: "
                f"the root is another daemon ({req.root}) but this one has no peers (--peer-bind off)"  # noqa: E501
            )
        try:
            parse_address(req.root)
        except ValueError:
            raise InvalidRequest(f"{where}: root {quote(req.root)} is not HOST:PORT") from None
        meet = pb.MeetRequest(
            job_id=req.job_id,
            proof=proof,
            rank=req.rank,
            world_size=req.world_size,
            node_id=node_id,
            peer_address=address,
            timeout_ms=int(timeout_s * 1000),
        )
        with self.rendezvous_slots.held(where):
            call = self.network.control.meet_future(
                req.root, req.root_node_id or parse_address(req.root)[0], meet, timeout_s + 10
            )
            with self._lock:
                if self._stopping:
                    call.cancel()
                self._forwarded.add(call)
            try:
                # Wait in slices: a caller that went away, or a daemon that stops, ends the
                # forwarded call at once instead of at its deadline.
                while True:
                    try:
                        return list(call.result(timeout=0.5).nodes)
                    except grpc.FutureTimeoutError:
                        if not active():
                            call.cancel()
                    except grpc.FutureCancelledError:
                        why = (
                            "smddpd is shutting down" if self._stopping else "the caller went away"
                        )
                        raise FailedPrecondition(f"{where}: {why}") from None
                    except grpc.RpcError as exc:
                        raise RemoteRefusal(
                            exc.code(),
                            f"{where}: the root's daemon at {req.root}: "
                            f"{exc.details() or exc.code()}",
                        ) from None
            finally:
                with self._lock:
                    self._forwarded.discard(call)

    def _timeout_s(self, where: str, timeout_ms: int) -> float:
        """A client's timeout in seconds; 0 means the daemon's default."""
        if timeout_ms > MAX_TIMEOUT_MS:
            raise InvalidRequest(f"{where}: timeout_ms {timeout_ms} exceeds 7 days")
        return timeout_ms / 1000 if timeout_ms else self.config.default_timeout_s

    # -- jobs ---------------------------------------------------------------------------------

    def _job(self, job_id: str, token: bytes) -> Job | None:
        """The job of that id and token (lock held)."""
        for job in self._jobs.get(job_id, ()):
            if secrets.compare_digest(job.token, token):
                return job
        return None

    def _job_of(self, comm: Communicator) -> Job | None:
        """The job ``comm`` belongs to (lock held)."""
        for job in self._jobs.get(comm.job_id, ()):
            if job.comms.get(comm.comm_id) is comm:
                return job
        return None

    def _owned_jobs(self) -> int:
        """Jobs that a rank has attached to (lock held): the ones --max-jobs counts."""
        return sum(1 for jobs in self._jobs.values() for j in jobs if j.owner is not None)

    def find_comm(
        self, job_id: str, comm_id: str, proof: bytes | None = None
    ) -> Communicator | None:
        """The communicator a peer daemon asks for, if registered here.

        Args:
            proof: the peer's ``token_proof``: picks among jobs that share the id. Without one,
                or when none matches, any communicator of that name (whose token then fails
                the caller's own check).
        """
        with self._lock:
            found = [j.comms[comm_id] for j in self._jobs.get(job_id, ()) if comm_id in j.comms]
        if proof is not None:
            for comm in found:
                if secrets.compare_digest(proof, token_proof(comm.token, job_id, comm_id)):
                    return comm
        return found[0] if found else None

    def authenticate(self, session_id: str, secret: bytes) -> Session:
        """Returns the live session named by ``session_id`` if ``secret`` proves it.

        Raises:
            Unauthenticated: no such session, or the wrong secret.
        """
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None or not secrets.compare_digest(session.secret, secret):
            raise Unauthenticated(f"unknown session {session_id[:64]!r} or wrong session secret")
        return session

    def attach(self, session: Session, fd: int, uid: int, pid: int = 0) -> None:
        """Maps the session's arena from ``fd`` after checking the client's uid.

        Args:
            uid, pid: the client's, as the kernel tells them (SO_PEERCRED).

        Raises:
            SmddpError: already attached, a bad memfd, another user's job, or a limit. A rank
                refused for its uid or a limit never took part: it is forgotten, and nobody
                else fails.
        """
        comm = session.comm
        if session.arena is not None:
            os.close(fd)
            raise FailedPrecondition(
                f"{comm.name()}: {session.label()} has already attached its arena"
            )
        # A bad memfd is refused before anything is counted: the registration stays as it
        # was (it may attach again with a good one, or expire).
        arena = Arena(fd, session.arena_bytes, f"{comm.name()} {session.label()}")
        try:
            self._bind(session, uid)
        except SmddpError as exc:
            arena.close()
            self._drop(session, str(exc), pb.UNAUTHENTICATED, logging.INFO, fail=False)
            raise
        except BaseException:
            arena.close()
            raise
        with self._lock:
            # Its registration may have ended since _bind (Deregister, say): then _drop
            # has run and no one else would close this arena.
            gone = session.closed
            if not gone:
                # From here on messages and status name the process the kernel saw
                # (SO_PEERCRED), not the pid the rank claimed at Register; 0 (the client's pid
                # namespace is not ours) leaves the claim, which its label calls unverified.
                session.peer_pid = session.pid = pid
                session.arena = arena
        if gone:
            arena.close()
            raise FailedPrecondition(
                f"{comm.name()}: "
                f"{session.label()} left the communicator while it attached its arena"
            )
        comm.attached()

    def _bind(self, session: Session, uid: int) -> None:
        """Counts an attaching rank against its uid; the job's first binds the job to the uid."""
        comm = session.comm
        with self._lock:
            if session.closed:
                raise FailedPrecondition(
                    f"{comm.name()}: "
                    f"{session.label()}'s registration has ended (it expired after {self.config.attach_timeout_s:.0f} s, --attach-timeout-s, or was dropped)"  # noqa: E501
                )
            job = self._job_of(comm)
            assert job is not None
            if job.owner is None:
                if self._owned_jobs() >= self.config.max_jobs:
                    raise LimitExceeded(
                        f"{comm.name()}: "
                        f"the daemon already serves {self.config.max_jobs} jobs (--max-jobs)"
                    )
                if any(j.owner == uid for j in self._jobs.get(comm.job_id, ()) if j is not job):
                    raise Unauthenticated(
                        f"{comm.name()} {session.label()}: "
                        "wrong job token: "
                        f"uid {uid} already runs job {comm.job_id} here with another token"
                    )
                self._ranks_per_uid.take(uid, where=comm.name())
                try:
                    self._jobs_per_uid.take(uid, where=comm.name())
                except LimitExceeded:
                    self._ranks_per_uid.give(uid)
                    raise
                job.owner = uid
                job.buffers.uid = uid
            elif job.owner != uid:
                raise PermissionDenied(
                    f"{comm.name()}: "
                    f"uid {uid} may not join job {comm.job_id}, which belongs to uid {job.owner}"
                )
            else:
                self._ranks_per_uid.take(uid, where=comm.name())
            session.uid = uid
            self._unattached.pop(session.session_id, None)

    def expire(self, now: float) -> None:
        """Drops registrations not attached within --attach-timeout-s (the watchdog calls it)."""
        limit = self.config.attach_timeout_s
        with self._lock:
            late = [s for s in self._unattached.values() if now - s.registered_at > limit]
            for s in late:
                del self._unattached[s.session_id]
        for s in late:
            why = (
                f"{s.comm.name()}: "
                f"{s.label()} registered but did not attach its arena within {limit:.0f} s (--attach-timeout-s): "  # noqa: E501
                "its process died or hung before attaching"
            )
            self._drop(s, why, pb.RANK_FAILED, logging.INFO, fail=self._others_attached(s))

    @staticmethod
    def _others_attached(session: Session) -> bool:
        """True if ranks of the session's communicator took part (dropping it must fail them)."""
        return any(
            s is not session and s.arena is not None for s in list(session.comm.members.values())
        )

    # -- leaving ------------------------------------------------------------------------------

    def deregister(self, session: Session, shrink: str = "", reason: str = "") -> None:
        """Removes a rank that left cleanly (destroy_process_group, or ``reason``), or for the
        survivors' new group (``shrink`` says which: it is then not one of the failed ranks)."""
        if shrink:
            why = (
                f"{session.comm.name()}: "
                f"{session.label()} has left the communicator for a shrunk group: {shrink}"
            )
            self._drop(session, why, pb.ABORTED, logging.INFO, gone=False)
            return
        why = (
            f"{session.comm.name()}: "
            f"{session.label()} has left the communicator ({reason or 'destroy_process_group'})"
        )
        self._drop(session, why, pb.RANK_FAILED, logging.INFO)

    def connection_lost(self, session: Session, detail: str) -> None:
        """Removes a rank whose connection broke; its communicator fails on the other ranks."""
        why = (
            f"{session.comm.name()}: "
            f"{session.label()} disconnected without leaving the communicator ({detail}); "
            "its process died or closed its connection"
        )
        self._drop(session, why, pb.RANK_FAILED)

    def _drop(
        self,
        session: Session,
        why: str,
        kind: int,
        log_level: int = logging.WARNING,
        fail: bool = True,
        gone: bool = True,
    ) -> None:
        with self._lock:
            if session.closed:
                return
            session.closed = True
            self._sessions.pop(session.session_id, None)
            self._unattached.pop(session.session_id, None)
            if session.uid is not None:
                self._ranks_per_uid.give(session.uid)
        comm = session.comm
        # Every step runs whatever the ones before raised: an arena, a region or a count
        # left behind is held until the daemon restarts.
        steps = supervise.Steps("removing a rank", comm.name(), session.log_fields())
        empty = steps.run(
            "taking it out of its communicator",
            lambda: comm.remove(session, why, kind, log_level, fail, gone),
            on_error=functools.partial(comm.internal_error, f"removing {session.label()}"),
        )
        if empty is None:  # remove raised: whether others are left, from its members
            empty = not any(s is not session for s in list(comm.members.values()))
        if empty:
            # The communicator logs a departure only when it fails others; the last one, here.
            log.log(log_level, "%s", why, extra=session.log_fields())
            job_over = steps.run("forgetting its communicator", lambda: self._forget(comm))
            steps.run("closing its communicator", comm.close)
            # After close, whose last read of the region's counters would otherwise bring
            # back the series that job_ended removes.
            metrics = self.metrics
            if job_over is True and metrics is not None:
                steps.run("dropping its job's metrics", lambda: metrics.job_ended(comm.job_id))
        arena = session.arena
        if arena is not None:
            steps.run("closing its arena", arena.close)

    def _forget(self, comm: Communicator) -> bool:
        """Removes a communicator whose last rank left, and its job if that was its last
        communicator (giving back the job's count); True when the job is over."""
        with self._lock:
            job = self._job_of(comm)
            if job is None:
                return False
            del job.comms[comm.comm_id]
            if job.comms:
                return False
            jobs = self._jobs[comm.job_id]
            jobs.remove(job)
            if not jobs:
                del self._jobs[comm.job_id]
            if job.owner is not None:
                self._jobs_per_uid.give(job.owner)
            return True

    # -- looking ------------------------------------------------------------------------------

    def comms(self) -> list[Communicator]:
        """A snapshot of the live communicators."""
        with self._lock:
            return [c for jobs in self._jobs.values() for j in jobs for c in j.comms.values()]

    def session_count(self) -> int:
        """Number of registered ranks."""
        with self._lock:
            return len(self._sessions)

    def arena_bytes(self) -> int:
        """Bytes of the arenas the ranks attached, in all."""
        return sum(s.arena.nbytes for s in self.sessions() if s.arena)

    def drain_metrics(self) -> None:
        """Has every communicator read its ranks' control-region counters into the metrics.

        One communicator that cannot be read is logged and left out; the scrape goes on.
        """
        for comm in self.comms():
            try:
                comm.drain_metrics()
            except Exception as exc:
                refusals.log(
                    log,
                    logging.WARNING,
                    "metrics of a communicator unreadable",
                    "%s: its ranks' counters could not be read for the metrics: %r",
                    comm.name(),
                    exc,
                )

    def visible_comms(self, uid: int | None = None) -> list[Communicator]:
        """The live communicators of the jobs ``uid`` owns (every one for None: root and
        the admin group). A job no rank has attached to yet has no owner: admins only."""
        with self._lock:
            return [
                c
                for jobs in self._jobs.values()
                for j in jobs
                if uid is None or j.owner == uid
                for c in j.comms.values()
            ]

    def job_visible(self, uid: int | None = None) -> Callable[[str], bool]:
        """Whether ``uid`` may see a metric series labelled with a job id: the ids of its own
        jobs that no other uid's job has too (jobs of different tokens may share an id, and
        then share the series). Everything for None."""
        if uid is None:
            return lambda job_id: True
        with self._lock:
            mine = {
                job_id
                for job_id, jobs in self._jobs.items()
                if jobs and all(j.owner == uid for j in jobs)
            }
        return mine.__contains__

    def unattached_count(self) -> int:
        """Number of registered ranks that have not attached yet."""
        with self._lock:
            return len(self._unattached)

    def job_count(self) -> int:
        """Number of jobs served: those a rank has attached to (what --max-jobs counts)."""
        with self._lock:
            return self._owned_jobs()

    def sessions(self) -> list[Session]:
        """A snapshot of the registered ranks."""
        with self._lock:
            return list(self._sessions.values())

    def status(self, version: str, uid: int | None = None) -> pb.StatusReply:
        """Everything smddpctl status shows: of the jobs ``uid`` owns, or of all (None).

        Each communicator's part is built apart: one that cannot be read (its region written
        by something other than smddp, say) says so in its ``failed`` field, and the others
        still show.
        """
        reply = pb.StatusReply(
            node_id=self.config.node_id, version=version, uptime_seconds=time.time() - self.started
        )
        for comm in sorted(self.visible_comms(uid), key=lambda c: (c.job_id, c.comm_id)):
            try:
                part = comm.status()
                part.SerializeToString()  # a value out of a field's range raises here, not later
            except Exception as exc:
                refusals.log(
                    log,
                    logging.WARNING,
                    "status of a communicator unreadable",
                    "%s: its status could not be read: %r",
                    comm.name(),
                    exc,
                )
                part = pb.CommStatus(
                    job_id=comm.job_id,
                    comm_id=comm.comm_id,
                    world_size=comm.world_size,
                    failed=f"{comm.name()}: smddpd could not read its status: {str(exc)[:300]}",
                )
            reply.comms.append(part)
        return reply

    def shutdown(self, reason: str) -> None:
        """Fails every communicator and every waiting rendezvous: the daemon is stopping.

        Ranks between ops hear it too (an OpReply with request_id 0), so that their next op
        says why instead of finding a broken connection.
        """
        with self._lock:
            self._stopping = True
            forwarded = list(self._forwarded)
        for call in forwarded:
            call.cancel()
        self.rendezvous.shutdown(reason)
        # Each communicator and each rank apart: one that raises must not keep the others
        # from hearing it.
        for comm in self.comms():
            with supervise.unit("failing a communicator at shutdown", comm.name()):
                comm.fail(pb.SHUTDOWN, f"{comm.name()}: {reason}")
        for session in self.sessions():
            with supervise.unit("telling a rank of the shutdown", session.comm.name()):
                session.reply(
                    pb.OpReply(
                        request_id=0,
                        ok=False,
                        error_kind=pb.SHUTDOWN,
                        error=f"{session.comm.name()}: {reason}",
                    )
                )
