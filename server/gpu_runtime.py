"""``gpu.Runtime`` on CuPy: the daemon's real CUDA calls.

Imported only by ``gpu.ops()`` on the first GPU op; importing it imports CuPy. Kernels come
from ``gpu_kernels`` and are compiled by NVRTC once per combination of dtype, reduce op and
fan-in/fan-out (CuPy also caches the binaries on disk, in ``CUPY_CACHE_DIR``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from smddp import cuda_driver
from smddp.server import gpu_kernels
from smddp.server.gpu import CudaCallError

# cudaStreamNonBlocking: the stream does not synchronise with the legacy default stream.
_STREAM_NON_BLOCKING = 1
# cudaEventDisableTiming
_EVENT_DISABLE_TIMING = 2
# cudaMemcpyDefault: direction (and peer) from the unified address space.
_MEMCPY_DEFAULT = 4
# cudaIpcMemLazyEnablePeerAccess
_IPC_LAZY_PEER = 1
# cudaErrorNotReady, cudaErrorPeerAccessAlreadyEnabled
_NOT_READY = 600
_PEER_ALREADY_ENABLED = 704
# Resident blocks per SM worth launching for a memory-bound grid-stride kernel.
_BLOCKS_PER_SM = 8


class GpuUnavailable(RuntimeError):
    """CuPy is missing or sees no GPU; the message says what to install or check."""


class CupyRuntime:
    """The CUDA calls of ``gpu.GpuOps``, made with CuPy (runtime API) and the driver."""

    def __init__(self) -> None:
        try:
            import cupy
        except ImportError as exc:
            raise GpuUnavailable(
                f"CuPy is not installed in the daemon's environment ({exc}); install the "
                "'cuda' extra where smddpd runs (pip install '.[cuda]' in smddp's checkout, i.e. cupy-cuda12x)"
            ) from None
        self.cp = cupy
        self.rt = cupy.cuda.runtime
        try:
            count = self.rt.getDeviceCount()
        except self.rt.CUDARuntimeError as exc:
            raise GpuUnavailable(f"CuPy finds no usable GPU: {exc}") from None
        if count == 0:
            raise GpuUnavailable("CuPy finds no GPU visible to the daemon")
        try:
            drv = cuda_driver.driver()
            self._uuids = {drv.device_uuid(d): d for d in range(count)}
        except cuda_driver.CudaUnavailable as exc:
            raise GpuUnavailable(str(exc)) from None
        self._driver = drv
        self._grid: dict[int, int] = {}
        self._modules: dict[tuple[int, int, int, int], Any] = {}
        self._lock = threading.Lock()

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self.rt.CUDARuntimeError as exc:
            raise CudaCallError(f"{what}: {exc}") from None

    def _on(self, device: int) -> Any:
        return self.cp.cuda.Device(device)

    def device_of(self, uuid: bytes) -> int:
        device = self._uuids.get(uuid)
        if device is None:
            raise CudaCallError(
                f"no GPU with UUID {cuda_driver.uuid_text(uuid)} among the daemon's {len(self._uuids)}"
            )
        return device

    def open_memory(self, handle: bytes, device: int) -> int:
        with self._on(device):
            return int(
                self._call("cudaIpcOpenMemHandle", self.rt.ipcOpenMemHandle, handle, _IPC_LAZY_PEER)
            )

    def close_memory(self, address: int, device: int) -> None:
        with self._on(device):
            self._call("cudaIpcCloseMemHandle", self.rt.ipcCloseMemHandle, address)

    def mapped_size(self, address: int) -> int:
        try:
            info = self._driver.pointer_info(address)
        except cuda_driver.CudaUnavailable as exc:
            raise CudaCallError(str(exc)) from None
        # The mapping starts at the allocation's base; what lies beyond its start counts.
        return info.size - (address - info.base)

    def open_event(self, handle: bytes, device: int) -> Any:
        with self._on(device):
            return self._call("cudaIpcOpenEventHandle", self.rt.ipcOpenEventHandle, handle)

    def destroy_event(self, event: Any, device: int) -> None:
        with self._on(device):
            self._call("cudaEventDestroy", self.rt.eventDestroy, event)

    def new_event(self, device: int) -> Any:
        with self._on(device):
            return self._call(
                "cudaEventCreateWithFlags", self.rt.eventCreateWithFlags, _EVENT_DISABLE_TIMING
            )

    def event_done(self, event: Any, device: int) -> bool:
        with self._on(device):
            status = self.rt.eventQuery(event)  # returns the status: 600 is "not ready yet"
        if status == _NOT_READY:
            return False
        if status != 0:
            raise CudaCallError(f"cudaEventQuery: CUDA error {status}")
        return True

    def new_stream(self, device: int) -> Any:
        with self._on(device):
            return self._call(
                "cudaStreamCreateWithFlags", self.rt.streamCreateWithFlags, _STREAM_NON_BLOCKING
            )

    def destroy_stream(self, stream: Any, device: int) -> None:
        with self._on(device):
            self._call("cudaStreamDestroy", self.rt.streamDestroy, stream)

    def wait_event(self, stream: Any, event: Any, device: int) -> None:
        with self._on(device):
            self._call("cudaStreamWaitEvent", self.rt.streamWaitEvent, stream, event, 0)

    def record_event(self, event: Any, stream: Any, device: int) -> None:
        with self._on(device):
            self._call("cudaEventRecord", self.rt.eventRecord, event, stream)

    def synchronize(self, stream: Any, device: int) -> None:
        with self._on(device):
            self._call("cudaStreamSynchronize", self.rt.streamSynchronize, stream)

    def enable_peer(self, device: int, peer: int) -> None:
        if not self._call("cudaDeviceCanAccessPeer", self.rt.deviceCanAccessPeer, device, peer):
            raise CudaCallError(f"cudaDeviceCanAccessPeer({device}, {peer}) is false")
        with self._on(device):
            try:
                self.rt.deviceEnablePeerAccess(peer)
            except self.rt.CUDARuntimeError as exc:
                if getattr(exc, "status", None) != _PEER_ALREADY_ENABLED:
                    raise CudaCallError(
                        f"cudaDeviceEnablePeerAccess({peer}) on GPU {device}: {exc}"
                    ) from None

    def max_grid(self, device: int) -> int:
        grid = self._grid.get(device)
        if grid is None:
            props = self._call("cudaGetDeviceProperties", self.rt.getDeviceProperties, device)
            grid = self._grid[device] = int(props["multiProcessorCount"]) * _BLOCKS_PER_SM
        return grid

    def _function(
        self, dtype: int, reduce_op: int, fan_in: int, fan_out: int, vectorized: bool
    ) -> Any:
        key = (dtype, reduce_op, fan_in, fan_out)
        with self._lock:
            module = self._modules.get(key)
            if module is None:
                source = gpu_kernels.reduce_module(dtype, reduce_op, fan_in, fan_out)
                module = self.cp.RawModule(code=source, options=("--std=c++14",))
                self._modules[key] = module
        name = gpu_kernels.kernel_name(dtype, reduce_op, fan_in, fan_out, vectorized)
        try:
            return module.get_function(name)  # compiles (NVRTC) on first use per device
        except Exception as exc:  # CompileException, or a driver error loading the module
            raise CudaCallError(f"compiling {name}: {exc}") from None

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
        import numpy as np

        itemsize = gpu_kernels.SPECS[dtype].itemsize
        off = launch.start * itemsize
        args = tuple(np.uint64(a + off) for a in list(inputs) + list(outputs)) + (
            np.uint64(launch.units),
        )
        with self._on(device):
            fn = self._function(dtype, reduce_op, len(inputs), len(outputs), launch.vectorized)
            external = self.cp.cuda.ExternalStream(stream, device)
            try:
                with external:
                    fn((launch.grid,), (gpu_kernels.BLOCK_THREADS,), args)
            except (self.cp.cuda.driver.CUDADriverError, self.rt.CUDARuntimeError) as exc:
                raise CudaCallError(f"launching the reduction kernel: {exc}") from None

    def copy(self, stream: Any, device: int, dst: int, src: int, nbytes: int) -> None:
        with self._on(device):
            self._call(
                "cudaMemcpyAsync", self.rt.memcpyAsync, dst, src, nbytes, _MEMCPY_DEFAULT, stream
            )
