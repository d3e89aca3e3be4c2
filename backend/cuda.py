"""CUDA tensors in the smddp ProcessGroup: the GPU path of every collective.

A collective whose tensors are on a GPU comes here from ``process_group.py``. Each method
checks the tensors (all on one GPU, dense, a supported dtype), makes contiguous stand-ins
where needed, records an interprocess "ready" event on the tensors' current stream, and
calls the client's GPU collective (``comm.cuda``), which sends CUDA IPC handles to the
daemon and returns at once. When the op's reply is retired, that stream waits on the
daemon's "done" event; ``SmddpWork.wait()`` then orders the caller's current stream after
it and copies non-contiguous outputs back. The host never blocks on the GPU.

Every device call goes through ``device_api()``: torch.cuda, or (TEST ONLY, given by the
rank process to ``use_device()``) a fake device whose "GPU memory" is host shared memory, so
that tests without a GPU run this path against a real smddpd (itself on a fake runtime,
``tests/gpu/fake_smddpd.py``).

Under CUDA graph capture every call is refused: the ready event would become a node of the
graph, the daemon would read the inputs when the call is made rather than when the graph
runs, and replays would never reach the daemon.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._C import _distributed_c10d as c10d

from smddp.backend import cuda_free_hook, cuda_future
from smddp.backend.tensors import SUPPORTED, reduce_op
from smddp.backend.work import SmddpWork
from smddp.client import Communicator, DType
from smddp.client.cuda_ipc import IpcExporter
from smddp.client.cuda_ops import DeviceArray
from smddp.client.errors import SmddpError, UnsupportedError

log = logging.getLogger(__name__)

WIRE_DTYPES: dict[torch.dtype, DType] = {
    torch.float16: DType.FLOAT16,
    torch.bfloat16: DType.BFLOAT16,
    torch.float32: DType.FLOAT32,
    torch.float64: DType.FLOAT64,
    torch.int8: DType.INT8,
    torch.uint8: DType.UINT8,
    torch.int16: DType.INT16,
    torch.int32: DType.INT32,
    torch.int64: DType.INT64,
    torch.bool: DType.BOOL,
}


class TorchCuda:
    """The device calls of the GPU path, on torch.cuda (what runs everywhere but in tests).

    Events and streams are torch's (``record``, ``ipc_handle``, ``synchronize``,
    ``wait_event``, ``wait_stream``); a fake device returns objects with the same methods.
    """

    driver = None  # the CUDA driver bindings for CUDA IPC (None: smddp.core.cuda_driver's)

    def is_device(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def available(self) -> bool:
        return torch.cuda.is_available()

    def device_index(self, t: torch.Tensor) -> int:
        return t.device.index if t.device.index is not None else torch.cuda.current_device()

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def device(self, device: int) -> Any:
        return torch.cuda.device(device)

    def event(self, device: int) -> Any:
        with torch.cuda.device(device):
            return torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]  # torch: no annotations

    def current_stream(self, device: int) -> Any:
        return torch.cuda.current_stream(device)

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def contiguous(self, t: torch.Tensor) -> torch.Tensor:
        return t.contiguous()

    def free_count(self, device: int) -> int:
        """Segments the caching allocator has returned to the driver on ``device`` so far
        (``empty_cache()``, its retry after an out-of-memory): the exporter asks the driver
        about its cached allocations only when this moves. Read from the nested statistics
        (no flattening) before each op. (The hook that runs at the free itself is C++:
        ``cuda_free_hook``; this count still catches what it does not see.)"""
        stats = torch.cuda.memory.memory_stats_as_nested_dict(device)
        return int(stats.get("segment", {}).get("all", {}).get("freed", 0))


# The process's device: torch.cuda's calls, unless a test gave another (``use_device``) before
# the first device call. One per process, since the tensors are the process's; chosen at its
# first device call, which may come before any process group exists
# (benchmarks/gpu_check_stages.py calls device_api() with no group).
_api: Any = None
_api_lock = threading.Lock()


def use_device(api: Any) -> None:
    """TEST ONLY: makes ``api`` this process's device instead of torch.cuda (the fake GPU of
    ``tests/gpu/fake_device.py``, whose "GPU memory" is host shared memory, so that tests
    without a GPU run this path against a real smddpd on a fake runtime). Call it in the rank
    process before its first collective or device call.

    Raises:
        UnsupportedError: this process already makes its device calls on another device.
    """
    global _api
    with _api_lock:
        if _api is not None and _api is not api:
            raise UnsupportedError(
                f"smddp: this process already makes its device calls on {type(_api).__name__}; "
                "use_device() must come before its first collective"
            )
        if _api is None:
            log.warning("smddp: GPU tensors on the TEST device %s", type(api).__name__)
        _api = api


def device_api() -> Any:
    """The process's device: torch.cuda's calls, or the one a test gave ``use_device``."""
    global _api
    if _api is None:
        with _api_lock:
            if _api is None:
                _api = TorchCuda()
    return _api


def on_cuda(*items: object) -> bool:
    """True when any tensor among ``items`` (tensors, lists, lists of lists) is on a GPU."""

    def walk(x: object) -> Iterable[torch.Tensor]:
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            for y in x:
                yield from walk(y)

    api = device_api()
    return any(api.is_device(t) for item in items for t in walk(item))


class _EventPair:
    """An interprocess ready and done event on one GPU, with their IPC handles."""

    def __init__(self, device: int) -> None:
        api = device_api()
        with api.device(device):
            self.ready = api.event(device)
            self.done = api.event(device)
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


# Tensors (and events) of ops whose done event could be neither waited on by the stream nor
# by the host: the daemon's work may still write them, so they are never freed.
_stranded: list[tuple[list[torch.Tensor], _EventPair]] = []


class _OpEvents:
    """The client's ``OpEvents`` for one op: ready is recorded on construction.

    ``finish`` (at the reply, ok or not) makes the stream wait on done: the daemon records
    done once it queued anything, and a wait on an event it never recorded (refused before
    any work) passes at once. If that wait cannot be queued, the host waits for done
    (last resort); the op's Work then fails with ``error``, and the tensors are released
    only after done has fired (never, if even that fails).
    """

    def __init__(
        self, pool: _EventPool, device: int, stream: Any, keep: list[torch.Tensor], what: str
    ) -> None:
        self._pool = pool
        self._device = device
        self._pair: _EventPair | None = pool.take(device)
        self._stream = stream
        self._what = what
        # The tensors the daemon reads or writes (stand-ins included) live until the reply.
        self._keep: list[torch.Tensor] | None = keep
        self.error: SmddpError | None = None
        self.ready = self._pair.ready_handle
        self.done = self._pair.done_handle
        self._pair.ready.record(stream)

    def finish(self, ok: bool) -> None:
        pair, self._pair = self._pair, None
        if pair is None:
            return
        keep, self._keep = self._keep, None
        try:
            # Later work on the stream (the caching allocator's reuse of these tensors
            # included) runs after the daemon's.
            self._stream.wait_event(pair.done)
        except Exception as exc:  # must not raise into the client's retirement of the op
            self.error = SmddpError(
                f"{self._what}: the stream cannot wait on the daemon's done event ({exc!r}); "
                "the op's outputs are not ordered"
            )
            log.error("smddp: %s", self.error)
            try:
                pair.done.synchronize()  # the daemon's work on these tensors is over
            except Exception:
                log.exception(
                    "smddp: %s: waiting for done failed too; its tensors are kept", self._what
                )
                _stranded.append((keep or [], pair))
                return
        self._pool.give_back(self._device, pair)


_pool = _EventPool()


class CudaCollectives:
    """The GPU path of one SmddpProcessGroup; method signatures follow the ProcessGroup's."""

    def __init__(self, comm: Communicator, rank: int, size: int) -> None:
        self.comm = comm
        self.rank = rank
        self.size = size
        driver = device_api().driver
        if driver is not None:  # a test device exports its own "IPC handles"
            comm.cuda.exporter = IpcExporter(lambda: driver)
        counter = getattr(device_api(), "free_count", None)
        if counter is not None and comm.cuda.exporter.free_counter is None:
            comm.cuda.exporter.free_counter = counter
        api = device_api()
        if (
            isinstance(api, TorchCuda)
            and api.available()
            and hasattr(comm.session, "open_free_channel")
        ):
            # Close before free: the allocator hook (built on the first GPU group of the
            # process; never raises, logs once if it cannot be had).
            cuda_free_hook.install(comm.session, comm.cuda.exporter, comm.config)

    # -- checks and plumbing --------------------------------------------------------------------

    def _device(self, what: str, tensors: Iterable[torch.Tensor]) -> int:
        """The one GPU of ``tensors``, after checking them.

        Raises:
            UnsupportedError: no CUDA in this torch, tensors on several devices, sparse
                tensors or an unsupported dtype.
        """
        api = device_api()
        if not api.available():
            raise UnsupportedError(
                f"{what}: "
                f"got CUDA tensors, but this torch build has no usable CUDA (torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}); "  # noqa: E501
                "smddp needs a CUDA build of torch and a GPU for them"
            )
        devices = set()
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise UnsupportedError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
            if not api.is_device(t):
                raise UnsupportedError(
                    f"{what}: "
                    f"mixes tensors on {t.device} with CUDA tensors; "
                    "pass all of a call's tensors on the same GPU"
                )
            if t.layout != torch.strided:
                raise UnsupportedError(
                    f"{what}: {t.layout} tensors are not supported, only dense ones"
                )
            if t.dtype not in SUPPORTED:
                names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED)
                raise UnsupportedError(
                    f"{what}: "
                    f"dtype {str(t.dtype).removeprefix('torch.')} is not supported ({names})"
                )
            devices.add(api.device_index(t))
        if len(devices) != 1:
            raise UnsupportedError(
                f"{what}: tensors on GPUs {sorted(devices)}; one call's tensors must share one GPU"
            )
        return int(devices.pop())

    @staticmethod
    def _array(t: torch.Tensor) -> DeviceArray:
        return DeviceArray(
            t.data_ptr(), t.numel(), WIRE_DTYPES[t.dtype], device_api().device_index(t)
        )

    def _run(
        self,
        device: int,
        keep: list[torch.Tensor],
        result: list[torch.Tensor],
        copy_back: list[tuple[torch.Tensor, torch.Tensor]],
        call: Callable[[_OpEvents], object],
        what: str,
    ) -> SmddpWork:
        """Records ready on the current stream, makes the client call, wraps its handle.

        Raises:
            UnsupportedError: the stream is being captured into a CUDA graph.
        """
        api = device_api()
        if api.capturing():
            capture = 'torch.cuda.graph, torch.compile(mode="reduce-overhead")'
            raise UnsupportedError(
                f"{what}: smddp cannot run inside CUDA graph capture ({capture}): "
                "the daemon is not part of the graph, so replays would skip the collective; "
                "run it outside the captured region"
            )
        # A free channel a free found broken is reopened here (a no-op call when all is well).
        cuda_free_hook.refresh(self.comm.session)
        stream = api.current_stream(device)
        events = _OpEvents(_pool, device, stream, keep, what)
        try:
            handle = call(events)
        except BaseException:
            events.finish(False)
            raise
        return GpuWork([handle], result, _finisher(device, stream, copy_back, [events]))  # type: ignore[list-item]

    @staticmethod
    def _out(t: torch.Tensor, copy_back: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        if t.is_contiguous():
            return t
        tmp: torch.Tensor = device_api().contiguous(t)
        copy_back.append((t, tmp))
        return tmp

    def _same(self, ref: torch.Tensor, others: list[torch.Tensor], what: str) -> None:
        for i, o in enumerate(others):
            if o.numel() != ref.numel() or o.dtype != ref.dtype:
                raise UnsupportedError(
                    f"{what}: "
                    f"tensor {i} has {o.numel()} x {o.dtype} but {ref.numel()} x {ref.dtype} was expected"  # noqa: E501
                )

    # -- collectives --------------------------------------------------------------------------

    def _in_place(
        self,
        device: int,
        t: torch.Tensor,
        call: Callable[[DeviceArray, _OpEvents], object],
        what: str,
    ) -> SmddpWork:
        """An op whose result lands in ``t`` itself (through a contiguous stand-in if need be)."""
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        b = self._out(t, copy_back)
        return self._run(device, [b], [t], copy_back, lambda ev: call(self._array(b), ev), what)

    def allreduce(
        self, tensors: list[torch.Tensor], opts: c10d.AllreduceOptions, what: str = "all_reduce"
    ) -> SmddpWork:
        """all_reduce of each tensor (one op each; ``all_reduce_coalesced`` passes several)."""
        op = reduce_op(opts.reduceOp, what)
        device = self._device(what, tensors)
        works = [
            self._in_place(device, t, lambda a, ev: self.comm.cuda.all_reduce(a, op, ev), what)
            for t in tensors
        ]
        return works[0] if len(works) == 1 else _joined(works, list(tensors))

    def broadcast(self, tensors: list[torch.Tensor], opts: c10d.BroadcastOptions) -> SmddpWork:
        what = "broadcast"
        device = self._device(what, tensors)
        (t,) = tensors
        return self._in_place(
            device, t, lambda a, ev: self.comm.cuda.broadcast(a, opts.rootRank, ev), what
        )

    def reduce(self, tensors: list[torch.Tensor], opts: c10d.ReduceOptions) -> SmddpWork:
        what = "reduce"
        op = reduce_op(opts.reduceOp, what)
        device = self._device(what, tensors)
        (t,) = tensors
        return self._in_place(
            device, t, lambda a, ev: self.comm.cuda.reduce(a, opts.rootRank, op, ev), what
        )

    def allgather(self, outs: list[torch.Tensor], src: torch.Tensor) -> SmddpWork:
        what = "all_gather"
        device = self._device(what, [src, *outs])
        self._same(src, outs, what)
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        bufs = [self._out(o, copy_back) for o in outs]
        s = device_api().contiguous(src)
        return self._run(
            device,
            [s, *bufs],
            list(outs),
            copy_back,
            lambda ev: self.comm.cuda.all_gather(
                [self._array(b) for b in bufs], self._array(s), ev
            ),
            what=what,
        )

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor) -> SmddpWork:
        what = "all_gather_into_tensor"
        device = self._device(what, [output, input])
        if output.numel() != input.numel() * self.size or output.dtype != input.dtype:
            raise UnsupportedError(
                f"{what}: "
                f"output has {output.numel()} x {output.dtype} but {self.size} ranks x {input.numel()} x {input.dtype} are gathered"  # noqa: E501
            )
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        buf = self._out(output, copy_back)
        pieces = list(buf.reshape(self.size, -1))
        s = device_api().contiguous(input)
        return self._run(
            device,
            [s, buf],
            [output],
            copy_back,
            lambda ev: self.comm.cuda.all_gather(
                [self._array(p) for p in pieces], self._array(s), ev
            ),
            what=what,
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
        srcs = [device_api().contiguous(x) for x in ins]
        return self._run(
            device,
            [buf, *srcs],
            [out],
            copy_back,
            lambda ev: self.comm.cuda.reduce_scatter(
                self._array(buf), [self._array(x) for x in srcs], op, ev
            ),
            what=what,
        )

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: c10d.ReduceScatterOptions
    ) -> SmddpWork:
        what = "reduce_scatter_tensor"
        op = reduce_op(opts.reduceOp, what)
        device = self._device(what, [output, input])
        if input.numel() != output.numel() * self.size or output.dtype != input.dtype:
            raise UnsupportedError(
                f"{what}: "
                f"input has {input.numel()} x {input.dtype} but {self.size} ranks x {output.numel()} x {output.dtype} are expected"  # noqa: E501
            )
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        buf = self._out(output, copy_back)
        src = device_api().contiguous(input)
        pieces = list(src.reshape(self.size, -1))
        return self._run(
            device,
            [buf, src],
            [output],
            copy_back,
            lambda ev: self.comm.cuda.reduce_scatter(
                self._array(buf), [self._array(p) for p in pieces], op, ev
            ),
            what=what,
        )

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> SmddpWork:
        what = "all_to_all"
        device = self._device(what, [*outputs, *inputs])
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        bufs = [self._out(o, copy_back) for o in outputs]
        srcs = [device_api().contiguous(x) for x in inputs]
        return self._run(
            device,
            [*bufs, *srcs],
            list(outputs),
            copy_back,
            lambda ev: self.comm.cuda.all_to_all(
                [self._array(b) for b in bufs], [self._array(x) for x in srcs], ev
            ),
            what=what,
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
        src = device_api().contiguous(input)
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
            what=what,
        )

    def gather(self, outs: list[torch.Tensor] | None, src: torch.Tensor, root: int) -> SmddpWork:
        what = "gather"
        device = self._device(what, [src, *(outs or [])])
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        bufs = None
        if outs is not None:
            self._same(src, outs, what)
            bufs = [self._out(o, copy_back) for o in outs]
        s = device_api().contiguous(src)
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
            what=what,
        )

    def scatter(self, out: torch.Tensor, ins: list[torch.Tensor] | None, root: int) -> SmddpWork:
        what = "scatter"
        device = self._device(what, [out, *(ins or [])])
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        buf = self._out(out, copy_back)
        srcs = None
        if ins is not None:
            self._same(buf, ins, what)
            srcs = [device_api().contiguous(x) for x in ins]
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
            what=what,
        )

    def send(self, t: torch.Tensor, dst: int, tag: int) -> SmddpWork:
        what = "send"
        device = self._device(what, [t])
        s = device_api().contiguous(t)
        return self._run(
            device,
            [s],
            [t],
            [],
            lambda ev: self.comm.cuda.send(self._array(s), dst, tag, ev),
            what=what,
        )

    def recv(self, t: torch.Tensor, src: int, tag: int) -> SmddpWork:
        what = "recv"
        device = self._device(what, [t])
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        buf = self._out(t, copy_back)
        return self._run(
            device,
            [buf],
            [t],
            copy_back,
            lambda ev: self.comm.cuda.recv(self._array(buf), src, tag, ev),
            what=what,
        )


