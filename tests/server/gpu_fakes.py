"""A fake ``gpu.Runtime`` for tests without a GPU: host memory stands in for GPU memory.

Ranks' allocations are numpy byte buffers named by fake CUDA IPC handles; the daemon's
mappings get addresses of their own. Copies run at once on the host; a reduction runs the
very kernel the daemon would launch: the module ``gpu_kernels.reduce_module`` generates for
the launch's dtype, op and fan-in/fan-out, its kernel body evaluated by the C interpreter of
``c_subset`` (so the bits come from the generated code, never from the host path's
``reduce_into``, which the tests compare them with). Every call is logged, so tests check
both the bytes and the order of waits, work and records on each stream.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import c_subset

from smddp.core.wire import numpy_dtype
from smddp.server import gpu_kernels
from smddp.server.gpu import CudaCallError
from smddp.v1 import smddp_pb2 as pb

CLIENT_BASE = 0x7F00_0000_0000  # where fake ranks' allocations start (their address space)
DAEMON_BASE = 0x1000_0000_0000  # where the daemon's fake mappings start
HOST_BASE = 0x2000_0000_0000  # where the daemon's fake pinned host buffers start


@dataclass(eq=False)
class FakeEvent:
    name: str

    def __repr__(self) -> str:
        return self.name


@dataclass(eq=False)
class FakeFlag:
    device: int
    value: int = 0

    def __repr__(self) -> str:
        return f"flag@gpu{self.device}"


@dataclass(frozen=True)
class FakeStream:
    device: int
    number: int

    def __repr__(self) -> str:
        return f"stream{self.number}@gpu{self.device}"


@dataclass
class Allocation:
    """A rank's GPU allocation: its bytes, device, client address and IPC handle."""

    data: np.ndarray
    device: int
    base: int
    handle: bytes
    buffer_id: int = 0  # the client driver's id of the allocation (0: a client that sends none)


