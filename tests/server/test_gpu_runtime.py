"""server/gpu_runtime.py against a stand-in ``cupy`` module (put in ``sys.modules``, so the
real CuPy, where installed, is not used).

The stand-in has the signatures of CuPy's ``cupy.cuda.runtime`` (statuses, return values,
CUDARuntimeError with ``.status``), ``Device`` and ``ExternalStream`` contexts, the NVRTC
bindings ``cupy.cuda.nvrtc`` and ``cupy.cuda.function.Module``; it records the calls, so these tests
pin down how the daemon calls CuPy:
which device is current, which flags go with IPC opens and copies, how a "not ready" event
query and an already enabled peer are read, and the kernel's arguments.
"""

from __future__ import annotations

import ctypes
import sys
import time
import types

import numpy as np
import pytest

from smddp.core import cuda_driver
from smddp.server import gpu_kernels
from smddp.server.gpu import CudaCallError
from smddp.v1 import smddp_pb2 as pb


class CUDARuntimeError(RuntimeError):
    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"cudaError {status}")


def fake_cupy(calls: list, devices: int = 2, peer_status: int = 0, query_status: int = 0):
    current = {"device": 0, "stream": None}

    class Device:
        def __init__(self, d: int) -> None:
            self.d = d

        def __enter__(self):
            self.prev, current["device"] = current["device"], self.d

        def __exit__(self, *exc):
            current["device"] = self.prev

    class ExternalStream:
        def __init__(self, ptr: int, device_id: int = -1) -> None:
            self.ptr, self.device_id = ptr, device_id

        def __enter__(self):
            current["stream"] = self.ptr

        def __exit__(self, *exc):
            current["stream"] = None

    class NVRTCError(RuntimeError):
        pass

    def create_program(source: str, name: str, headers: tuple, include_names: tuple):
        calls.append(("nvrtcCreateProgram", name, len(source)))
        return {"source": source}

    def compile_program(prog, options):
        calls.append(("nvrtcCompileProgram", tuple(options)))

    nvrtc = types.SimpleNamespace(
        NVRTCError=NVRTCError,
        createProgram=create_program,
        compileProgram=compile_program,
        getCUBIN=lambda prog: b"\x7fELF cubin of " + str(len(prog["source"])).encode(),
        getProgramLog=lambda prog: "",
        destroyProgram=lambda prog: calls.append(("nvrtcDestroyProgram",)),
        getVersion=lambda: (13, 0),
    )

    class Module:
        def load(self, cubin: bytes) -> None:
            calls.append(("cuModuleLoadData", cubin[:4], current["device"]))

        def get_function(self, name: str):
            def launch(grid, block, args):
                calls.append(
                    ("launch", name, grid, block, args, current["device"], current["stream"])
                )

            return launch

    def call(name, result=None):
        def fn(*args):
            calls.append((name, *args, current["device"]))
            return result

        return fn

    pinned: list = []

    def host_alloc(size: int, flags: int) -> int:
        buf = ctypes.create_string_buffer(b"\xff" * size)
        pinned.append(buf)
        calls.append(("hostAlloc", size, flags, current["device"]))
        return ctypes.addressof(buf)

    def enable_peer(peer: int):
        calls.append(("deviceEnablePeerAccess", peer, current["device"]))
        if peer_status:
            raise CUDARuntimeError(peer_status)

    runtime = types.SimpleNamespace(
        CUDARuntimeError=CUDARuntimeError,
        getDeviceCount=lambda: devices,
        getDeviceProperties=lambda d: {"multiProcessorCount": 132},
        deviceGetAttribute=lambda attr, d: {75: 9, 76: 0}[attr],
        ipcOpenMemHandle=call("ipcOpenMemHandle", 0xD000),
        ipcCloseMemHandle=call("ipcCloseMemHandle"),
        ipcOpenEventHandle=call("ipcOpenEventHandle", 0xE000),
        eventDestroy=call("eventDestroy"),
        eventCreateWithFlags=call("eventCreateWithFlags", 0xE100),
        eventQuery=call("eventQuery", query_status),
        streamCreateWithFlags=call("streamCreateWithFlags", 0x5000),
        streamDestroy=call("streamDestroy"),
        streamWaitEvent=call("streamWaitEvent"),
        eventRecord=call("eventRecord"),
        streamSynchronize=call("streamSynchronize"),
        deviceCanAccessPeer=lambda d, p: 1,
        deviceEnablePeerAccess=enable_peer,
        memcpyAsync=call("memcpyAsync"),
        hostAlloc=host_alloc,
        freeHost=call("freeHost"),
    )
    driver_mod = types.SimpleNamespace(CUDADriverError=type("CUDADriverError", (RuntimeError,), {}))
    cuda = types.SimpleNamespace(
        runtime=runtime,
        driver=driver_mod,
        Device=Device,
        ExternalStream=ExternalStream,
        nvrtc=nvrtc,
        function=types.SimpleNamespace(Module=Module),
    )
    return types.SimpleNamespace(cuda=cuda, __version__="fake")