def _finisher(
    device: int,
    stream: Any,
    copy_back: list[tuple[torch.Tensor, torch.Tensor]],
    events: list[_OpEvents],
) -> Callable[[], None]:
    """What ``SmddpWork.wait()`` does after the reply: fail if a fence could not be queued;
    copy non-contiguous outputs back on the op's stream (which already waits on the daemon),
    then order the caller's current stream after it."""

    def finish() -> None:
        for ev in events:
            if ev.error is not None:
                raise ev.error
        api = device_api()
        if copy_back:
            with api.stream(stream):
                for dst, src in copy_back:
                    dst.copy_(src)
        current = api.current_stream(device)
        if current != stream:
            current.wait_stream(stream)

    return finish


class GpuWork(SmddpWork):
    """The Work of a GPU op: ``get_future()`` returns at once, before the daemon's reply.

    The Future is TorchScript-typed (``Future[List[Tensor]]``, which DDP's built-in C++
    hooks need) and completes on torch's inter-op thread pool once the reply is retired
    (``is_completed`` polls without blocking the caller's later submissions); a failed op
    completes it with an error, which DDP raises from ``backward()``.
    """

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        if self._completed:
            return super().get_future()
        return cuda_future.pending(self)


def _joined(works: list[SmddpWork], result: list[torch.Tensor]) -> SmddpWork:
    """One Work over several ops (all_reduce_coalesced), completing when all have."""
    handles = [h for w in works for h in w._handles]
    finishes = [w._finish for w in works if w._finish is not None]

    def finish() -> None:
        for f in finishes:
            f()

    return GpuWork(handles, result, finish)
