"""CUDA tensors in the smddp ProcessGroup: the GPU path of every collective.

A collective whose tensors are on a GPU comes here from ``process_group.py``. Each method
checks the tensors (all on one GPU, dense, a supported dtype), makes contiguous stand-ins
where needed, records an interprocess "ready" event on the tensors' current stream, and
calls the client's GPU collective (``comm.cuda``), which sends CUDA IPC handles to the
daemon and returns at once. When the op's reply is retired, that stream waits on the
daemon's "done" event; ``SmddpWork.wait()`` then orders the caller's current stream after
it and copies non-contiguous outputs back. The host never blocks on the GPU.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

import torch
from torch._C import _distributed_c10d as c10d

from smddp.backend.tensors import SUPPORTED, reduce_op
from smddp.backend.work import SmddpWork
from smddp.client import Communicator
from smddp.client.cuda_ops import DeviceArray
from smddp.client.errors import UnsupportedError
from smddp.v1 import smddp_pb2 as pb

log = logging.getLogger(__name__)

WIRE_DTYPES: dict[torch.dtype, int] = {
    torch.float16: pb.FLOAT16,
    torch.bfloat16: pb.BFLOAT16,
    torch.float32: pb.FLOAT32,
    torch.float64: pb.FLOAT64,
    torch.int8: pb.INT8,
    torch.uint8: pb.UINT8,
    torch.int16: pb.INT16,
    torch.int32: pb.INT32,
    torch.int64: pb.INT64,
    torch.bool: pb.BOOL,
}


def on_cuda(*items: object) -> bool:
    """True when any tensor among ``items`` (tensors, lists, lists of lists) is on a GPU."""

    def walk(x: object) -> Iterable[torch.Tensor]:
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            for y in x:
                yield from walk(y)

    return any(t.device.type == "cuda" for item in items for t in walk(item))


class _EventPair:
    """An interprocess ready and done event on one GPU, with their IPC handles."""

    def __init__(self, device: int) -> None:
        with torch.cuda.device(device):
            self.ready = torch.cuda.Event(interprocess=True)
            self.done = torch.cuda.Event(interprocess=True)
            self.ready_handle = self.ready.ipc_handle()
            self.done_handle = self.done.ipc_handle()


class _EventPool:
    """Event pairs for ops in flight, reused once an op's reply is retired (the daemon has
    then recorded done, and this process's stream already waits on it): the daemon opens
    each handle once, so a bounded pool keeps its cache bounded."""

    def __init__(self) -> None:
        self._free: dict[int, list[_EventPair]] = {}
        self._lock = threading.Lock()

    def take(self, device: int) -> _EventPair:
        with self._lock:
            free = self._free.setdefault(device, [])
            if free:
                return free.pop()
        return _EventPair(device)

    def give_back(self, device: int, pair: _EventPair) -> None:
        with self._lock:
            self._free.setdefault(device, []).append(pair)


class _OpEvents:
    """The client's ``OpEvents`` for one op: ready is recorded on construction."""

    def __init__(
        self, pool: _EventPool, device: int, stream: torch.cuda.Stream, keep: list[torch.Tensor]
    ) -> None:
        self._pool = pool
        self._device = device
        self._pair: _EventPair | None = pool.take(device)
        self._stream = stream
        # The tensors the daemon reads or writes (stand-ins included) live until the reply.
        self._keep: list[torch.Tensor] | None = keep
        self.ready = self._pair.ready_handle
        self.done = self._pair.done_handle
        self._pair.ready.record(stream)

    def finish(self, ok: bool) -> None:
        pair, self._pair = self._pair, None
        if pair is None:
            return
        try:
            if ok:
                # Later work on the stream (the caching allocator's reuse of these tensors
                # included) runs after the daemon's.
                self._stream.wait_event(pair.done)
        except Exception:  # must not raise into the client's retirement of the op
            log.exception("smddp: making the stream wait on the daemon's done event failed")
        finally:
            self._keep = None
            self._pool.give_back(self._device, pair)


