"""A rank's GPU memory as the daemon may open it: CUDA IPC handles of allocations.

A tensor lies somewhere inside an allocation (torch's caching allocator carves tensors out
of large cudaMalloc segments). CUDA IPC exports whole allocations, so a range is sent as the
allocation's handle plus an offset, and the handle is exported once per allocation and kept,
as torch's own CUDA sharing keys its handles by allocation base. The driver's buffer id
(never reused, unlike addresses) tells a new allocation at a recycled address from the old.

This uses the CUDA driver directly (``smddp.cuda_driver``) rather than torch's
``storage._share_cuda_()``: that call moves the storage behind torch's inter-process
reference counting, whose counter only a torch consumer releases; the daemon has no torch,
and every storage shared that way would stay allocated forever.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from smddp import cuda_driver
from smddp.client.errors import UnsupportedError
from smddp.v1 import smddp_pb2 as pb


@dataclass(frozen=True)
class _Export:
    buffer_id: int
    size: int
    handle: bytes


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
                f"{what}: address 0x{ptr:x} is not memory of GPU {device} (CUDA memory type "
                f"{info.memory_type}, device {info.device})"
            )
        if not info.ipc_capable:
            raise UnsupportedError(
                f"{what}: the tensor's memory cannot be shared by CUDA IPC (cuIpcGetMemHandle); "
                "with torch, unset expandable_segments in PYTORCH_CUDA_ALLOC_CONF"
            )
        offset = ptr - info.base
        if offset < 0 or offset + nbytes > info.size:
            raise UnsupportedError(
                f"{what}: {nbytes} bytes at 0x{ptr:x} overrun their allocation "
                f"[0x{info.base:x}, +{info.size})"
            )
        with self._lock:
            cached = self._exports.get(info.base)
            if cached is None or cached.buffer_id != info.buffer_id:
                try:
                    handle = drv.ipc_mem_handle(info.base, info.context)
                except cuda_driver.CudaUnavailable as exc:
                    raise UnsupportedError(
                        f"{what}: cannot export the tensor's allocation: {exc}"
                    ) from None
                cached = _Export(info.buffer_id, info.size, handle)
                self._exports[info.base] = cached
        return pb.CudaBuffer(
            ipc_handle=cached.handle,
            alloc_base=info.base,
            alloc_bytes=cached.size,
            offset=offset,
            nbytes=nbytes,
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

    def cached(self) -> int:
        """Allocations exported so far (for tests and status)."""
        with self._lock:
            return len(self._exports)