@dataclass
class FakeRuntime:
    """Implements ``server.gpu.Runtime`` on host memory, logging every call."""

    devices: dict[bytes, int] = field(default_factory=lambda: {uuid(0): 0})
    log: list[tuple] = field(default_factory=list)
    no_peer: set[tuple[int, int]] = field(default_factory=set)
    pending_marks: bool = False  # event_done answers False while set
    size_unknown: bool = False  # mapped_size fails while set (as cuPointerGetAttributes can)
    fail_reduce_at: int = -1  # the launch (counting from 0) that fails, e.g. a bad launch
    allocations: dict[bytes, Allocation] = field(default_factory=dict)
    mapped: dict[int, Allocation] = field(default_factory=dict)
    opened_events: dict[bytes, int] = field(default_factory=dict)
    _next_map: itertools.count = field(default_factory=lambda: itertools.count(0))
    _next_stream: itertools.count = field(default_factory=lambda: itertools.count(0))
    _next_event: itertools.count = field(default_factory=lambda: itertools.count(0))
    _next_host: itertools.count = field(default_factory=lambda: itertools.count(0))
    host: dict[int, int] = field(default_factory=dict)  # pinned host buffers: address -> bytes

    # -- what the tests call --------------------------------------------------------------------

    def allocate(self, nbytes: int, device: int = 0) -> Allocation:
        k = len(self.allocations)
        handle = f"mem{k}".encode().ljust(64, b"\0")
        alloc = Allocation(
            np.zeros(nbytes, dtype=np.uint8), device, CLIENT_BASE + (k << 32), handle, k + 1
        )
        self.allocations[handle] = alloc
        return alloc

    def calls(self, name: str) -> list[tuple]:
        return [c for c in self.log if c[0] == name]

    def _resolve(self, address: int, nbytes: int) -> np.ndarray:
        for base, alloc in self.mapped.items():
            if base <= address and address + nbytes <= base + alloc.data.size:
                return alloc.data[address - base : address - base + nbytes]
        raise AssertionError(f"address 0x{address:x} (+{nbytes}) is not mapped by the daemon")

    # -- gpu.Runtime ----------------------------------------------------------------------------

    def device_of(self, uuid_: bytes) -> int:
        if uuid_ not in self.devices:
            raise CudaCallError("cudaErrorInvalidDevice")
        return self.devices[uuid_]

    def open_memory(self, handle: bytes, device: int) -> int:
        alloc = self.allocations.get(handle)
        if alloc is None:
            raise CudaCallError("cudaIpcOpenMemHandle: cudaErrorInvalidValue")
        address = DAEMON_BASE + (next(self._next_map) << 32)
        self.mapped[address] = alloc
        self.log.append(("open_memory", handle, device, address))
        return address

    def close_memory(self, address: int, device: int) -> None:
        del self.mapped[address]
        self.log.append(("close_memory", address, device))

    def mapped_size(self, address: int) -> int:
        if self.size_unknown:
            raise CudaCallError("cuPointerGetAttributes: CUDA_ERROR_INVALID_VALUE")
        return self.mapped[address].data.size

    def open_event(self, handle: bytes, device: int) -> Any:
        self.opened_events[handle] = self.opened_events.get(handle, 0) + 1
        self.log.append(("open_event", handle, device))
        return FakeEvent(handle.rstrip(b"\0").decode())

    def destroy_event(self, event: Any, device: int) -> None:
        self.log.append(("destroy_event", event, device))

    def new_event(self, device: int) -> Any:
        event = FakeEvent(f"local{next(self._next_event)}@gpu{device}")
        self.log.append(("new_event", event, device))
        return event

    def event_done(self, event: Any, device: int) -> bool:
        return not self.pending_marks

    def new_stream(self, device: int) -> Any:
        stream = FakeStream(device, next(self._next_stream))
        self.log.append(("new_stream", stream))
        return stream

    def destroy_stream(self, stream: Any, device: int) -> None:
        self.log.append(("destroy_stream", stream))

    def wait_event(self, stream: Any, event: Any, device: int) -> None:
        assert stream.device == device
        self.log.append(("wait", stream, event))

    def record_event(self, event: Any, stream: Any, device: int) -> None:
        assert stream.device == device
        self.log.append(("record", event, stream))

    def synchronize(self, stream: Any, device: int) -> None:
        self.log.append(("synchronize", stream))

    def new_flag(self, device: int) -> Any:
        flag = FakeFlag(device)
        self.log.append(("new_flag", flag))
        return flag

    def set_flag(self, flag: Any, value: int) -> None:
        flag.value = value
        self.log.append(("set_flag", flag, value))

    def wait_flag(self, stream: Any, flag: Any, value: int, device: int) -> None:
        assert stream.device == device == flag.device
        self.log.append(("wait_flag", stream, flag, value))

    def destroy_flag(self, flag: Any) -> None:
        self.log.append(("destroy_flag", flag))

    def alloc_host(self, nbytes: int, device: int) -> tuple[int, memoryview]:
        # Mapped like a rank's allocation, so that copies and kernels reach it by address.
        address = HOST_BASE + (next(self._next_host) << 32)
        data = np.zeros(max(1, nbytes), dtype=np.uint8)
        self.mapped[address] = Allocation(data, device, address, b"host")
        self.host[address] = nbytes
        self.log.append(("alloc_host", address, nbytes))
        return address, memoryview(data)

    def free_host(self, address: int) -> None:
        del self.mapped[address]
        del self.host[address]
        self.log.append(("free_host", address))

    def enable_peer(self, device: int, peer: int) -> None:
        if (device, peer) in self.no_peer:
            raise CudaCallError(f"cudaDeviceCanAccessPeer({device}, {peer}) is false")
        self.log.append(("enable_peer", device, peer))

    def max_grid(self, device: int) -> int:
        return 132 * 8

    def reduce(
        self,
        stream: Any,
        device: int,
        dtype: int,
        reduce_op: int,
        inputs: Sequence[int],
        outputs: Sequence[int],
        launch: gpu_kernels.Launch,
    ) -> None:
        assert stream.device == device
        if len(self.calls("reduce")) == self.fail_reduce_at:
            raise CudaCallError(
                "launching the reduction kernel: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"
            )
        np_dtype = numpy_dtype(dtype)
        nbytes = launch.count * np_dtype.itemsize
        off = launch.start * np_dtype.itemsize
        if launch.vectorized:
            assert all((a + off) % gpu_kernels.VECTOR_BYTES == 0 for a in [*inputs, *outputs])
        ins = [self._resolve(a + off, nbytes).view(np_dtype) for a in inputs]
        outs = [self._resolve(a + off, nbytes).view(np_dtype) for a in outputs]
        self.log.append(
            (
                "reduce",
                stream,
                dtype,
                reduce_op,
                len(inputs),
                len(outputs),
                launch,
                [a + off for a in [*inputs, *outputs]],
            )
        )
        # What the kernel computes: every input read before any output is written.
        storage = c_subset.CTYPES[gpu_kernels.SPECS[dtype].storage]
        program, body = kernel(dtype, reduce_op, len(inputs), len(outputs), launch.vectorized)
        results = c_subset.run_body(program, body, [x.view(storage).copy() for x in ins])
        for k, o in enumerate(outs):
            o.view(storage)[...] = results[f"out{k}"]

    def prepare(self, device: int, key: tuple[int, int, int, int]) -> None:
        self.log.append(("prepare", device, key))
        kernel(*key, False)  # the module is generated (and parsed) once, as the real one compiles

    def copy(self, stream: Any, device: int, dst: int, src: int, nbytes: int) -> None:
        assert stream.device == device
        self.log.append(("copy", stream, dst, src, nbytes))
        self._resolve(dst, nbytes)[...] = self._resolve(src, nbytes)