class FakeDriver:
    def device_uuid(self, ordinal: int) -> bytes:
        return bytes([ordinal]) * 16

    def pointer_info(self, ptr: int) -> cuda_driver.PointerInfo:
        return cuda_driver.PointerInfo(1, ptr - 4096, 1 << 20, 0, 2, True, 0)


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch, tmp_path):
    calls: list = []
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))

    def make(**kwargs):
        monkeypatch.setitem(sys.modules, "cupy", fake_cupy(calls, **kwargs))
        monkeypatch.setattr(cuda_driver, "driver", lambda: FakeDriver())
        from smddp.server.gpu_runtime import CupyRuntime

        return CupyRuntime(), calls

    return make


def test_ipc_handles_open_on_their_gpu_with_lazy_peer_access(runtime) -> None:
    rt, calls = runtime()
    assert rt.device_of(b"\1" * 16) == 1
    with pytest.raises(CudaCallError, match="no GPU with UUID GPU-07070707"):
        rt.device_of(b"\7" * 16)
    assert rt.open_memory(b"h" * 64, 1) == 0xD000
    assert calls[-1] == ("ipcOpenMemHandle", b"h" * 64, 1, 1)  # flag 1: lazy peer access, on GPU 1
    assert rt.open_event(b"e" * 64, 1) == 0xE000 and calls[-1][-1] == 1
    assert (
        rt.mapped_size(0x10000) == (1 << 20) - 4096
    )  # from the mapping's start to the allocation's end


def test_event_queries_read_the_returned_status(runtime) -> None:
    rt, _ = runtime(query_status=600)
    assert rt.event_done(0xE100, 0) is False
    rt, _ = runtime(query_status=0)
    assert rt.event_done(0xE100, 0) is True
    rt, _ = runtime(query_status=700)
    with pytest.raises(CudaCallError, match="700"):
        rt.event_done(0xE100, 0)


def test_peer_access_already_enabled_is_fine(runtime) -> None:
    rt, calls = runtime(peer_status=704)
    rt.enable_peer(0, 1)
    assert calls[-1] == ("deviceEnablePeerAccess", 1, 0)
    rt, _ = runtime(peer_status=217)
    with pytest.raises(CudaCallError, match="cudaDeviceEnablePeerAccess"):
        rt.enable_peer(0, 1)


def test_streams_events_and_copies(runtime) -> None:
    rt, calls = runtime()
    s = rt.new_stream(1)
    assert calls[-1] == ("streamCreateWithFlags", 1, 1)  # non-blocking, on GPU 1
    e = rt.new_event(1)
    assert calls[-1] == ("eventCreateWithFlags", 2, 1)  # timing disabled
    rt.wait_event(s, e, 1)
    rt.record_event(e, s, 1)
    rt.copy(s, 1, 0xA, 0xB, 64)
    assert calls[-3:] == [
        ("streamWaitEvent", s, e, 0, 1),
        ("eventRecord", e, s, 1),
        ("memcpyAsync", 0xA, 0xB, 64, 4, s, 1),  # cudaMemcpyDefault
    ]
    assert rt.max_grid(0) == 132 * 8