_pool = _EventPool()


class CudaCollectives:
    """The GPU path of one SmddpProcessGroup; method signatures follow the ProcessGroup's."""

    def __init__(self, comm: Communicator, rank: int, size: int) -> None:
        self.comm = comm
        self.rank = rank
        self.size = size

    # -- checks and plumbing --------------------------------------------------------------------

    def _device(self, what: str, tensors: Iterable[torch.Tensor]) -> int:
        """The one GPU of ``tensors``, after checking them.

        Raises:
            UnsupportedError: no CUDA in this torch, tensors on several devices, sparse
                tensors or an unsupported dtype.
        """
        if not torch.cuda.is_available():
            raise UnsupportedError(
                f"{what}: got CUDA tensors, but this torch build has no usable CUDA "
                f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}); "
                "smddp needs a CUDA build of torch and a GPU for them"
            )
        devices = set()
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise UnsupportedError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cuda":
                raise UnsupportedError(
                    f"{what}: mixes tensors on {t.device} with CUDA tensors; pass all of a "
                    "call's tensors on the same GPU"
                )
            if t.layout != torch.strided:
                raise UnsupportedError(
                    f"{what}: {t.layout} tensors are not supported, only dense ones"
                )
            if t.dtype not in SUPPORTED:
                names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED)
                raise UnsupportedError(
                    f"{what}: dtype {str(t.dtype).removeprefix('torch.')} is not supported ({names})"
                )
            devices.add(
                t.device.index if t.device.index is not None else torch.cuda.current_device()
            )
        if len(devices) != 1:
            raise UnsupportedError(
                f"{what}: tensors on GPUs {sorted(devices)}; one call's tensors must share one GPU"
            )
        return devices.pop()

    @staticmethod
    def _array(t: torch.Tensor) -> DeviceArray:
        return DeviceArray(t.data_ptr(), t.numel(), WIRE_DTYPES[t.dtype], t.get_device())

    def _run(
        self,
        device: int,
        keep: list[torch.Tensor],
        result: list[torch.Tensor],
        copy_back: list[tuple[torch.Tensor, torch.Tensor]],
        call: Callable[[_OpEvents], object],
    ) -> SmddpWork:
        """Records ready on the current stream, makes the client call, wraps its handle."""
        stream = torch.cuda.current_stream(device)
        events = _OpEvents(_pool, device, stream, keep)
        try:
            handle = call(events)
        except BaseException:
            events.finish(False)
            raise
        return SmddpWork([handle], result, _finisher(device, stream, copy_back))  # type: ignore[list-item]

    @staticmethod
    def _out(t: torch.Tensor, copy_back: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        if t.is_contiguous():
            return t
        tmp = t.contiguous()
        copy_back.append((t, tmp))
        return tmp

    def _same(self, ref: torch.Tensor, others: list[torch.Tensor], what: str) -> None:
        for i, o in enumerate(others):
            if o.numel() != ref.numel() or o.dtype != ref.dtype:
                raise UnsupportedError(
                    f"{what}: tensor {i} has {o.numel()} x {o.dtype} but {ref.numel()} x {ref.dtype} was expected"
                )

    # -- collectives --------------------------------------------------------------------------

    def allreduce(
        self, tensors: list[torch.Tensor], opts: c10d.AllreduceOptions, what: str = "all_reduce"
    ) -> SmddpWork:
        """all_reduce of each tensor (one op each; ``all_reduce_coalesced`` passes several)."""
        op = reduce_op(opts.reduceOp, what)
        device = self._device(what, tensors)
        works = []
        for t in tensors:
            copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
            b = self._out(t, copy_back)
            works.append(
                self._run(
                    device,
                    [b],
                    [t],
                    copy_back,
                    lambda ev, b=b: self.comm.cuda.all_reduce(self._array(b), op, ev),
                )
            )
        return works[0] if len(works) == 1 else _joined(works, list(tensors))

    def broadcast(self, tensors: list[torch.Tensor], opts: c10d.BroadcastOptions) -> SmddpWork:
        what = "broadcast"
        device = self._device(what, tensors)
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        (t,) = tensors
        b = self._out(t, copy_back)
        return self._run(
            device,
            [b],
            [t],
            copy_back,
            lambda ev: self.comm.cuda.broadcast(self._array(b), opts.rootRank, ev),
        )

    def reduce(self, tensors: list[torch.Tensor], opts: c10d.ReduceOptions) -> SmddpWork:
        what = "reduce"
        op = reduce_op(opts.reduceOp, what)
        device = self._device(what, tensors)
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        (t,) = tensors
        b = self._out(t, copy_back)
        return self._run(
            device,
            [b],
            [t],
            copy_back,
            lambda ev: self.comm.cuda.reduce(self._array(b), opts.rootRank, op, ev),
        )

    def allgather(self, outs: list[torch.Tensor], src: torch.Tensor) -> SmddpWork:
        what = "all_gather"
        device = self._device(what, [src, *outs])
        self._same(src, outs, what)
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        bufs = [self._out(o, copy_back) for o in outs]
        s = src.contiguous()
        return self._run(
            device,
            [s, *bufs],
            list(outs),
            copy_back,
            lambda ev: self.comm.cuda.all_gather(
                [self._array(b) for b in bufs], self._array(s), ev
            ),
        )

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor) -> SmddpWork:
        what = "all_gather_into_tensor"
        device = self._device(what, [output, input])
        if output.numel() != input.numel() * self.size or output.dtype != input.dtype:
            raise UnsupportedError(
                f"{what}: output has {output.numel()} x {output.dtype} but {self.size} ranks x "
                f"{input.numel()} x {input.dtype} are gathered"
            )
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        buf = self._out(output, copy_back)
        pieces = list(buf.reshape(self.size, -1))
        s = input.contiguous()
        return self._run(
            device,
            [s, buf],
            [output],
            copy_back,
            lambda ev: self.comm.cuda.all_gather(
                [self._array(p) for p in pieces], self._array(s), ev
            ),
        )

    def reduce_scatter(
        self, out: torch.Tensor, ins: list[torch.Tensor], opts: c10d.ReduceScatterOptions
    ) -> SmddpWork:
        what = "reduce_scatter"
        op = reduce_op(opts.reduceOp, what)
        device = self._device(what, [out, *ins])
        self._same(out, ins, what)
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        buf = self._out(out, copy_back)
        srcs = [x.contiguous() for x in ins]
        return self._run(
            device,
            [buf, *srcs],
            [out],
            copy_back,
            lambda ev: self.comm.cuda.reduce_scatter(
                self._array(buf), [self._array(x) for x in srcs], op, ev
            ),
        )

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: c10d.ReduceScatterOptions
    ) -> SmddpWork:
        what = "reduce_scatter_tensor"
        op = reduce_op(opts.reduceOp, what)
        device = self._device(what, [output, input])
        if input.numel() != output.numel() * self.size or output.dtype != input.dtype:
            raise UnsupportedError(
                f"{what}: input has {input.numel()} x {input.dtype} but {self.size} ranks x "
                f"{output.numel()} x {output.dtype} are expected"
            )
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        buf = self._out(output, copy_back)
        src = input.contiguous()
        pieces = list(src.reshape(self.size, -1))
        return self._run(
            device,
            [buf, src],
            [output],
            copy_back,
            lambda ev: self.comm.cuda.reduce_scatter(
                self._array(buf), [self._array(p) for p in pieces], op, ev
            ),
        )

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> SmddpWork:
        what = "all_to_all"
        device = self._device(what, [*outputs, *inputs])
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        bufs = [self._out(o, copy_back) for o in outputs]
        srcs = [x.contiguous() for x in inputs]
        return self._run(
            device,
            [*bufs, *srcs],
            list(outputs),
            copy_back,
            lambda ev: self.comm.cuda.all_to_all(
                [self._array(b) for b in bufs], [self._array(x) for x in srcs], ev
            ),
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        split: Callable[[torch.Tensor, list[int], str, str], list[torch.Tensor]],
    ) -> SmddpWork:
        """``split`` cuts a tensor along dim 0 by split sizes (the ProcessGroup's checks)."""
        what = "all_to_all_single"
        device = self._device(what, [output, input])
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        buf = self._out(output, copy_back)
        src = input.contiguous()
        outs = split(buf, output_split_sizes, what, "output")
        ins = split(src, input_split_sizes, what, "input")
        return self._run(
            device,
            [buf, src],
            [output],
            copy_back,
            lambda ev: self.comm.cuda.all_to_all(
                [self._array(o) for o in outs], [self._array(x) for x in ins], ev
            ),
        )

    def gather(self, outs: list[torch.Tensor] | None, src: torch.Tensor, root: int) -> SmddpWork:
        what = "gather"
        device = self._device(what, [src, *(outs or [])])
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        bufs = None
        if outs is not None:
            self._same(src, outs, what)
            bufs = [self._out(o, copy_back) for o in outs]
        s = src.contiguous()
        return self._run(
            device,
            [s, *(bufs or [])],
            list(outs) if outs is not None else [src],
            copy_back,
            lambda ev: self.comm.cuda.gather(
                [self._array(b) for b in bufs] if bufs is not None else None,
                self._array(s),
                root,
                ev,
            ),
        )

    def scatter(self, out: torch.Tensor, ins: list[torch.Tensor] | None, root: int) -> SmddpWork:
        what = "scatter"
        device = self._device(what, [out, *(ins or [])])
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        buf = self._out(out, copy_back)
        srcs = None
        if ins is not None:
            self._same(buf, ins, what)
            srcs = [x.contiguous() for x in ins]
        return self._run(
            device,
            [buf, *(srcs or [])],
            [out],
            copy_back,
            lambda ev: self.comm.cuda.scatter(
                self._array(buf),
                [self._array(x) for x in srcs] if srcs is not None else None,
                root,
                ev,
            ),
        )

    def send(self, t: torch.Tensor, dst: int, tag: int) -> SmddpWork:
        device = self._device("send", [t])
        s = t.contiguous()
        return self._run(
            device, [s], [t], [], lambda ev: self.comm.cuda.send(self._array(s), dst, tag, ev)
        )

    def recv(self, t: torch.Tensor, src: int, tag: int) -> SmddpWork:
        device = self._device("recv", [t])
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        buf = self._out(t, copy_back)
        return self._run(
            device,
            [buf],
            [t],
            copy_back,
            lambda ev: self.comm.cuda.recv(self._array(buf), src, tag, ev),
        )


def _finisher(
    device: int, stream: torch.cuda.Stream, copy_back: list[tuple[torch.Tensor, torch.Tensor]]
) -> Callable[[], None]:
    """What ``SmddpWork.wait()`` does after the reply: copy non-contiguous outputs back on
    the op's stream (which already waits on the daemon), then order the caller's current
    stream after it."""

    def finish() -> None:
        if copy_back:
            with torch.cuda.stream(stream):
                for dst, src in copy_back:
                    dst.copy_(src)
        current = torch.cuda.current_stream(device)
        if current != stream:
            current.wait_stream(stream)

    return finish


def _joined(works: list[SmddpWork], result: list[torch.Tensor]) -> SmddpWork:
    """One Work over several ops (all_reduce_coalesced), completing when all have."""
    handles = [h for w in works for h in w._handles]
    finishes = [w._finish for w in works if w._finish is not None]

    def finish() -> None:
        for f in finishes:
            f()

    return SmddpWork(handles, result, finish)
