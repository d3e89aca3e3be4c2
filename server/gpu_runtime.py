"""``gpu.Runtime`` on CuPy: the daemon's real CUDA calls.

Imported only by ``gpu_supply.DaemonGpu`` at the first GPU op; CuPy itself is imported by
``CupyRuntime``. Kernels come from ``gpu_kernels``; each module's cubin (one per combination
of dtype, reduce op, fan-in/fan-out and GPU architecture) is found, in this order, in the
process's memory, in the prepared archives of ``SMDDP_KERNEL_CACHE`` (``PreparedKernels``,
compiled beforehand on a machine without a GPU: benchmarks/gpu_kernel_cache.py), in the disk
cache an earlier daemon wrote, or else compiled by NVRTC (``compile_module``), each module under
a lock of its own and, when several are wanted at once (``warm``), in parallel threads (NVRTC
releases the GIL). Modules are then loaded once per device (a module's functions belong to one
device's context).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading
import zipfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from smddp.core import cuda_driver
from smddp.server import gpu_kernels
from smddp.server.errors import CudaCallError
from smddp.v1 import smddp_pb2 as pb

log = logging.getLogger(__name__)

# cudaStreamNonBlocking: the stream does not synchronise with the legacy default stream.
_STREAM_NON_BLOCKING = 1
# cudaEventDisableTiming
_EVENT_DISABLE_TIMING = 2
# cudaMemcpyDefault: direction (and peer) from the unified address space.
_MEMCPY_DEFAULT = 4
# cudaIpcMemLazyEnablePeerAccess
_IPC_LAZY_PEER = 1
# cudaHostAllocPortable | cudaHostAllocMapped
_HOST_ALLOC_PORTABLE_MAPPED = 1 | 2
# CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0, so tickets may wrap around.
_WAIT_VALUE_GEQ = 0
# cudaErrorNotReady, cudaErrorPeerAccessAlreadyEnabled
_NOT_READY = 600
_PEER_ALREADY_ENABLED = 704
# Resident blocks per SM worth launching for a memory-bound grid-stride kernel.
_BLOCKS_PER_SM = 8
# cudaDevAttrComputeCapabilityMajor, ...Minor
_ATTR_CC_MAJOR = 75
_ATTR_CC_MINOR = 76
# What NVRTC gets: the same options for every module (tests compile with exactly these).
NVRTC_OPTIONS = ("--std=c++14",)
# Kernels worth having before the first op needs them: all_reduce of the usual training
# dtypes by 2, 4 and 8 ranks of one GPU.
COMMON_KERNELS = [(dtype, pb.SUM, w, w) for dtype in (pb.FLOAT32, pb.BFLOAT16) for w in (2, 4, 8)]
# Folders (separated by os.pathsep) of prepared kernel archives, read before anything is
# compiled: benchmarks/gpu_check.py sets it to benchmarks/kernel_cache.
KERNEL_CACHE_ENV = "SMDDP_KERNEL_CACHE"
# Modules compiled at once by ``warm`` (NVRTC runs outside the GIL; each takes ~0.3 s).
WARM_THREADS = 8


def prepared_entry(key: gpu_kernels.ModuleKey, arch: str) -> str:
    """The name of ``key``'s cubin for ``arch`` in a prepared archive: the kernel's name and a
    digest of its source and NVRTC's options, so a changed generator never meets an old cubin."""
    source = gpu_kernels.reduce_module(*key)
    digest = hashlib.sha256("\0".join([source, *NVRTC_OPTIONS, arch]).encode()).hexdigest()
    return f"{gpu_kernels.kernel_name(*key, False)}.{arch}.{digest[:20]}.cubin"


def archive_name(arch: str, cuda_major: int) -> str:
    """The prepared archive of ``arch`` built by NVRTC of CUDA ``cuda_major``, e.g.
    ``sm_90-cuda13.zip`` (a cubin of one CUDA major may not load under another's driver)."""
    return f"{arch}-cuda{cuda_major}.zip"


