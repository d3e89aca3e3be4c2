"""Collectives on GPU memory: one ``CudaOp`` request per op, no arena, no host copies.

Framework-neutral: a tensor is a ``DeviceArray`` (address, element count, wire dtype), and
the framework supplies the op's two interprocess CUDA events (``OpEvents``): "ready",
already recorded on the stream that wrote the inputs, and "done", which the daemon records
once its work is complete. Each call checks its arguments, exports the buffers' CUDA IPC
handles (``cuda_ipc``), sends the op and returns a Handle at once; when the reply is retired
``events.finish(ok)`` runs, and the framework makes its stream wait on "done" there. The
host never waits for the GPU.

One path whatever the layout: in a communicator spanning nodes the daemon combines its
node's tensors on the GPU and exchanges them with the other nodes through pinned host memory
(``server/gpu.py``'s ``execute_across``); the request is the same.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from smddp.client.checks import check_reduce, check_root
from smddp.client.cuda_ipc import IpcExporter
from smddp.client.errors import UnsupportedError
from smddp.core.op import OpKind, OpSpec, ReduceOp
from smddp.core.wire import dtype_name, numpy_dtype, op_request
from smddp.v1 import smddp_pb2 as pb

if TYPE_CHECKING:
    from smddp.client.inflight import GpuSubmitter as Communicator
    from smddp.client.inflight import InFlight as Handle


@dataclass(frozen=True)
class DeviceArray:
    """``count`` contiguous elements of wire dtype ``dtype`` at address ``ptr`` of this
    process's GPU ``device`` (its ordinal here)."""

    ptr: int
    count: int
    dtype: int
    device: int

    @property
    def nbytes(self) -> int:
        return self.count * numpy_dtype(self.dtype).itemsize


class OpEvents(Protocol):
    """The interprocess CUDA events of one GPU op, owned by the framework."""

    ready: bytes  # cudaIpcEventHandle of an event recorded after the inputs were written
    done: bytes  # cudaIpcEventHandle of an event the daemon records when it is finished

    def finish(self, ok: bool) -> None:
        """The reply is in (``ok``: the daemon queued the work): wait on ``done`` if ok, and
        release the events. Must not raise."""


# The process's exporter: handles are per allocation, whatever communicator uses them.
_exporter = IpcExporter()


