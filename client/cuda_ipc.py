"""A rank's GPU memory as the daemon may open it: CUDA IPC handles of allocations.

A tensor lies somewhere inside an allocation (torch's caching allocator carves tensors out
of large cudaMalloc segments). CUDA IPC exports whole allocations, so a range is sent as the
allocation's handle plus an offset, and the handle is exported once per allocation and kept,
as torch's own CUDA sharing keys its handles by allocation base. The driver's buffer id
(never reused, unlike addresses) tells a new allocation at a recycled address from the old.

Close before free: torch's caching allocator returns segments to the driver (``empty_cache()``,
its retry after an out-of-memory) while the daemon may still have them mapped, which pins the
memory. Where the allocator hook is installed (``backend/cuda_free_hook.py``, ``on_export``
tells it each allocation exported) smddpd unmaps a segment before its free. Otherwise, and
for memory the hook does not see, before each op ``sweep`` checks the cached allocations
against the driver (only when the allocator's count of freed segments moved, if one is
given) and logs the ones that are gone; each communicator sends the daemon what was logged
since its previous op (``CudaOp.freed``), and the daemon closes those mappings once its
streams have passed them.

This uses the CUDA driver directly (``smddp.core.cuda_driver``) rather than torch's
``storage._share_cuda_()``: that call moves the storage behind torch's inter-process
reference counting, whose counter only a torch consumer releases; the daemon has no torch,
and every storage shared that way would stay allocated forever.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass

from smddp.client.errors import UnsupportedError
from smddp.core import cuda_driver
from smddp.v1 import smddp_pb2 as pb


@dataclass(frozen=True)
class _Export:
    buffer_id: int
    size: int
    handle: bytes
    device: int


# Freed allocations remembered for communicators that have not sent them yet; one that fell
# further behind loses the oldest (the daemon still tells a new allocation at a known base
# from the old by its buffer id, and closes the rest when the rank leaves).
MAX_FREED_LOG = 65536


class IpcExporter:
    """Turns device ranges into ``CudaBuffer`` messages, caching handles by allocation."""

    def __init__(self, driver: Callable[[], cuda_driver.Driver] = cuda_driver.driver) -> None:
        """Args:
        driver: returns the driver bindings (a fake in tests).
        """
        self._driver = driver
        self._exports: dict[int, _Export] = {}  # by allocation base
        self._uuids: dict[int, bytes] = {}  # by device ordinal
        self._lock = threading.Lock()
        # (sequence number, base, buffer id) of each allocation seen freed, oldest first.
        self._freed: collections.deque[tuple[int, int, int]] = collections.deque(
            maxlen=MAX_FREED_LOG
        )
        self._seq = 0
        # The allocator's freed-segment count per device at the last sweep.
        self._free_counts: dict[int, int] = {}
        # Returns the allocator's count of segments returned to the driver on a device (for
        # torch, ``segment.all.freed`` of ``torch.cuda.memory_stats``); None: every sweep asks
        # the driver about every cached allocation of the device.
        self.free_counter: Callable[[int], int] | None = None
        # Called with the base of each allocation exported anew (outside the lock): the
        # allocator hook then has smddpd unmap it before it is freed (backend/cuda_free_hook).
        self.on_export: Callable[[int], None] | None = None

    def _forget(self, base: int, export: _Export) -> None:
        """Logs an allocation as freed (the lock is held)."""
        self._seq += 1
        self._freed.append((self._seq, base, export.buffer_id))

    def sweep(self, device: int, what: str) -> None:
        """Forgets (and logs as freed) the cached allocations of GPU ``device`` the driver no
        longer knows or knows under another buffer id; cheap when the free counter has not
        moved since the last sweep."""
        counter = self.free_counter
        if counter is not None:
            count = counter(device)
            with self._lock:
                if self._free_counts.get(device) == count:
                    return
                self._free_counts[device] = count
        with self._lock:
            cached = [(b, e) for b, e in self._exports.items() if e.device == device]
        if not cached:
            return
        drv = self._bindings(what)
        gone = []
        for base, export in cached:
            try:
                info = drv.pointer_info(base)
            except cuda_driver.CudaUnavailable:
                gone.append((base, export))  # no longer memory the driver knows
                continue
            # cuPointerGetAttributes answers an address it does not know with zeros (base 0,
            # buffer id 0) rather than an error; a new allocation there has a new id.
            if info.base != base or info.buffer_id != export.buffer_id:
                gone.append((base, export))
        with self._lock:
            for base, export in gone:
                if self._exports.get(base) is export:
                    del self._exports[base]
                    self._forget(base, export)

    def freed_cursor(self) -> int:
        """The position in the freed log from which a new communicator starts (it has mapped
        nothing freed before it)."""
        with self._lock:
            return self._seq

    def freed_since(self, cursor: int) -> tuple[int, list[pb.CudaBuffer]]:
        """The allocations logged as freed after ``cursor``, and the new cursor."""
        with self._lock:
            if not self._freed or self._freed[-1][0] <= cursor:
                return cursor, []
            freed = [
                pb.CudaBuffer(alloc_base=base, buffer_id=bid)
                for seq, base, bid in self._freed
                if seq > cursor
            ]
            return self._seq, freed

    def _bindings(self, what: str) -> cuda_driver.Driver:
        try:
            return self._driver()
        except cuda_driver.CudaUnavailable as exc:
            raise UnsupportedError(f"{what}: GPU tensors need the NVIDIA driver: {exc}") from None

    def export(self, ptr: int, nbytes: int, device: int, what: str) -> pb.CudaBuffer:
        """The CudaBuffer of ``nbytes`` at address ``ptr`` of GPU ``device``.

        An empty range needs no allocation: it is sent without a handle.

        Raises:
            UnsupportedError: the address is not memory of that GPU the driver can export
                (e.g. torch's ``expandable_segments``), or the range overruns its allocation.
        """
        if nbytes == 0:
            return pb.CudaBuffer()
        drv = self._bindings(what)
        try:
            info = drv.pointer_info(ptr)
        except cuda_driver.CudaUnavailable as exc:
            raise UnsupportedError(
                f"{what}: address 0x{ptr:x} is not GPU memory the driver knows: {exc}"
            ) from None
        if info.memory_type != cuda_driver.MEMORY_TYPE_DEVICE or info.device != device:
            raise UnsupportedError(
                f"{what}: "
                f"address 0x{ptr:x} is not memory of GPU {device} (CUDA memory type {info.memory_type}, device {info.device})"  # noqa: E501
            )
        if not info.ipc_capable:
            raise UnsupportedError(
                f"{what}: the tensor's memory cannot be shared by CUDA IPC (cuIpcGetMemHandle); "
                "with torch, unset expandable_segments in PYTORCH_CUDA_ALLOC_CONF"
            )
        offset = ptr - info.base
        if offset < 0 or offset + nbytes > info.size:
            raise UnsupportedError(
                f"{what}: "
                f"{nbytes} bytes at 0x{ptr:x} overrun their allocation [0x{info.base:x}, +{info.size})"  # noqa: E501
            )
        with self._lock:
            cached = self._exports.get(info.base)
            if cached is not None and cached.buffer_id != info.buffer_id:
                # Freed and reallocated at the same address since the last sweep.
                self._forget(info.base, cached)
                cached = None
            if cached is None:
                try:
                    handle = drv.ipc_mem_handle(info.base, info.context)
                except cuda_driver.CudaUnavailable as exc:
                    raise UnsupportedError(
                        f"{what}: cannot export the tensor's allocation: {exc}"
                    ) from None
                cached = _Export(info.buffer_id, info.size, handle, device)
                self._exports[info.base] = cached
                fresh = True
            else:
                fresh = False
        if fresh and self.on_export is not None:
            self.on_export(info.base)
        return pb.CudaBuffer(
            ipc_handle=cached.handle,
            alloc_base=info.base,
            alloc_bytes=cached.size,
            offset=offset,
            nbytes=nbytes,
            buffer_id=cached.buffer_id,
        )

    def device_uuid(self, device: int, what: str) -> bytes:
        """The UUID of this process's device ``device`` (cached)."""
        with self._lock:
            uuid = self._uuids.get(device)
        if uuid is None:
            try:
                uuid = self._bindings(what).device_uuid(device)
            except cuda_driver.CudaUnavailable as exc:
                raise UnsupportedError(f"{what}: cannot identify GPU {device}: {exc}") from None
            with self._lock:
                self._uuids[device] = uuid
        return uuid

    def bases(self) -> list[int]:
        """The allocation bases exported so far and not known to be freed."""
        with self._lock:
            return list(self._exports)

    def cached(self) -> int:
        """Allocations exported so far (for tests and status)."""
        with self._lock:
            return len(self._exports)