@functools.cache
def kernel(
    dtype: int, reduce_op: int, fan_in: int, fan_out: int, vectorized: bool
) -> tuple[c_subset.Program, list[str]]:
    """The generated module's program (its C helpers) and the launched kernel's body."""
    source = gpu_kernels.reduce_module(dtype, reduce_op, fan_in, fan_out)
    name = gpu_kernels.kernel_name(dtype, reduce_op, fan_in, fan_out, vectorized)
    return c_subset.load_program(source), c_subset.kernel_bodies(source)[name]


def uuid(device: int) -> bytes:
    """A fake 16-byte GPU UUID."""
    return bytes([0xA0 + device]) * 16


@dataclass(eq=False)
class FakeSession:
    """What server.gpu needs of a daemon Session."""

    rank: int
    node_id: str = "n1"

    def label(self) -> str:
        return f"rank {self.rank} (pid {1000 + self.rank}, node {self.node_id})"


class FakeComm:
    """What server.gpu needs of a daemon Communicator."""

    def __init__(self, name: str = "job j comm 0") -> None:
        self._name = name

    def name(self) -> str:
        return self._name


@dataclass
class Buffer:
    """A range of a fake allocation as a rank's tensor."""

    alloc: Allocation
    offset: int
    count: int
    dtype: int

    @property
    def nbytes(self) -> int:
        return self.count * numpy_dtype(self.dtype).itemsize

    def array(self) -> np.ndarray:
        return self.alloc.data[self.offset : self.offset + self.nbytes].view(
            numpy_dtype(self.dtype)
        )

    def message(self) -> pb.CudaBuffer:
        return pb.CudaBuffer(
            ipc_handle=self.alloc.handle,
            alloc_base=self.alloc.base,
            alloc_bytes=self.alloc.data.size,
            offset=self.offset,
            nbytes=self.nbytes,
            buffer_id=self.alloc.buffer_id,
        )


def request(
    kind: int,
    dtype: int,
    count: int,
    rank: int,
    inputs: Sequence[Buffer],
    outputs: Sequence[Buffer],
    device: int = 0,
    root: int = 0,
    reduce_op: int = 0,
    seq: int = 1,
) -> pb.OpRequest:
    """Rank ``rank``'s OpRequest naming the fake buffers (events "ready<r>", "done<r>")."""
    cuda = pb.CudaOp(
        device_uuid=uuid(device),
        ready_event=f"ready{rank}".encode().ljust(64, b"\0"),
        done_event=f"done{rank}".encode().ljust(64, b"\0"),
        inputs=[b.message() for b in inputs],
        outputs=[b.message() for b in outputs],
    )
    return pb.OpRequest(
        seq=seq,
        part=0,
        parts=1,
        kind=kind,
        dtype=dtype,
        count=count,
        root=root,
        reduce_op=reduce_op,
        cuda=cuda,
    )


# -- TEST ONLY: the fake runtime of a real smddpd (tests/gpu/fake_smddpd.py) ---------------------

MEM_PREFIX = b"fakeipc:"  # tests/gpu/fake_device.py: a rank's "IPC handle" names a shared file
EVENT_PREFIX = b"fakeevt:"
STALLED_SUFFIX = ".stalled"  # fake_device.py: a ready event recorded while the rank is stalled
# A file the blocking runtime (ipc_queued_runtime) appends its mappings and drains to, one
# line each, for the test that started the daemon.
LEDGER_ENV = "SMDDP_TEST_GPU_LEDGER"


@dataclass(eq=False)
class SharedEvent:
    """A rank's interprocess event of tests/gpu/fake_device.py: a counter in a shared file."""

    path: str

    def count(self) -> int:
        with open(self.path, "rb") as f:
            return int.from_bytes(f.read(8), "little", signed=True)

    def bump(self) -> None:
        with open(self.path, "r+b") as f:
            value = int.from_bytes(f.read(8), "little", signed=True)
            f.seek(0)
            f.write((value + 1).to_bytes(8, "little", signed=True))

    def __repr__(self) -> str:
        return f"event {self.path}"