class CudaCollectives:
    """The GPU collectives of one Communicator (``comm.cuda``)."""

    def __init__(self, comm: Communicator, exporter: IpcExporter | None = None) -> None:
        self.comm = comm
        self._exporter: IpcExporter = exporter or _exporter
        self._freed_cursor = self._exporter.freed_cursor()
        self._freed_lock = threading.Lock()

    @property
    def exporter(self) -> IpcExporter:
        """The exporter of this communicator's buffers."""
        return self._exporter

    @exporter.setter
    def exporter(self, exporter: IpcExporter) -> None:
        self._exporter = exporter
        self._freed_cursor = exporter.freed_cursor()

    # -- building one request -------------------------------------------------------------------

    def _op(
        self,
        what: str,
        spec: OpSpec,
        inputs: Sequence[DeviceArray],
        outputs: Sequence[DeviceArray],
        events: OpEvents,
    ) -> Handle:
        dtype = spec.dtype
        arrays = [*inputs, *outputs]
        for a in arrays:
            if a.dtype != dtype:
                raise UnsupportedError(
                    f"{what}: "
                    f"every tensor must be {dtype_name(dtype)}, got one of {dtype_name(a.dtype)}"
                )
        devices = {a.device for a in arrays}
        if len(devices) != 1:
            raise UnsupportedError(
                f"{what}: one call's tensors must be on one GPU, got GPUs {sorted(devices)}"
            )
        device = devices.pop()
        cuda = pb.CudaOp(
            device_uuid=self.exporter.device_uuid(device, what),
            ready_event=events.ready,
            done_event=events.done,
        )
        # Allocations freed since this communicator's last op go first: the daemon closes
        # them before mapping this op's buffers, one of which may be new at a freed base.
        self.exporter.sweep(device, what)
        for target, group in ((cuda.inputs, inputs), (cuda.outputs, outputs)):
            for a in group:
                target.append(self.exporter.export(a.ptr, a.nbytes, device, what))
        with self._freed_lock:
            self._freed_cursor, freed = self.exporter.freed_since(self._freed_cursor)
        cuda.freed.extend(freed)
        req = op_request(spec)
        req.cuda.CopyFrom(cuda)
        return self.comm.submit_gpu(req, events.finish, what)

    def _per_rank(self, arrays: Sequence[DeviceArray], n: int, what: str) -> None:
        w = self.comm.world_size
        if len(arrays) != w:
            raise UnsupportedError(
                f"{what}: expected {w} tensors (one per rank), got {len(arrays)}"
            )
        for r, a in enumerate(arrays):
            if a.count != n:
                raise UnsupportedError(
                    f"{what}: tensor {r} has {a.count} elements where {n} were expected"
                )

    # -- collectives --------------------------------------------------------------------------

    def all_reduce(self, array: DeviceArray, reduce_op: ReduceOp | int, events: OpEvents) -> Handle:
        """Reduces ``array`` across ranks in place (rank order, the host path's bits)."""
        check_reduce(array.dtype, reduce_op)
        spec = OpSpec(OpKind.ALL_REDUCE, array.dtype, array.count, 0, reduce_op)
        return self._op("all_reduce", spec, [array], [array], events)

    def broadcast(self, array: DeviceArray, root: int, events: OpEvents) -> Handle:
        """Copies the root's ``array`` into every rank's."""
        check_root(root, self.comm.world_size, "broadcast")
        spec = OpSpec(OpKind.BROADCAST, array.dtype, array.count, root)
        return self._op("broadcast", spec, [array], [array], events)

    def reduce(
        self, array: DeviceArray, root: int, reduce_op: ReduceOp | int, events: OpEvents
    ) -> Handle:
        """Reduces ``array`` across ranks into the root's."""
        check_root(root, self.comm.world_size, "reduce")
        check_reduce(array.dtype, reduce_op)
        spec = OpSpec(OpKind.REDUCE, array.dtype, array.count, root, reduce_op)
        return self._op("reduce", spec, [array], [array], events)

    def all_gather(
        self, outputs: Sequence[DeviceArray], array: DeviceArray, events: OpEvents
    ) -> Handle:
        """Gathers every rank's ``array`` into ``outputs[r]`` on every rank."""
        self._per_rank(outputs, array.count, "all_gather")
        spec = OpSpec(OpKind.ALL_GATHER, array.dtype, array.count)
        return self._op("all_gather", spec, [array], outputs, events)

    def gather(
        self, outputs: Sequence[DeviceArray] | None, array: DeviceArray, root: int, events: OpEvents
    ) -> Handle:
        """Gathers every rank's ``array`` into the root's ``outputs[r]`` (None elsewhere)."""
        check_root(root, self.comm.world_size, "gather")
        outs = list(outputs) if self.comm.rank == root and outputs is not None else []
        if self.comm.rank == root:
            self._per_rank(outs, array.count, "gather")
        spec = OpSpec(OpKind.GATHER, array.dtype, array.count, root)
        return self._op("gather", spec, [array], outs, events)

    def reduce_scatter(
        self,
        output: DeviceArray,
        inputs: Sequence[DeviceArray],
        reduce_op: ReduceOp | int,
        events: OpEvents,
    ) -> Handle:
        """Rank r's ``output`` becomes the reduction over ranks of their ``inputs[r]``."""
        check_reduce(output.dtype, reduce_op)
        self._per_rank(inputs, output.count, "reduce_scatter")
        spec = OpSpec(OpKind.REDUCE_SCATTER, output.dtype, output.count, 0, reduce_op)
        return self._op("reduce_scatter", spec, inputs, [output], events)

    def scatter(
        self, output: DeviceArray, inputs: Sequence[DeviceArray] | None, root: int, events: OpEvents
    ) -> Handle:
        """Rank r's ``output`` becomes the root's ``inputs[r]``."""
        check_root(root, self.comm.world_size, "scatter")
        ins = list(inputs) if self.comm.rank == root and inputs is not None else []
        if self.comm.rank == root:
            self._per_rank(ins, output.count, "scatter")
        spec = OpSpec(OpKind.SCATTER, output.dtype, output.count, root)
        return self._op("scatter", spec, ins, [output], events)

    def all_to_all(
        self, outputs: Sequence[DeviceArray], inputs: Sequence[DeviceArray], events: OpEvents
    ) -> Handle:
        """Sends ``inputs[d]`` to rank d and receives rank s's block into ``outputs[s]``
        (uneven sizes allowed; the daemon checks that they agree pairwise)."""
        w = self.comm.world_size
        if len(inputs) != w or len(outputs) != w:
            raise UnsupportedError(f"all_to_all: expected {w} input and {w} output tensors")
        spec = OpSpec(OpKind.ALL_TO_ALL, inputs[0].dtype, sum(x.count for x in inputs))
        return self._op("all_to_all", spec, inputs, outputs, events)

    def send(self, array: DeviceArray, dst: int, tag: int, events: OpEvents) -> Handle:
        """Sends ``array`` to rank ``dst`` (which calls ``recv`` with the same size)."""
        self._check_peer(dst, "send")
        spec = OpSpec(OpKind.SEND, array.dtype, array.count, dst, tag=tag)
        return self._op("send", spec, [array], [], events)

    def recv(self, array: DeviceArray, src: int, tag: int, events: OpEvents) -> Handle:
        """Receives into ``array`` from rank ``src``."""
        self._check_peer(src, "recv")
        spec = OpSpec(OpKind.RECV, array.dtype, array.count, src, tag=tag)
        return self._op("recv", spec, [], [array], events)

    def _check_peer(self, peer: int, what: str) -> None:
        check_root(peer, self.comm.world_size, what)
        if peer == self.comm.rank:
            raise UnsupportedError(f"{what}: rank {peer} cannot {what} to or from itself")
