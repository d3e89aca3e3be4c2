"""Who is registered with this daemon: jobs, their communicators and the ranks' sessions."""

from __future__ import annotations

import logging
import os
import re
import secrets
import threading
import time

import grpc

from smddp.server.arena import Arena
from smddp.server.communicator import Communicator
from smddp.server.config import DaemonConfig
from smddp.server.errors import (
    FailedPrecondition,
    InvalidRequest,
    LimitExceeded,
    PermissionDenied,
    RemoteRefusal,
    Unauthenticated,
)
from smddp.server.metrics import Metrics
from smddp.server.peer_transport import CommPeers, PeerNetwork, parse_address
from smddp.server.rendezvous import RendezvousTable, rendezvous_proof
from smddp.server.session import Session
from smddp.v1 import smddp_pb2 as pb

log = logging.getLogger(__name__)

_JOB_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_COMM_ID = re.compile(r"^[\x21-\x7e]{1,256}$")
MIN_TOKEN_BYTES = 16
MAX_TOKEN_BYTES = 1024
MIN_ARENA_BYTES = 64 << 10
MAX_TIMEOUT_MS = 7 * 24 * 3600 * 1000


def _check_token(where: str, token: bytes) -> None:
    if not MIN_TOKEN_BYTES <= len(token) <= MAX_TOKEN_BYTES:
        raise InvalidRequest(f"{where}: job_token must have {MIN_TOKEN_BYTES}-{MAX_TOKEN_BYTES} bytes")


