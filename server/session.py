"""One rank's membership in one communicator, and where its replies go."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from smddp.server.arena import Arena
from smddp.v1 import smddp_pb2 as pb

if TYPE_CHECKING:
    from smddp.server.communicator import Communicator


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
    pid: int
    node_id: str
    arena_bytes: int
    arena: Arena | None = None
    channel: ReplyChannel | None = None
    uid: int | None = None  # the kernel's word, at attach; counted against it from then on
    peer_pid: int = 0  # the attached process as the kernel names it (SO_PEERCRED)
    registered_at: float = field(default_factory=time.monotonic)
    ops_completed: int = 0
    closed: bool = False
    # The next (seq, part) this rank may send for collectives, and per (peer, kind) for p2p.
    next_collective: tuple[int, int] = (1, 0)
    next_p2p: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def label(self) -> str:
        """``rank 2 (pid 4711, node n1)``, the way errors name a rank."""
        return f"rank {self.rank} (pid {self.pid}, node {self.node_id})"

    def log_fields(self) -> dict[str, object]:
        """``extra=`` for a log record about this rank: the JSON log's job, comm, rank, node."""
        return {"job": self.comm.job_id, "comm": self.comm.comm_id, "rank": self.rank, "node": self.node_id}

    def reply(self, reply: pb.OpReply) -> None:
        """Sends a reply if the rank still has a channel."""
        channel = self.channel
        if channel is not None:
            channel.send_reply(reply)
