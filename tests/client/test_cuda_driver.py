"""core/cuda_driver.py's ctypes marshalling, against a stand-in libcuda built here with gcc.

The stand-in implements the few driver entry points smddp calls with the real signatures
and writes known values, so the tests check what ctypes bugs would silently get wrong: the
attribute array of cuPointerGetAttributes and each value's width, handles and UUIDs with
zero bytes in them, the context pushed around cuIpcGetMemHandle, and error names.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from smddp.core import cuda_driver

FAKE_LIBCUDA = r"""
#include <string.h>
typedef unsigned long long CUdeviceptr;
typedef int CUresult;
static void *pushed = 0;
static int pushes = 0, pops = 0;
CUresult cuInit(unsigned int flags) { return flags == 0 ? 0 : 1; }
CUresult cuGetErrorName(CUresult error, const char **name) {
  *name = error == 1 ? "CUDA_ERROR_INVALID_VALUE" : "CUDA_ERROR_UNKNOWN"; return 0;
}
CUresult cuPointerGetAttributes(unsigned int n, int *attributes, void **data, CUdeviceptr ptr) {
  if (ptr == 0xdead) return 1;
  for (unsigned int i = 0; i < n; i++) {
    switch (attributes[i]) {
      case 1: *(void **)data[i] = (void *)0xc0ffee; break;                    /* CONTEXT */
      case 2: *(unsigned int *)data[i] = 2; break;                             /* MEMORY_TYPE */
      case 7: *(unsigned long long *)data[i] = 0x123456789abcULL; break;       /* BUFFER_ID */
      case 9: *(int *)data[i] = 3; break;                                      /* DEVICE_ORDINAL */
      case 10: *(unsigned char *)data[i] = 1; break;                           /* IPC CAPABLE */
      case 11: *(CUdeviceptr *)data[i] = ptr & ~0xfffffULL; break;             /* RANGE_START */
      case 12: *(size_t *)data[i] = 0x200000; break;                           /* RANGE_SIZE */
      default: return 1;
    }
  }
  return 0;
}
CUresult cuCtxPushCurrent_v2(void *ctx) { pushed = ctx; pushes++; return 0; }
CUresult cuCtxPopCurrent_v2(void **ctx) { *ctx = pushed; pops++; return 0; }
CUresult cuIpcGetMemHandle(unsigned char *handle, CUdeviceptr base) {
  if (pushed != (void *)0xc0ffee || pushes != pops + 1) return 1;
  for (int i = 0; i < 64; i++) handle[i] = (unsigned char)(i % 3 == 0 ? 0 : (base >> 20) + i);
  return 0;
}
CUresult cuDeviceGet(int *dev, int ordinal) { *dev = ordinal + 100; return ordinal < 8 ? 0 : 1; }
CUresult cuDeviceGetUuid_v2(unsigned char *uuid, int dev) {
  for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(i == 4 ? 0 : dev + i);
  return 0;
}
CUresult cuDeviceGetCount(int *n) { *n = 2; return 0; }
int ctx_pops(void) { return pops; }
"""


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory: pytest.TempPathFactory) -> tuple[cuda_driver.Driver, ctypes.CDLL]:
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler to build a stand-in libcuda")
    folder = tmp_path_factory.mktemp("libcuda")
    (folder / "fake.c").write_text(FAKE_LIBCUDA)
    lib_path = folder / "libcuda_fake.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-o", str(lib_path), str(folder / "fake.c")],
        check=True,
    )
    lib = ctypes.CDLL(str(lib_path))
    return cuda_driver.Driver(lib), lib


def test_pointer_attributes_arrive_with_their_widths(fake_driver) -> None:
    drv, _ = fake_driver
    info = drv.pointer_info(0x7F00_0012_3456)
    assert info == cuda_driver.PointerInfo(
        buffer_id=0x123456789ABC,
        base=0x7F00_0010_0000,
        size=0x200000,
        device=3,
        memory_type=cuda_driver.MEMORY_TYPE_DEVICE,
        ipc_capable=True,
        context=0xC0FFEE,
    )


def test_a_handle_keeps_its_zero_bytes_and_the_context_is_restored(fake_driver) -> None:
    drv, lib = fake_driver
    handle = drv.ipc_mem_handle(0x7F00_0010_0000, 0xC0FFEE)
    assert len(handle) == cuda_driver.IPC_HANDLE_BYTES
    assert handle[0] == 0 and handle[3] == 0 and handle[1] != 0  # not cut at the first NUL
    assert lib.ctx_pops() >= 1


def test_uuids_are_sixteen_bytes_and_printed_like_nvidia_smi(fake_driver) -> None:
    drv, _ = fake_driver
    uuid = drv.device_uuid(1)
    assert uuid == bytes(101 + i if i != 4 else 0 for i in range(16))
    assert cuda_driver.uuid_text(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert drv.device_count() == 2


def test_driver_errors_are_named(fake_driver) -> None:
    drv, _ = fake_driver
    with pytest.raises(
        cuda_driver.CudaUnavailable,
        match=r"cuPointerGetAttributes\(0xdead\) failed: CUDA_ERROR_INVALID_VALUE",
    ):
        drv.pointer_info(0xDEAD)
    with pytest.raises(cuda_driver.CudaUnavailable, match=r"cuDeviceGet\(9\) failed"):
        drv.device_uuid(9)


def test_without_libcuda_the_error_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cuda_driver, "_driver", None)
    monkeypatch.setattr(cuda_driver, "LIBRARY", str(tmp_path / "no-such-libcuda.so.1"))
    with pytest.raises(
        cuda_driver.CudaUnavailable, match="the NVIDIA driver library .* cannot be loaded"
    ):
        cuda_driver.driver()