def test_a_launch_passes_addresses_at_its_start_and_runs_on_the_stream(runtime) -> None:
    rt, calls = runtime()
    launch = gpu_kernels.Launch(start=1000, count=4096, vectorized=True, units=512, grid=2)
    rt.reduce(0x5000, 1, pb.FLOAT32, pb.SUM, [0x1000, 0x9000], [0x1000], launch)
    (compiled,) = [c for c in calls if c[0] == "nvrtcCompileProgram"]
    assert compiled[1] == ("--std=c++14", "-arch=sm_90")  # the device's architecture
    assert [c for c in calls if c[0] == "cuModuleLoadData"] == [("cuModuleLoadData", b"\x7fELF", 1)]
    (_, name, grid, block, args, device, stream) = [c for c in calls if c[0] == "launch"][0]
    assert name == gpu_kernels.kernel_name(pb.FLOAT32, pb.SUM, 2, 1, True)
    assert (grid, block, device, stream) == ((2,), (gpu_kernels.BLOCK_THREADS,), 1, 0x5000)
    assert all(isinstance(a, np.uint64) for a in args)
    assert [int(a) for a in args] == [0x1000 + 4000, 0x9000 + 4000, 0x1000 + 4000, 512]
    rt.reduce(0x5000, 1, pb.FLOAT32, pb.SUM, [0x1000, 0x9000], [0x1000], launch)
    assert len([c for c in calls if c[0] == "nvrtcCompileProgram"]) == 1  # compiled once


def test_one_module_per_device_and_one_compile_per_architecture(runtime) -> None:
    """A module's functions belong to one device's context: GPU 0 gets a module of its own,
    loaded there, from the cubin already compiled for the same architecture."""
    rt, calls = runtime()
    launch = gpu_kernels.Launch(start=0, count=64, vectorized=False, units=64, grid=1)
    rt.reduce(0x5000, 1, pb.FLOAT32, pb.SUM, [0x1000, 0x9000], [0x1000], launch)
    rt.reduce(0x5000, 0, pb.FLOAT32, pb.SUM, [0x1000, 0x9000], [0x1000], launch)
    assert [c[2] for c in calls if c[0] == "cuModuleLoadData"] == [1, 0]
    assert len([c for c in calls if c[0] == "nvrtcCompileProgram"]) == 1
    launches = [c for c in calls if c[0] == "launch"]
    assert [c[5] for c in launches] == [1, 0]  # each launched with its own device current


def test_a_compiled_module_is_reused_from_the_disk_cache(runtime) -> None:
    """What gpu_check.sh warms (or an earlier daemon compiled) is not compiled again."""
    rt, calls = runtime()
    rt.warm(0, [(pb.BFLOAT16, pb.SUM, 4, 4)])
    assert len([c for c in calls if c[0] == "nvrtcCompileProgram"]) == 1
    before = len(calls)
    rt2, _ = runtime()  # another daemon process, the same cache folder
    rt2.warm(0, [(pb.BFLOAT16, pb.SUM, 4, 4)])
    assert not [c for c in calls[before:] if c[0] == "nvrtcCompileProgram"]
    assert [c for c in calls[before:] if c[0] == "cuModuleLoadData"]


def test_a_compile_error_names_the_kernel_and_nvrtcs_log(runtime) -> None:
    rt, calls = runtime()
    nvrtc = sys.modules["cupy"].cuda.nvrtc

    def refuse(prog, options):
        raise nvrtc.NVRTCError("NVRTC_ERROR_COMPILATION (6)")

    nvrtc.compileProgram = refuse
    nvrtc.getProgramLog = lambda prog: "error: identifier h2f is undefined"
    with pytest.raises(
        CudaCallError,
        match=r"NVRTC cannot compile smddp_reduce_float16_SUM_2x2.cu for sm_90: "
        r"NVRTC_ERROR_COMPILATION \(6\)\nerror: identifier h2f",
    ):
        rt.prepare(0, (pb.FLOAT16, pb.SUM, 2, 2))
    assert calls[-1] == ("nvrtcDestroyProgram",)


