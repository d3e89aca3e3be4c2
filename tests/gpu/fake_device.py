"""TEST ONLY: a fake GPU for the ranks, where "device memory" is host shared memory.

``backend/cuda.py`` makes every device call through ``device_api()``; a rank process that calls
``backend.cuda.use_device(get())`` first gets this class instead of torch.cuda. Its tensors are
CPU tensors over files in /dev/shm ("allocations"); its CUDA driver exports an allocation's
"IPC handle" as the file's path, which the daemon's fake runtime
(``tests/server/gpu_fakes.py:ipc_runtime``, ``tests/gpu/fake_smddpd.py``) maps, so the real
daemon reads and writes the ranks' tensors. Events are small shared files too: a record bumps a
counter, so a rank checks that the daemon recorded its done event before it replied. Work on
this "GPU" happens at once, so streams only check and log; only ``FakeStream.synchronize``
waits, for the done events the stream waited on (which the daemon's blocking fake runtime,
``ipc_queued_runtime``, bumps when its stream gets there).
"""

from __future__ import annotations

import atexit
import itertools
import mmap
import os
import shutil
import struct
import tempfile
import time
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from smddp.core import cuda_driver

UUID0 = bytes([0xA0]) * 16  # gpu_fakes.uuid(0): the daemon's fake sees the same GPU
MEM_PREFIX = b"fakeipc:"
EVENT_PREFIX = b"fakeevt:"
STALLED_SUFFIX = ".stalled"  # gpu_fakes.STALLED_SUFFIX
# One folder per rank process, named for its pid: removed when the process exits (the daemon's
# mappings outlive the names), and by tests/conftest.py's sweep when it was killed.
_folder = tempfile.mkdtemp(
    prefix=f"sfg{os.getpid()}-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
)
atexit.register(shutil.rmtree, _folder, True)


