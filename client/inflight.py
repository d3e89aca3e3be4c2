"""An op in flight, as the client's paths see it: the state that its ``Handle`` shows.

The paths (``engine``, ``region_ops``, ``direct``) write into an ``InFlight`` and never
see the communicator; ``communicator.Handle`` adds the caller's side (``wait``, ``poll``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from smddp.client.errors import SmddpError
from smddp.v1 import smddp_pb2 as pb


@dataclass(eq=False)
class RegionWait:
    """A region op that this rank has arrived at and whose completion is still due."""

    seq: int
    parity: int
    target: int  # the step every other rank must reach
    finish: Callable[[int], None] | None  # reads the others' buffers, given the parity
    kind: int
    dtype: int  # wire code (0 for a barrier)
    nbytes: int  # counted in the rank's metrics


@dataclass(eq=False)
class InFlight:
    """What the paths know of one op: parts still due, its error, how it completes."""

    description: str
    pending: int = 0  # chunks (or the one region op) not yet retired
    error: SmddpError | None = None
    # A region op that waits for its completion (``region_ops``).
    region: RegionWait | None = None
    # Set once an op that the progress thread runs has finished.
    event: threading.Event | None = None

    def done(self) -> bool:
        """True once every part has been retired."""
        return self.pending == 0


class GpuSubmitter(Protocol):
    """What the GPU collectives (``cuda_ops``) need of their communicator, which is one:
    typed here so that the communicator, which makes them, and they need not import each
    other."""

    rank: int
    world_size: int
    single_node: bool

    def submit_gpu(self, req: pb.OpRequest, after: Callable[[bool], None], what: str) -> InFlight:
        """Numbers and sends one GPU op; ``after(ok)`` runs when its reply is retired."""
        ...
