"""An op in flight, as the client's paths see it: the state that its ``Handle`` shows.

The paths (``engine``, ``region_ops``, ``direct``) write into an ``InFlight`` and never
see the communicator; ``communicator.Handle`` adds the caller's side (``wait``, ``poll``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from smddp.client.errors import SmddpError
from smddp.v1 import smddp_pb2 as pb

if TYPE_CHECKING:
    from smddp.client.shm import ShmPath


class RegionWait:
    """A region op that this rank has arrived at and whose completion is still due."""

    # Plain slotted classes, not dataclasses: one of each is made per small op, and every
    # microsecond of a 4-byte all_reduce is Python.
    __slots__ = ("seq", "parity", "target", "finish", "kind", "dtype", "nbytes")

    def __init__(
        self,
        seq: int,
        parity: int,
        target: int,
        finish: Callable[[ShmPath, int], None] | None,
        kind: int,
        dtype: int,
        nbytes: int,
    ) -> None:
        self.seq = seq
        self.parity = parity
        self.target = target  # the step every other rank must reach
        self.finish = finish  # reads the others' buffers, given the parity
        self.kind = kind
        self.dtype = dtype  # wire code (0 for a barrier)
        self.nbytes = nbytes  # counted in the rank's metrics


class InFlight:
    """What the paths know of one op: parts still due, its error, how it completes."""

    __slots__ = ("what", "seq", "pending", "error", "region", "event", "source", "__weakref__")

    def __init__(
        self,
        what: str = "op",
        seq: int = 0,
        pending: int = 0,
        event: threading.Event | None = None,
    ) -> None:
        self.what = what  # the op's kind, as a user names it ("op", "send", "all_reduce")
        self.seq = seq  # its sequence number (0: not numbered)
        self.pending = pending  # chunks (or the one region op) not yet retired
        self.error: SmddpError | None = None
        # A region op that waits for its completion (``region_ops``).
        self.region: RegionWait | None = None
        # Set once an op that the progress thread runs has finished.
        self.event = event
        # A receive's sender: its peer, or for a receive from any source the rank whose send
        # it took, known once its first chunk is retired (-1 until then, and for other ops).
        self.source = -1

    @property
    def description(self) -> str:
        """The op as messages name it ("op #12"), built only when one is written."""
        return f"{self.what} #{self.seq}" if self.seq else self.what

    def done(self) -> bool:
        """True once every part has been retired."""
        return self.pending == 0


class GpuSubmitter(Protocol):
    """What the GPU collectives (``cuda_ops``) need of their communicator, which is one:
    typed here so that the communicator, which makes them, and they need not import each
    other."""

    rank: int
    world_size: int

    def submit_gpu(self, req: pb.OpRequest, after: Callable[[bool], None], what: str) -> InFlight:
        """Numbers and sends one GPU op; ``after(ok)`` runs when its reply is retired."""
        ...