class Registry:
    """Thread-safe tables of communicators and sessions, and the rules for joining them."""

    def __init__(self, config: DaemonConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.started = time.time()
        self.metrics = metrics
        self._comms: dict[tuple[str, str], Communicator] = {}
        self._sessions: dict[str, Session] = {}
        self._job_tokens: dict[str, bytes] = {}
        self._job_owner: dict[str, int] = {}
        # HOST:PORT other daemons reach this one at; "" when the peer listener is off.
        self.peer_address = ""
        self.network: PeerNetwork | None = None  # set by the daemon when peers are enabled
        self.rendezvous = RendezvousTable(config.max_jobs)
        self._lock = threading.Lock()

    # -- joining ------------------------------------------------------------------------------

    def register(self, req: pb.RegisterRequest) -> Session:
        """Adds a rank to its communicator, creating the communicator on first contact.

        Raises:
            SmddpError: bad fields, wrong token, a taken rank slot or an exceeded limit.
        """
        cfg = self.config
        if not _JOB_ID.match(req.job_id):
            raise InvalidRequest(f"job_id {req.job_id[:140]!r} must be 1-128 characters of A-Z a-z 0-9 . _ : -")
        if not _COMM_ID.match(req.comm_id):
            raise InvalidRequest(f"job {req.job_id}: comm_id {req.comm_id[:260]!r} must be 1-256 printable characters")
        where = f"job {req.job_id} comm {req.comm_id}"
        _check_token(where, req.job_token)
        if not 1 <= req.world_size <= cfg.max_ranks_per_job:
            raise LimitExceeded(
                f"{where}: world_size {req.world_size} is outside 1..{cfg.max_ranks_per_job} (--max-ranks-per-job)"
            )
        if req.rank >= req.world_size:
            raise InvalidRequest(f"{where}: rank {req.rank} is outside a world of {req.world_size}")
        if not MIN_ARENA_BYTES <= req.arena_bytes <= cfg.max_arena_bytes:
            raise LimitExceeded(
                f"{where} rank {req.rank}: arena_bytes {req.arena_bytes} is outside "
                f"{MIN_ARENA_BYTES}..{cfg.max_arena_bytes} (--max-arena-bytes)"
            )
        timeout_s = self._timeout_s(where, req.timeout_ms)
        nodes, my_node = self._layout(req, where)
        key = (req.job_id, req.comm_id)
        with self._lock:
            token = self._job_tokens.get(req.job_id)
            if token is None:
                if len(self._job_tokens) >= cfg.max_jobs:
                    raise LimitExceeded(f"{where}: the daemon already serves {cfg.max_jobs} jobs (--max-jobs)")
            elif not secrets.compare_digest(token, req.job_token):
                raise Unauthenticated(f"{where} rank {req.rank}: wrong job token")
            comm = self._comms.get(key)
            if comm is None:
                # The client keeps half its arena for direct ops; the other half, its ring,
                # must hold two chunks (plus alignment) for them to pipeline.
                chunk = max(4096, min(cfg.chunk_bytes, req.arena_bytes // 4) // 64 * 64)
                comm = Communicator(
                    req.job_id, req.comm_id, req.world_size, req.job_token, timeout_s, chunk, self.metrics,
                    nodes=nodes, my_node=my_node,
                )
                if len(comm.nodes) > 1:
                    comm.attach_peers(
                        CommPeers(
                            comm, my_node, [n.node_id for n in req.nodes], [n.peer_address for n in req.nodes],
                            self.metrics, self.network,
                        )
                    )
                self._comms[key] = comm
                self._job_tokens[req.job_id] = req.job_token
            else:
                if comm.world_size != req.world_size:
                    raise FailedPrecondition(
                        f"{where}: rank {req.rank} registered with world_size {req.world_size} "
                        f"but the communicator has {comm.world_size} ranks"
                    )
                if comm.nodes != (nodes or [list(range(req.world_size))]) or comm.my_node != my_node:
                    raise FailedPrecondition(
                        f"{where}: rank {req.rank} describes the job's nodes differently than the "
                        "ranks registered before it"
                    )
                if req.rank in comm.members:
                    other = comm.members[req.rank]
                    raise FailedPrecondition(f"{where}: rank {req.rank} is already registered ({other.label()})")
                if req.arena_bytes // 4 < comm.chunk_bytes:
                    raise InvalidRequest(
                        f"{where} rank {req.rank}: arena of {req.arena_bytes} bytes is smaller than "
                        f"4 x the communicator's chunk of {comm.chunk_bytes} bytes"
                    )
            session = Session(
                session_id=secrets.token_hex(16),
                secret=secrets.token_bytes(32),
                comm=comm,
                rank=req.rank,
                global_rank=req.global_rank,
                pid=req.pid,
                node_id=req.node_id or "?",
                arena_bytes=req.arena_bytes,
            )
            comm.add(session)
            self._sessions[session.session_id] = session
        log.info("%s: registered %s", where, session.label(), extra=session.log_fields())
        return session

    def _layout(self, req: pb.RegisterRequest, where: str) -> tuple[list[list[int]] | None, int]:
        """Checks the node layout of a registration; returns (ranks per node, this node's index)."""
        if not req.nodes:
            return None, 0
        seen: set[int] = set()
        nodes: list[list[int]] = []
        ids = [n.node_id for n in req.nodes]
        if len(set(ids)) != len(ids):
            raise InvalidRequest(f"{where}: node ids repeat in the layout: {ids}")
        for spec in req.nodes:
            ranks = list(spec.ranks)
            if not ranks or ranks != sorted(set(ranks)) or any(r >= req.world_size for r in ranks) or seen & set(ranks):
                raise InvalidRequest(
                    f"{where}: node {spec.node_id} lists ranks {ranks[:16]}: expected ascending, distinct "
                    f"ranks below {req.world_size} that no other node lists"
                )
            seen |= set(ranks)
            nodes.append(ranks)
        if len(seen) != req.world_size:
            raise InvalidRequest(f"{where}: the layout places {len(seen)} of {req.world_size} ranks")
        my_node = next(i for i, ranks in enumerate(nodes) if req.rank in ranks)
        if len(nodes) > 1:
            if not self.peer_address or self.network is None:
                raise FailedPrecondition(
                    f"{where}: the job spans {len(nodes)} nodes but this daemon accepts no peer "
                    "connections (--peer-bind off)"
                )
            for spec in req.nodes:
                try:
                    parse_address(spec.peer_address)
                except ValueError:
                    raise InvalidRequest(f"{where}: node {spec.node_id} has no valid peer address ({spec.peer_address!r})") from None
        return nodes, my_node

    def meet(self, req: pb.RendezvousRequest) -> list[pb.NodeSpec]:
        """A local rank's rendezvous (``Node.Rendezvous``): hosted here or forwarded to the root.

        Raises:
            SmddpError: bad fields, a refusal of the root, or ranks missing at the timeout.
        """
        where = f"rendezvous of job {req.job_id[:64]}"
        if not _JOB_ID.match(req.job_id):
            raise InvalidRequest(f"{where}: job_id must be 1-128 characters of A-Z a-z 0-9 . _ : -")
        _check_token(where, req.job_token)
        timeout_s = self._timeout_s(where, req.timeout_ms)
        proof = rendezvous_proof(req.job_token, req.job_id)
        node_id, address = self.config.node_id, self.peer_address or "none"
        if not req.root or req.root == self.peer_address:
            return self.rendezvous.meet(req.job_id, proof, req.rank, req.world_size, node_id, address, timeout_s)
        if self.network is None:
            raise FailedPrecondition(f"{where}: the root is another daemon ({req.root}) but this one has no peers (--peer-bind off)")
        try:
            parse_address(req.root)
        except ValueError:
            raise InvalidRequest(f"{where}: root {req.root[:100]!r} is not HOST:PORT") from None
        stub = self.network.control.stub(req.root, req.root_node_id or parse_address(req.root)[0])
        meet = pb.MeetRequest(
            job_id=req.job_id, proof=proof, rank=req.rank, world_size=req.world_size, node_id=node_id,
            peer_address=address, timeout_ms=int(timeout_s * 1000),
        )
        try:
            return list(stub.Meet(meet, timeout=timeout_s + 10).nodes)
        except grpc.RpcError as exc:
            raise RemoteRefusal(exc.code(), f"{where}: the root's daemon at {req.root}: {exc.details() or exc.code()}") from None

    def _timeout_s(self, where: str, timeout_ms: int) -> float:
        """A client's timeout in seconds; 0 means the daemon's default."""
        if timeout_ms > MAX_TIMEOUT_MS:
            raise InvalidRequest(f"{where}: timeout_ms {timeout_ms} exceeds 7 days")
        return timeout_ms / 1000 if timeout_ms else self.config.default_timeout_s

    def find_comm(self, job_id: str, comm_id: str) -> Communicator | None:
        """The communicator a peer daemon asks for, if registered here."""
        with self._lock:
            return self._comms.get((job_id, comm_id))

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

    def attach(self, session: Session, fd: int, uid: int) -> None:
        """Maps the session's arena from ``fd`` after checking the client's uid.

        Raises:
            SmddpError: already attached, another user's job, or a bad memfd.
        """
        comm = session.comm
        try:
            if session.arena is not None:
                raise FailedPrecondition(f"{comm.name()}: {session.label()} has already attached its arena")
            with self._lock:
                owner = self._job_owner.setdefault(comm.job_id, uid)
            if owner != uid:
                refusal = f"{comm.name()}: uid {uid} may not join job {comm.job_id}, which belongs to uid {owner}"
                # The rank never took part: forget it (its slot frees) without failing the job.
                self._drop(session, refusal, pb.UNAUTHENTICATED, logging.INFO, fail=False)
                raise PermissionDenied(refusal)
        except Exception:
            os.close(fd)
            raise
        session.uid = uid
        session.arena = Arena(fd, session.arena_bytes, f"{comm.name()} {session.label()}")
        comm.attached()

    # -- leaving ------------------------------------------------------------------------------

    def deregister(self, session: Session) -> None:
        """Removes a rank that left cleanly (destroy_process_group)."""
        why = f"{session.comm.name()}: {session.label()} has left the communicator (destroy_process_group)"
        self._drop(session, why, pb.RANK_FAILED, logging.INFO)

    def connection_lost(self, session: Session, detail: str) -> None:
        """Removes a rank whose connection broke; its communicator fails on the other ranks."""
        why = (
            f"{session.comm.name()}: {session.label()} disconnected without leaving the "
            f"communicator ({detail}); its process died or closed its connection"
        )
        self._drop(session, why, pb.RANK_FAILED)

    def _drop(
        self, session: Session, why: str, kind: int, log_level: int = logging.WARNING, fail: bool = True
    ) -> None:
        with self._lock:
            if session.closed:
                return
            session.closed = True
            self._sessions.pop(session.session_id, None)
        comm = session.comm
        empty = comm.remove(session, why, kind, log_level, fail)
        if empty:
            # The communicator logs a departure only when it fails others; the last one, here.
            log.log(log_level, "%s", why, extra=session.log_fields())
            with self._lock:
                if self._comms.get((comm.job_id, comm.comm_id)) is comm:
                    del self._comms[(comm.job_id, comm.comm_id)]
                job_over = not any(k[0] == comm.job_id for k in self._comms)
                if job_over:
                    self._job_tokens.pop(comm.job_id, None)
                    self._job_owner.pop(comm.job_id, None)
            if job_over and self.metrics is not None:
                self.metrics.job_ended(comm.job_id)
            comm.close()
        if session.arena is not None:
            session.arena.close()

    # -- looking ------------------------------------------------------------------------------

    def comms(self) -> list[Communicator]:
        """A snapshot of the live communicators."""
        with self._lock:
            return list(self._comms.values())

    def session_count(self) -> int:
        """Number of registered ranks."""
        with self._lock:
            return len(self._sessions)

    def job_count(self) -> int:
        """Number of jobs with at least one communicator."""
        with self._lock:
            return len(self._job_tokens)

    def sessions(self) -> list[Session]:
        """A snapshot of the registered ranks."""
        with self._lock:
            return list(self._sessions.values())

    def status(self, version: str) -> pb.StatusReply:
        """Everything smddpctl status shows."""
        reply = pb.StatusReply(
            node_id=self.config.node_id, version=version, uptime_seconds=time.time() - self.started
        )
        for comm in sorted(self.comms(), key=lambda c: (c.job_id, c.comm_id)):
            reply.comms.append(comm.status())
        return reply

    def shutdown(self, reason: str) -> None:
        """Fails every communicator: the daemon is stopping."""
        for comm in self.comms():
            comm.fail(pb.SHUTDOWN, f"{comm.name()}: {reason}")