class PreparedKernels:
    """Cubins compiled beforehand, read from zip archives (``archive_name``) in ``folders``.

    An archive holds one member per module (``prepared_entry``); the first folder holding a
    member wins. Safe for concurrent readers (one lock around the archives).
    """

    def __init__(self, folders: Sequence[str]) -> None:
        self.folders = [f for f in folders if f]
        self._archives: dict[str, list[zipfile.ZipFile]] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> PreparedKernels:
        """The archives ``SMDDP_KERNEL_CACHE`` names (none when it is unset)."""
        return cls(os.environ.get(KERNEL_CACHE_ENV, "").split(os.pathsep))

    def _open(self, name: str) -> list[zipfile.ZipFile]:
        archives = self._archives.get(name)
        if archives is None:
            archives = []
            for folder in self.folders:
                path = os.path.join(folder, name)
                try:
                    archives.append(zipfile.ZipFile(path))
                except FileNotFoundError:
                    continue
                except (OSError, zipfile.BadZipFile) as exc:
                    log.warning("prepared kernel archive %s unreadable: %s", path, exc)
            self._archives[name] = archives
        return archives

    def get(self, key: gpu_kernels.ModuleKey, arch: str, cuda_major: int) -> bytes | None:
        """``key``'s prepared cubin for ``arch``, or None where no archive holds it."""
        if not self.folders:
            return None
        member = prepared_entry(key, arch)
        with self._lock:
            for archive in self._open(archive_name(arch, cuda_major)):
                try:
                    return archive.read(member) or None
                except KeyError:
                    continue
                except (OSError, zipfile.BadZipFile) as exc:
                    log.warning("prepared kernel %s unreadable: %s", member, exc)
        return None

    def members(self, arch: str, cuda_major: int) -> set[str]:
        """Every member name of the archives of ``arch`` and ``cuda_major``."""
        with self._lock:
            return {n for a in self._open(archive_name(arch, cuda_major)) for n in a.namelist()}


def compile_module(
    cupy: Any, dtype: int, reduce_op: int, fan_in: int, fan_out: int, arch: str
) -> bytes:
    """The cubin of one generated module for ``arch`` (e.g. "sm_90"), compiled by NVRTC
    (CuPy's bindings, ``cupy.cuda.nvrtc``) with ``NVRTC_OPTIONS``. Needs NVRTC, no GPU: the
    tests compile every module with exactly this where CuPy imports.

    Raises:
        CudaCallError: NVRTC refused the source (the message has its log).
    """
    source = gpu_kernels.reduce_module(dtype, reduce_op, fan_in, fan_out)
    name = gpu_kernels.kernel_name(dtype, reduce_op, fan_in, fan_out, False) + ".cu"
    nvrtc = cupy.cuda.nvrtc
    prog = nvrtc.createProgram(source, name, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, (*NVRTC_OPTIONS, f"-arch={arch}"))
        except nvrtc.NVRTCError as exc:
            raise CudaCallError(
                f"NVRTC cannot compile {name} for {arch}: {exc}\n{nvrtc.getProgramLog(prog)}"
            ) from None
        return bytes(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)


class GpuUnavailable(RuntimeError):
    """CuPy is missing or sees no GPU; the message says what to install or check."""


