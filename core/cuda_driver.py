"""The few CUDA driver API calls smddp makes itself, through ctypes on ``libcuda.so.1``.

Both sides use it: a rank asks which allocation a tensor's pointer lies in and exports that
allocation's CUDA IPC handle (``cuIpcGetMemHandle`` wants the allocation's base, which only
the driver knows); the daemon checks the size of what it mapped and names GPUs by UUID.
Everything else on GPUs goes through torch (the ranks) or CuPy (the daemon).

Nothing is loaded at import: the library is opened on the first call, so importing this
module costs nothing where there is no GPU, and a missing driver is a clear error then.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

LIBRARY = "libcuda.so.1"
IPC_HANDLE_BYTES = 64  # sizeof(CUipcMemHandle) == sizeof(CUipcEventHandle)
UUID_BYTES = 16

# CUpointer_attribute values (cuda.h).
_ATTR_CONTEXT = 1
_ATTR_MEMORY_TYPE = 2
_ATTR_BUFFER_ID = 7
_ATTR_DEVICE_ORDINAL = 9
_ATTR_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_ATTR_RANGE_START_ADDR = 11
_ATTR_RANGE_SIZE = 12
MEMORY_TYPE_DEVICE = 2  # CU_MEMORYTYPE_DEVICE


class CudaUnavailable(RuntimeError):
    """The CUDA driver is missing, failed to initialise, or refused a call."""


@dataclass(frozen=True)
class PointerInfo:
    """What the driver knows about a device pointer's allocation.

    Attributes:
        buffer_id: a process-wide unique id of the allocation (never reused, unlike addresses).
        base: the allocation's start address.
        size: the allocation's size in bytes.
        device: the device ordinal in this process.
        memory_type: CU_MEMORYTYPE_* (2 for device memory; 0 when the driver does not know it).
        ipc_capable: whether cuIpcGetMemHandle can export it (False for cuMemCreate memory,
            e.g. torch's expandable segments).
        context: the CUcontext the allocation belongs to.
    """

    buffer_id: int
    base: int
    size: int
    device: int
    memory_type: int
    ipc_capable: bool
    context: int


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_char * UUID_BYTES)]


class Driver:
    """Bound driver entry points; get the process's one with ``driver()``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._check(lib.cuInit(0), "cuInit")
        self._uuid = getattr(lib, "cuDeviceGetUuid_v2", None) or lib.cuDeviceGetUuid

    def _check(self, status: int, what: str) -> None:
        if status == 0:
            return
        name = ctypes.c_char_p()
        self._lib.cuGetErrorName(status, ctypes.byref(name))
        label = name.value.decode() if name.value else f"CUresult {status}"
        raise CudaUnavailable(f"{what} failed: {label}")

    def pointer_info(self, ptr: int) -> PointerInfo:
        """Describes the allocation holding device address ``ptr`` (one driver call)."""
        buffer_id = ctypes.c_ulonglong(0)
        base = ctypes.c_ulonglong(0)
        size = ctypes.c_size_t(0)
        device = ctypes.c_int(-1)
        memory_type = ctypes.c_uint(0)
        ipc_capable = ctypes.c_int(0)  # the driver writes a 1-byte bool into it
        context = ctypes.c_void_p(0)
        slots = [
            (_ATTR_BUFFER_ID, buffer_id),
            (_ATTR_RANGE_START_ADDR, base),
            (_ATTR_RANGE_SIZE, size),
            (_ATTR_DEVICE_ORDINAL, device),
            (_ATTR_MEMORY_TYPE, memory_type),
            (_ATTR_IS_LEGACY_CUDA_IPC_CAPABLE, ipc_capable),
            (_ATTR_CONTEXT, context),
        ]
        attrs = (ctypes.c_int * len(slots))(*(a for a, _ in slots))
        data = (ctypes.c_void_p * len(slots))(
            *(ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for _, v in slots)
        )
        self._check(
            self._lib.cuPointerGetAttributes(len(slots), attrs, data, ctypes.c_ulonglong(ptr)),
            f"cuPointerGetAttributes(0x{ptr:x})",
        )
        return PointerInfo(
            buffer_id=buffer_id.value,
            base=base.value,
            size=size.value,
            device=device.value,
            memory_type=memory_type.value,
            ipc_capable=bool(ipc_capable.value & 0xFF),
            context=context.value or 0,
        )

    def ipc_mem_handle(self, base: int, context: int) -> bytes:
        """Exports the allocation starting at ``base`` (made in ``context``) for CUDA IPC."""
        handle = _IpcHandle()
        self._check(self._lib.cuCtxPushCurrent_v2(ctypes.c_void_p(context)), "cuCtxPushCurrent")
        try:
            self._check(
                self._lib.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_ulonglong(base)),
                f"cuIpcGetMemHandle(0x{base:x})",
            )
        finally:
            popped = ctypes.c_void_p()
            self._lib.cuCtxPopCurrent_v2(ctypes.byref(popped))
        # Not handle.reserved: a c_char array's value stops at the first NUL byte.
        return ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES)

    def device_uuid(self, ordinal: int) -> bytes:
        """The UUID of device ``ordinal`` of this process (16 bytes)."""
        dev = ctypes.c_int(0)
        self._check(self._lib.cuDeviceGet(ctypes.byref(dev), ordinal), f"cuDeviceGet({ordinal})")
        uuid = _Uuid()
        self._check(self._uuid(ctypes.byref(uuid), dev), f"cuDeviceGetUuid({ordinal})")
        return ctypes.string_at(ctypes.addressof(uuid), UUID_BYTES)

    def device_count(self) -> int:
        """Devices visible to this process."""
        n = ctypes.c_int(0)
        self._check(self._lib.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
        return n.value


_driver: Driver | None = None
_lock = threading.Lock()


def driver() -> Driver:
    """The process's driver bindings, loaded on first use.

    Raises:
        CudaUnavailable: no NVIDIA driver here (``libcuda.so.1`` cannot be loaded) or cuInit
            failed (e.g. no GPU visible).
    """
    global _driver
    with _lock:
        if _driver is None:
            try:
                lib = ctypes.CDLL(LIBRARY)
            except OSError as exc:
                raise CudaUnavailable(
                    f"the NVIDIA driver library {LIBRARY} cannot be loaded ({exc})"
                ) from None
            _driver = Driver(lib)
        return _driver


def uuid_text(uuid: bytes) -> str:
    """A UUID the way nvidia-smi prints it: ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""
    h = uuid.hex()
    if len(h) != 2 * UUID_BYTES:
        return f"GPU-{h or '?'}"
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
