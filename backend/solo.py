"""The collectives of a group of one rank, done in place (``new_group([rank])``, world size 1).

With one rank there is nothing to exchange: a reduction is the identity (AVG divides by one),
a gather or scatter is one copy, a barrier returns. Sending such an op through the daemon
cost a round trip over the data socket, ~0.3 ms, per op. ``SoloOps`` has the numpy
collectives of ``smddp.client.Communicator`` with the same argument checks and messages (the
client's own helpers), runs them at the call and returns a completed Handle. An op on a
destroyed group raises the communicator's error; an op after the daemon went away raises
``DaemonLostError``, as one sent to it would (checked at most every ``ALIVE_CHECK_S``: the
ops need no daemon, so a dead one would otherwise go unnoticed). Everything else (send and
recv, the GPU path, close) stays with the communicator.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from smddp.client import Communicator, Handle, ReduceOp
from smddp.client.checks import check_reduce, check_root, code_of, flat, per_rank
from smddp.client.errors import UnsupportedError

# How often an op asks whether the daemon is still there (a poll(2) of its socket).
ALIVE_CHECK_S = 0.1


class SoloOps:
    """The numpy collectives of a one-rank communicator, carried out in place."""

    def __init__(self, comm: Communicator) -> None:
        if comm.world_size != 1:
            raise ValueError(f"SoloOps needs a communicator of one rank, not {comm.world_size}")
        self.comm = comm
        self._next_alive_check = 0.0

    def _done(self) -> Handle:
        """A Handle of an op that has completed (after the group's state is checked)."""
        comm = self.comm
        comm._check_open()
        now = time.monotonic()
        if now >= self._next_alive_check:
            self._next_alive_check = now + ALIVE_CHECK_S
            if not comm.session.alive():
                raise comm.session.gone()
        return Handle(comm)

    def all_reduce(self, array: np.ndarray, reduce_op: ReduceOp | int = ReduceOp.SUM) -> Handle:
        """The identity, after the client's checks (AVG over one rank divides by one)."""
        data = flat(array, "all_reduce", writable=True)
        check_reduce(code_of(data.dtype), reduce_op)
        return self._done()

    def broadcast(self, array: np.ndarray, root: int) -> Handle:
        """The identity: the only rank is the root."""
        flat(array, "broadcast", writable=True)
        check_root(root, self.comm.world_size, "broadcast")
        return self._done()

    def reduce(
        self, array: np.ndarray, root: int, reduce_op: ReduceOp | int = ReduceOp.SUM
    ) -> Handle:
        """The identity on the root, the only rank."""
        data = flat(array, "reduce", writable=True)
        check_root(root, self.comm.world_size, "reduce")
        check_reduce(code_of(data.dtype), reduce_op)
        return self._done()

    def all_gather(self, outputs: Sequence[np.ndarray], array: np.ndarray) -> Handle:
        """``outputs[0]`` becomes a copy of ``array``."""
        return self._gather_like(outputs, array, "all_gather")

    def gather(self, outputs: Sequence[np.ndarray] | None, array: np.ndarray, root: int) -> Handle:
        """On the root (the only rank) ``outputs[0]`` becomes a copy of ``array``."""
        check_root(root, self.comm.world_size, "gather")
        return self._gather_like(outputs, array, "gather")

    def _gather_like(
        self, outputs: Sequence[np.ndarray] | None, array: np.ndarray, what: str
    ) -> Handle:
        src = flat(array, what)
        outs = per_rank(outputs, self.comm.world_size, src.size, src.dtype, what, writable=True)
        handle = self._done()
        if outs is not None:
            np.copyto(outs[0], src)
        return handle

    def reduce_scatter(
        self,
        output: np.ndarray,
        inputs: Sequence[np.ndarray],
        reduce_op: ReduceOp | int = ReduceOp.SUM,
    ) -> Handle:
        """``output`` becomes a copy of ``inputs[0]`` (a reduction over one rank)."""
        out = flat(output, "reduce_scatter", writable=True)
        check_reduce(code_of(out.dtype), reduce_op)
        return self._scatter_like(out, inputs, "reduce_scatter")

    def scatter(self, output: np.ndarray, inputs: Sequence[np.ndarray] | None, root: int) -> Handle:
        """``output`` becomes a copy of the root's (this rank's) ``inputs[0]``."""
        out = flat(output, "scatter", writable=True)
        check_root(root, self.comm.world_size, "scatter")
        return self._scatter_like(out, inputs, "scatter")

    def _scatter_like(
        self, out: np.ndarray, inputs: Sequence[np.ndarray] | None, what: str
    ) -> Handle:
        if inputs is None:
            # Only the root passes inputs, and the root is this rank.
            raise UnsupportedError(f"{what}: the root (rank 0) must pass its input tensors")
        ins = per_rank(inputs, self.comm.world_size, out.size, out.dtype, what, writable=False)
        handle = self._done()
        np.copyto(out, ins[0])  # type: ignore[index]
        return handle

    def all_to_all(self, outputs: Sequence[np.ndarray], inputs: Sequence[np.ndarray]) -> Handle:
        """``outputs[0]`` becomes a copy of ``inputs[0]``. Blocks of different sizes go to the
        communicator, whose daemon reports the mismatch as it does for any world."""
        if len(inputs) != 1 or len(outputs) != 1:
            raise UnsupportedError("all_to_all: expected 1 input and 1 output tensors")
        src = flat(inputs[0], "all_to_all")
        out = flat(outputs[0], "all_to_all", writable=True)
        if src.dtype != out.dtype:
            raise UnsupportedError("all_to_all: every input and output must have the same dtype")
        if src.size != out.size:
            return self.comm.all_to_all(outputs, inputs)
        handle = self._done()
        np.copyto(out, src)
        return handle

    def barrier(self) -> Handle:
        """Returns at once: the only rank has arrived."""
        return self._done()

    def send(self, array: np.ndarray, dst: int, tag: int = 0) -> Handle:
        """The communicator's (it refuses a send to the only rank, itself)."""
        return self.comm.send(array, dst, tag)

    def recv(self, array: np.ndarray, src: int, tag: int = 0) -> Handle:
        """The communicator's (it refuses a receive from the only rank, itself)."""
        return self.comm.recv(array, src, tag)

    def recv_any(self, array: np.ndarray, tag: int = 0) -> Handle:
        """The communicator's (it refuses a receive where no other rank can send)."""
        return self.comm.recv_any(array, tag)