class CupyRuntime:
    """The CUDA calls of ``gpu.GpuOps``, made with CuPy (runtime API) and the driver.

    ``warm``: compile and load ``COMMON_KERNELS`` on every GPU in a background thread (the
    daemon's first GPU op does this; ops meanwhile wait only for the modules they need).
    """

    def __init__(self, warm: bool = False) -> None:
        try:
            import cupy
        except ImportError as exc:
            raise GpuUnavailable(
                f"CuPy is not installed in the daemon's environment ({exc}); "
                "install the 'cuda' extra where smddpd runs (pip install '.[cuda]' in smddp's checkout, i.e. cupy-cuda12x)"  # noqa: E501
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
        self._wait_value: Any = None
        self._archs: dict[int, str] = {}
        self._binaries: dict[tuple[tuple[int, int, int, int], str], bytes] = {}
        self._prepared = PreparedKernels.from_env()
        # Where each module's cubin came from: "prepared", "disk" or "compiled" (gpu_check
        # reads the daemon's log line of these counts).
        self.sources: dict[str, int] = {"prepared": 0, "disk": 0, "compiled": 0}
        self._compiling: dict[tuple[tuple[int, int, int, int], str], threading.Lock] = {}
        self._modules: dict[tuple[tuple[int, int, int, int], int], Any] = {}
        self._lock = threading.Lock()
        if warm:
            threading.Thread(target=self._warm_all, name="smddp-gpu-warm", daemon=True).start()

    def _warm_all(self) -> None:
        for device in sorted(set(self._uuids.values())):
            try:
                self.warm(device, COMMON_KERNELS)
            except CudaCallError as exc:  # the op that needs the module reports it
                log.warning("warming the reduction kernels on GPU %d: %s", device, exc)
                return

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
                f"no GPU with UUID {cuda_driver.uuid_text(uuid)} among the daemon's {len(self._uuids)}"  # noqa: E501
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

    def new_flag(self, device: int) -> Any:
        # Pinned, mapped and portable host memory: every GPU's streams can read it, and with
        # unified addressing its device address is its host address.
        with self._on(device):
            address = int(
                self._call("cudaHostAlloc", self.rt.hostAlloc, 4, _HOST_ALLOC_PORTABLE_MAPPED)
            )
        ctypes.c_uint32.from_address(address).value = 0
        return address

    def set_flag(self, flag: Any, value: int) -> None:
        ctypes.c_uint32.from_address(flag).value = value & 0xFFFFFFFF

    def wait_flag(self, stream: Any, flag: Any, value: int, device: int) -> None:
        with self._on(device):
            status = self._wait_value32()(stream, flag, value & 0xFFFFFFFF, _WAIT_VALUE_GEQ)
        if status != 0:
            raise CudaCallError(f"cuStreamWaitValue32: CUDA error {status}")

    def destroy_flag(self, flag: Any) -> None:
        self._call("cudaFreeHost", self.rt.freeHost, flag)

    def alloc_host(self, nbytes: int, device: int) -> tuple[int, memoryview]:
        # As the flags: pinned, mapped and portable, so that every GPU's copies reach it at
        # full speed (no bounce through pageable memory) and kernels may write it directly.
        with self._on(device):
            address = int(
                self._call(
                    "cudaHostAlloc", self.rt.hostAlloc, max(1, nbytes), _HOST_ALLOC_PORTABLE_MAPPED
                )
            )
        return address, memoryview((ctypes.c_uint8 * max(1, nbytes)).from_address(address))

    def free_host(self, address: int) -> None:
        self._call("cudaFreeHost", self.rt.freeHost, address)

    def _wait_value32(self) -> Any:
        """cuStreamWaitValue32 of the driver (its _v2 entry point where there is one)."""
        if self._wait_value is None:
            try:
                lib = ctypes.CDLL(cuda_driver.LIBRARY)
            except OSError as exc:
                raise CudaCallError(f"cuStreamWaitValue32: {exc}") from None
            fn = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
            self._wait_value = fn
        return self._wait_value

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

    def _arch(self, device: int) -> str:
        arch = self._archs.get(device)
        if arch is None:
            major = self._call(
                "cudaDeviceGetAttribute", self.rt.deviceGetAttribute, _ATTR_CC_MAJOR, device
            )
            minor = self._call(
                "cudaDeviceGetAttribute", self.rt.deviceGetAttribute, _ATTR_CC_MINOR, device
            )
            arch = self._archs[device] = f"sm_{major}{minor}"
        return arch

    def _cuda_major(self) -> int:
        try:
            return int(self.cp.cuda.nvrtc.getVersion()[0])
        except Exception:  # NVRTC's library missing: the prepared archives still serve
            return int(self.rt.runtimeGetVersion()) // 1000

    def _binary(self, key: tuple[int, int, int, int], arch: str, prepared: bool = True) -> bytes:
        """The module's cubin for ``arch``: prepared, cached on disk, or compiled once (other
        compiles go on meanwhile: one lock per module, never the daemon's). ``prepared``
        False skips the prepared archives (a prepared cubin the driver refused)."""
        with self._lock:
            lock = self._compiling.setdefault((key, arch), threading.Lock())
        with lock:
            binary = self._binaries.get((key, arch))
            source = ""
            if binary is None and prepared:
                binary = self._prepared.get(key, arch, self._cuda_major())
                source = "prepared"
            if binary is None:
                binary = self._cached(key, arch)
                source = "disk"
            if binary is None:
                source = "compiled"
                try:
                    binary = compile_module(self.cp, *key, arch=arch)
                except CudaCallError:
                    raise
                except Exception as exc:  # NVRTC's library missing
                    raise CudaCallError(
                        f"compiling {gpu_kernels.kernel_name(*key, False)} for {arch}: {exc}"
                    ) from None
                self._store(key, arch, binary)
            if source:
                with self._lock:
                    self.sources[source] += 1
            self._binaries[(key, arch)] = binary
            return binary

    def _cache_path(self, key: tuple[int, int, int, int], arch: str) -> str:
        source = gpu_kernels.reduce_module(*key)
        try:
            nvrtc = ".".join(map(str, self.cp.cuda.nvrtc.getVersion()))
        except Exception:
            nvrtc = "?"
        digest = hashlib.sha256(
            "\0".join([source, *NVRTC_OPTIONS, arch, nvrtc]).encode()
        ).hexdigest()
        folder = os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")
        return os.path.join(folder, f"smddp-{digest}.cubin")

    def _cached(self, key: tuple[int, int, int, int], arch: str) -> bytes | None:
        """A cubin compiled earlier (by any process: gpu_check.sh warms it) from the same
        source, options, architecture and NVRTC version."""
        try:
            with open(self._cache_path(key, arch), "rb") as f:
                return f.read() or None
        except OSError:
            return None

    def _store(self, key: tuple[int, int, int, int], arch: str, binary: bytes) -> None:
        path = self._cache_path(key, arch)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(binary)
            os.replace(tmp, path)  # whole files only, whoever reads concurrently
        except OSError:
            pass  # a cache that cannot be written costs a compile per process, nothing else

    def prepare(self, device: int, key: tuple[int, int, int, int]) -> None:
        """Compiles and loads the module of ``key`` (dtype, reduce op, fan-in, fan-out) on
        ``device``; the daemon calls it before taking its lock, so a compile stalls nobody."""
        if (key, device) in self._modules:
            return
        arch = self._arch(device)
        try:
            self._load(device, key, self._binary(key, arch))
        except CudaCallError as exc:
            if not self._prepared.folders:
                raise
            # Perhaps a prepared cubin this driver refuses (built by a newer CUDA): compile.
            log.warning(
                "%s for %s did not load (%s); compiling it",
                gpu_kernels.kernel_name(*key, False),
                arch,
                exc,
            )
            self._binaries.pop((key, arch), None)
            self._load(device, key, self._binary(key, arch, prepared=False))

    def _load(self, device: int, key: tuple[int, int, int, int], binary: bytes) -> None:
        with self._lock:
            if (key, device) in self._modules:
                return
            with self._on(device):
                module = self.cp.cuda.function.Module()
                try:
                    module.load(binary)
                except Exception as exc:  # CUDADriverError
                    raise CudaCallError(f"loading the reduction kernels: {exc}") from None
            # One loaded module per device: a module's functions belong to its context.
            self._modules[(key, device)] = module

    def warm(self, device: int, keys: Sequence[tuple[int, int, int, int]]) -> None:
        """Finds or compiles ``keys``' cubins for ``device``'s architecture, the missing ones
        in parallel threads, then loads them on ``device`` (gpu_check, and the daemon's first
        GPU op for ``COMMON_KERNELS``).

        Raises:
            CudaCallError: a module does not compile or load (the first such, once all ran).
        """
        wanted = [k for k in dict.fromkeys(keys) if (k, device) not in self._modules]
        if not wanted:
            return
        arch = self._arch(device)
        threads = max(1, min(WARM_THREADS, len(wanted)))
        with ThreadPoolExecutor(threads, thread_name_prefix="smddp-nvrtc") as pool:
            # list(): the first failure is raised here, after every compile has finished.
            list(pool.map(lambda k: self._binary(k, arch), wanted))
        for key in wanted:
            self.prepare(device, key)
        log.info(
            "reduction kernels on GPU %d (%s): "
            "%d ready; "
            "cubins so far: "
            "%d prepared, %d from the disk cache, %d compiled",
            device,
            arch,
            len(wanted),
            self.sources["prepared"],
            self.sources["disk"],
            self.sources["compiled"],
        )

    def _function(
        self, device: int, dtype: int, reduce_op: int, fan_in: int, fan_out: int, vectorized: bool
    ) -> Any:
        key = (dtype, reduce_op, fan_in, fan_out)
        self.prepare(device, key)
        name = gpu_kernels.kernel_name(dtype, reduce_op, fan_in, fan_out, vectorized)
        try:
            return self._modules[(key, device)].get_function(name)
        except Exception as exc:
            raise CudaCallError(f"{name}: {exc}") from None

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
            fn = self._function(
                device, dtype, reduce_op, len(inputs), len(outputs), launch.vectorized
            )
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