class _Allocation:
    def __init__(self, nbytes: int, buffer_id: int) -> None:
        self.size = max(256, -(-nbytes // 256) * 256)
        self.path = os.path.join(_folder, f"m{buffer_id}")
        with open(self.path, "wb") as f:
            f.truncate(self.size)
        with open(self.path, "r+b") as f:
            self.map = mmap.mmap(f.fileno(), self.size)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.base = self.bytes.data_ptr()
        self.buffer_id = buffer_id


class FakeEvent:
    """An "interprocess event": a counter in a shared file, bumped by each record."""

    def __init__(self, number: int, device: FakeDevice | None = None) -> None:
        self.path = os.path.join(_folder, f"e{number}")
        with open(self.path, "wb") as f:
            f.write(struct.pack("<q", 0))
        self.seen = 0
        self.waits = 0  # streams' waits on it: the n-th waits for the daemon's n-th record
        self._device = device

    def count(self) -> int:
        with open(self.path, "rb") as f:
            return struct.unpack("<q", f.read(8))[0]

    def record(self, stream: Any = None) -> None:
        if self._device is not None and self._device.stalled:
            # The rank's stream never gets here (ipc_queued_runtime's waits on it never end).
            with open(self.path + STALLED_SUFFIX, "w"):
                pass
        with open(self.path, "r+b") as f:
            value = struct.unpack("<q", f.read(8))[0]
            f.seek(0)
            f.write(struct.pack("<q", value + 1))

    def ipc_handle(self) -> bytes:
        return (EVENT_PREFIX + self.path.encode()).ljust(64, b"\0")

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class FakeStream:
    """A stream of the fake GPU. A wait on a done event counts whether the daemon recorded it
    since the last wait (as it must once it queued anything; a refused op leaves it
    unrecorded, and a wait on an unrecorded event passes, as in CUDA)."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.recorded_waits = 0
        self.unrecorded_waits = 0
        self.fail_waits = False  # a test makes the fence fail
        self.waited: list[tuple[FakeEvent, int]] = []  # (event, the record it waits for)

    def wait_event(self, event: FakeEvent) -> None:
        if self.fail_waits:
            raise RuntimeError("cudaStreamWaitEvent: an illegal memory access was encountered")
        event.waits += 1
        self.waited.append((event, event.waits))
        count = event.count()
        if count > event.seen:
            self.recorded_waits += 1
        else:
            self.unrecorded_waits += 1
        event.seen = count

    def wait_stream(self, other: FakeStream) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self, timeout_s: float) -> float:
        """Waits until the daemon has recorded every done event this stream waited on, as
        ``torch.cuda.synchronize()`` would; returns the seconds it took.

        Raises:
            TimeoutError: some were not recorded within ``timeout_s``.
        """
        start = time.monotonic()
        while any(event.count() < n for event, n in self.waited):
            if time.monotonic() - start > timeout_s:
                behind = [e.path for e, n in self.waited if e.count() < n]
                raise TimeoutError(f"done events never recorded within {timeout_s} s: {behind}")
            time.sleep(0.005)
        self.waited.clear()
        return time.monotonic() - start


class FakeDriver:
    """What ``client.cuda_ipc`` asks the CUDA driver, for the fake allocations."""

    def __init__(self, device: FakeDevice) -> None:
        self._device = device

    def pointer_info(self, ptr: int) -> cuda_driver.PointerInfo:
        for a in self._device.allocations:
            if a.base <= ptr < a.base + a.size:
                return cuda_driver.PointerInfo(
                    a.buffer_id, a.base, a.size, 0, cuda_driver.MEMORY_TYPE_DEVICE, True, 1
                )
        raise cuda_driver.CudaUnavailable(
            f"cuPointerGetAttributes(0x{ptr:x}): CUDA_ERROR_INVALID_VALUE (not fake GPU memory)"
        )

    def ipc_mem_handle(self, base: int, context: int) -> bytes:
        (a,) = [a for a in self._device.allocations if a.base == base]
        self._device.exports += 1
        return (MEM_PREFIX + a.path.encode()).ljust(64, b"\0")

    def device_uuid(self, ordinal: int) -> bytes:
        return UUID0


class FakeDevice:
    """``backend.cuda.device_api()`` for tests: GPU 0 of host shared memory."""

    def __init__(self) -> None:
        self.allocations: list[_Allocation] = []
        self.exports = 0
        self._ids = itertools.count(1)
        self._events = itertools.count(os.getpid() << 16)
        self.streams = {0: FakeStream(0)}
        self.capture = False
        self.driver = FakeDriver(self)
        self.frees = 0  # allocations returned to the "driver" (the allocator's segment.all.freed)
        # Set by a test: ready events recorded from now on never fire on the daemon's blocking
        # fake runtime, as if this rank's stream were stuck before them (then it is killed).
        self.stalled = False

    # -- what tests call ------------------------------------------------------------------------

    def empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A "GPU tensor" of ``n`` elements (its own allocation)."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        a = _Allocation(n * itemsize, next(self._ids))
        self.allocations.append(a)
        return a.bytes[: n * itemsize].view(dtype)

    def tensor(self, x: np.ndarray | torch.Tensor) -> torch.Tensor:
        src = torch.as_tensor(x) if not isinstance(x, torch.Tensor) else x
        t = self.empty(src.numel(), src.dtype).view(src.shape)
        t.copy_(src)
        return t

    def free(self, t: torch.Tensor) -> str:
        """Returns ``t``'s allocation to the "driver" (as ``empty_cache()`` does a segment):
        the driver no longer knows it, the free count moves. Returns the allocation's file,
        which the daemon's fake runtime marks ``.closed`` when it unmaps it."""
        p = t.data_ptr()
        (a,) = [a for a in self.allocations if a.base <= p < a.base + a.size]
        self.allocations.remove(a)
        self.frees += 1
        return a.path

    # -- backend.cuda's device calls ------------------------------------------------------------

    def free_count(self, device: int) -> int:
        return self.frees

    def is_device(self, t: torch.Tensor) -> bool:
        if t.device.type != "cpu" or t.numel() == 0 and t.data_ptr() == 0:
            return False
        p = t.data_ptr()
        return any(a.base <= p < a.base + a.size for a in self.allocations)

    def available(self) -> bool:
        return True

    def device_index(self, t: torch.Tensor) -> int:
        return 0

    def capturing(self) -> bool:
        return self.capture

    @contextmanager
    def device(self, device: int):
        yield

    def event(self, device: int) -> FakeEvent:
        return FakeEvent(next(self._events), self)

    def current_stream(self, device: int) -> FakeStream:
        return self.streams[device]

    @contextmanager
    def stream(self, stream: FakeStream):
        yield

    def contiguous(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_contiguous() and self.is_device(t):
            return t
        return self.tensor(t.contiguous())


_device: FakeDevice | None = None


def get() -> FakeDevice:
    """The process's fake device (for ``backend.cuda.use_device``)."""
    global _device
    if _device is None:
        _device = FakeDevice()
    return _device