@dataclass
class IpcFakeRuntime(FakeRuntime):
    """FakeRuntime whose handles name the ranks' shared files: the daemon maps their "GPU
    memory" and bumps their done events; waits check that the rank recorded ready."""

    def open_memory(self, handle: bytes, device: int) -> int:
        if not handle.startswith(MEM_PREFIX):
            return super().open_memory(handle, device)
        path = handle[len(MEM_PREFIX) :].rstrip(b"\0").decode()
        try:
            data = np.memmap(path, dtype=np.uint8, mode="r+")
        except OSError as exc:
            raise CudaCallError(f"cudaIpcOpenMemHandle: cudaErrorInvalidValue ({exc})") from None
        self.allocations[handle] = Allocation(data, device, 0, handle)
        with open(path + ".opens", "a") as f:  # tells the rank's test each time it is mapped
            f.write("open\n")
        return super().open_memory(handle, device)

    def close_memory(self, address: int, device: int) -> None:
        alloc = self.mapped[address]
        super().close_memory(address, device)
        self.allocations.pop(alloc.handle, None)
        if alloc.handle.startswith(MEM_PREFIX):
            # Tells the rank's test (tests/gpu) the daemon has unmapped its allocation.
            path = alloc.handle[len(MEM_PREFIX) :].rstrip(b"\0").decode()
            # (Not there when the rank's folder went with its process.)
            with contextlib.suppress(FileNotFoundError), open(path + ".closed", "a"):
                pass

    def open_event(self, handle: bytes, device: int) -> Any:
        if not handle.startswith(EVENT_PREFIX):
            return super().open_event(handle, device)
        self.log.append(("open_event", handle, device))
        return SharedEvent(handle[len(EVENT_PREFIX) :].rstrip(b"\0").decode())

    def wait_event(self, stream: Any, event: Any, device: int) -> None:
        super().wait_event(stream, event, device)
        if isinstance(event, SharedEvent) and event.count() < 1:
            raise CudaCallError(f"the rank never recorded {event!r} before the op")

    def record_event(self, event: Any, stream: Any, device: int) -> None:
        super().record_event(event, stream, device)
        if isinstance(event, SharedEvent):
            event.bump()

    def reduce(self, stream: Any, device: int, *args: Any) -> None:
        super().reduce(stream, device, *args)
        self._trim()

    def copy(self, stream: Any, device: int, dst: int, src: int, nbytes: int) -> None:
        super().copy(stream, device, dst, src, nbytes)
        self._trim()

    def _trim(self) -> None:
        # A daemon serves many ops: keep the log bounded.
        if len(self.log) > 100_000:
            del self.log[: len(self.log) // 2]


def ipc_runtime() -> IpcFakeRuntime:
    """A factory for tests/gpu/fake_smddpd.py: GPU 0 (fake_device.UUID0)."""
    return IpcFakeRuntime(devices={uuid(0): 0})


class QueuedFakeRuntime(FakeRuntime):
    """FakeRuntime whose streams run in order and block, as on a GPU: a wait holds its stream
    (and all queued after it) until the event has fired or the flag has reached the value;
    ``synchronize`` blocks until the stream is idle (up to ``sync_timeout_s``, then fails, so
    a stuck stream fails a test instead of hanging it). Ranks' events fire when recorded,
    except those named in ``never`` (a killed rank's ready event)."""

    def __init__(self, *args: Any, never: set[str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.never = never or set()
        self.sync_timeout_s = 10.0
        self._queues: dict[Any, list[tuple]] = {}
        self._fired: set[int] = set()
        self._cv = threading.Condition(threading.RLock())

    def _fired_now(self, event: Any) -> bool:
        if repr(event).startswith("local"):
            return id(event) in self._fired
        return repr(event) not in self.never

    def _enqueue(self, stream: Any, item: tuple) -> None:
        with self._cv:
            self._queues.setdefault(stream, []).append(item)
            self._advance()

    def _advance(self) -> None:
        progressed = True
        while progressed:
            progressed = False
            for queue in self._queues.values():
                while queue:
                    kind, *rest = queue[0]
                    if kind == "wait" and not self._fired_now(rest[0]):
                        break
                    if kind == "flag" and rest[0].value < rest[1]:
                        break
                    queue.pop(0)
                    progressed = True
                    if kind == "record":
                        self._fired.add(id(rest[0]))
                    elif kind == "run":
                        rest[0]()
        self._cv.notify_all()

    def wait_event(self, stream: Any, event: Any, device: int) -> None:
        super().wait_event(stream, event, device)
        self._enqueue(stream, ("wait", event))

    def record_event(self, event: Any, stream: Any, device: int) -> None:
        with self._cv:
            self._fired.discard(id(event))  # a new record: fires when the stream gets there
            super().record_event(event, stream, device)
            self._enqueue(stream, ("record", event))

    def wait_flag(self, stream: Any, flag: Any, value: int, device: int) -> None:
        super().wait_flag(stream, flag, value, device)
        self._enqueue(stream, ("flag", flag, value))

    def set_flag(self, flag: Any, value: int) -> None:
        with self._cv:
            super().set_flag(flag, value)
            self._advance()

    def reduce(self, stream: Any, device: int, *args: Any) -> None:
        base = super().reduce
        self._enqueue(stream, ("run", lambda: base(stream, device, *args)))

    def copy(self, stream: Any, device: int, dst: int, src: int, nbytes: int) -> None:
        base = super().copy
        self._enqueue(stream, ("run", lambda: base(stream, device, dst, src, nbytes)))

    def event_done(self, event: Any, device: int) -> bool:
        with self._cv:
            self._advance()  # the "GPU" gets on with what became runnable meanwhile
            return self._fired_now(event)

    def synchronize(self, stream: Any, device: int) -> None:
        super().synchronize(stream, device)
        with self._cv:
            if not self._cv.wait_for(lambda: not self._queues.get(stream), self.sync_timeout_s):
                raise CudaCallError(f"cudaStreamSynchronize: {stream!r} never finished")


class IpcQueuedFakeRuntime(QueuedFakeRuntime, IpcFakeRuntime):
    """The ranks' shared files (IpcFakeRuntime) on streams that run in order and block
    (QueuedFakeRuntime), for a real smddpd: a rank's done event is bumped when the daemon's
    stream gets to its record, and a ready event the rank recorded while stalled
    (``fake_device.FakeDevice.stalled``) never fires, as that of a rank killed before its
    stream got there. Every mapping opened and closed, and every stream synchronized and
    destroyed, is appended to the ledger file (``LEDGER_ENV``) when one is named."""

    def __init__(self, *args: Any, ledger: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ledger = ledger

    def _note(self, line: str) -> None:
        if self.ledger:
            with open(self.ledger, "a") as f:
                f.write(line + "\n")

    def open_memory(self, handle: bytes, device: int) -> int:
        with self._cv:  # the gate and drain threads resolve addresses meanwhile
            address = super().open_memory(handle, device)
        self._note(f"open {address:#x} {_memory_name(handle)}")
        return address

    def close_memory(self, address: int, device: int) -> None:
        with self._cv:
            handle = self.mapped[address].handle
            super().close_memory(address, device)
        self._note(f"close {address:#x} {_memory_name(handle)}")

    def wait_event(self, stream: Any, event: Any, device: int) -> None:
        if isinstance(event, SharedEvent) and os.path.exists(event.path + STALLED_SUFFIX):
            self.never.add(repr(event))
        super().wait_event(stream, event, device)

    def record_event(self, event: Any, stream: Any, device: int) -> None:
        if not isinstance(event, SharedEvent):
            super().record_event(event, stream, device)
            return
        with self._cv:
            self.log.append(("record", event, stream))
            self._enqueue(stream, ("run", functools.partial(_bump_if_there, event)))

    def synchronize(self, stream: Any, device: int) -> None:
        try:
            super().synchronize(stream, device)
        except CudaCallError as exc:
            self._note(f"synchronize {stream!r} failed: {exc}")
            raise
        self._note(f"synchronize {stream!r} ok")

    def destroy_stream(self, stream: Any, device: int) -> None:
        super().destroy_stream(stream, device)
        self._note(f"destroy_stream {stream!r}")


def _memory_name(handle: bytes) -> str:
    return (
        handle[len(MEM_PREFIX) :].rstrip(b"\0").decode() if handle.startswith(MEM_PREFIX) else "?"
    )


def _bump_if_there(event: SharedEvent) -> None:
    with contextlib.suppress(FileNotFoundError):  # the rank's folder went with it
        event.bump()


def ipc_queued_runtime() -> IpcQueuedFakeRuntime:
    """A factory for tests/gpu/fake_smddpd.py: a fake GPU that blocks (GPU 0)."""
    return IpcQueuedFakeRuntime(devices={uuid(0): 0}, ledger=os.environ.get(LEDGER_ENV))