def test_a_flag_is_mapped_host_memory_the_stream_waits_on(runtime) -> None:
    """The abortable wait: a zeroed word of pinned, mapped, portable host memory; the host
    writes it; the stream waits with cuStreamWaitValue32 GEQ on its (unified) address."""
    rt, calls = runtime()
    waits: list = []

    def wait_value32(stream, address, value, flags):
        waits.append((stream, address, value, flags, ctypes.c_uint32.from_address(address).value))
        return 0

    rt._wait_value = wait_value32
    flag = rt.new_flag(1)
    assert calls[-1][0] == "hostAlloc" and calls[-1][1:] == (4, 3, 1)
    rt.wait_flag(0x5000, flag, 7, 1)
    rt.set_flag(flag, (1 << 32) + 9)  # tickets wrap around at 32 bits
    assert ctypes.c_uint32.from_address(flag).value == 9
    assert waits == [(0x5000, flag, 7, 0, 0)]
    rt._wait_value = lambda *args: 1
    with pytest.raises(CudaCallError, match="cuStreamWaitValue32: CUDA error 1"):
        rt.wait_flag(0x5000, flag, 8, 1)
    rt.destroy_flag(flag)
    assert calls[-1][:2] == ("freeHost", flag)


def test_the_daemons_runtime_warms_the_common_kernels_on_every_gpu(monkeypatch, tmp_path) -> None:
    calls: list = []
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(calls))
    monkeypatch.setattr(cuda_driver, "driver", lambda: FakeDriver())
    from smddp.server.gpu_runtime import COMMON_KERNELS, CupyRuntime

    rt = CupyRuntime(warm=True)
    deadline = time.monotonic() + 30
    while len(rt._modules) < 2 * len(COMMON_KERNELS):
        assert time.monotonic() < deadline, rt._modules.keys()
        time.sleep(0.01)
    assert {d for _, d in rt._modules} == {0, 1}
    # One compile per module and architecture, one load per GPU.
    assert len([c for c in calls if c[0] == "nvrtcCompileProgram"]) == len(COMMON_KERNELS)


def test_prepared_cubins_are_read_before_anything_is_compiled(
    runtime, monkeypatch, tmp_path
) -> None:
    """SMDDP_KERNEL_CACHE names a folder of prepared archives (benchmarks/gpu_kernel_cache.py):
    a module found there is loaded as it is, never compiled; one missing is compiled, and
    ``warm`` compiles what is missing in parallel threads, one compile per module."""
    import threading
    import zipfile

    from smddp.server.gpu_runtime import archive_name, prepared_entry

    have = [(pb.FLOAT32, pb.SUM, 2, 2), (pb.BFLOAT16, pb.MAX, 3, 1)]
    with zipfile.ZipFile(tmp_path / archive_name("sm_90", 13), "w") as z:
        for key in have:
            z.writestr(prepared_entry(key, "sm_90"), b"\x7fELF prepared " + repr(key).encode())
    monkeypatch.setenv("SMDDP_KERNEL_CACHE", str(tmp_path))
    rt, calls = runtime()
    rt.warm(0, have)
    assert not [c for c in calls if c[0] == "nvrtcCompileProgram"]
    assert len([c for c in calls if c[0] == "cuModuleLoadData"]) == 2
    assert rt.sources == {"prepared": 2, "disk": 0, "compiled": 0}

    nvrtc = sys.modules["cupy"].cuda.nvrtc
    compile_threads: set[str] = set()
    barrier = threading.Barrier(3, timeout=10)
    plain = nvrtc.compileProgram

    def compile_program(prog, options):
        compile_threads.add(threading.current_thread().name)
        barrier.wait()  # only met when three compiles run at once
        plain(prog, options)

    nvrtc.compileProgram = compile_program
    missing = [(pb.INT32, pb.BXOR, 4, 4), (pb.FLOAT16, pb.SUM, 8, 8), (pb.INT8, pb.MIN, 2, 1)]
    rt.warm(0, [*have, *missing])
    assert len([c for c in calls if c[0] == "nvrtcCompileProgram"]) == 3
    assert len(compile_threads) == 3, compile_threads
    assert rt.sources == {"prepared": 2, "disk": 0, "compiled": 3}
    assert len(rt._modules) == 5
