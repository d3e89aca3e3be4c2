"""The generated CUDA modules compiled for real GPUs, without one: by nvcc (the toolkit's
compiler) to PTX and to cubins for sm_80 (A100) and sm_90 (H100/H200), and by NVRTC through
CuPy exactly as the daemon compiles them (``gpu_runtime.compile_module``).

Every dtype x reduce op the daemon accepts is compiled by nvcc at the fan-ins/fan-outs of
``NVCC_FANS`` (one rank's copy, reduce/reduce_scatter's 3x1, the all_reduce shape 8x8) and,
for float16 (the PTX conversions) and int8, at the largest fan-in, 128 (the kernel
parameter space is the limit there); by NVRTC at ``NVRTC_FANS`` for sm_90 and the widest
float16 module for both architectures. Other fan-ins differ from these only in the number of
identical per-rank lines. Not every one of the 1..128 fan-ins is compiled: nvcc took over 4
minutes per dtype for that on this machine kind, and CI's budget is shared.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from smddp.core.wire import REDUCE_NAMES, dtype_name, reduce_op_check
from smddp.server import gpu_kernels
from smddp.v1 import smddp_pb2 as pb

DTYPES = list(gpu_kernels.SPECS)
COMBOS = [(d, op) for d in DTYPES for op in REDUCE_NAMES if reduce_op_check(d, op) is None]
NVCC_FANS = [(1, 1), (3, 1), (8, 8)]
NVRTC_FANS = [(2, 2), (8, 1)]
WIDEST = gpu_kernels.MAX_FAN_IN
ARCHS = ("sm_80", "sm_90")
LEAD = gpu_kernels.HEADER + gpu_kernels.HALF_CONVERSIONS + gpu_kernels.BFLOAT16_CONVERSIONS


def modules(dtype: int, fans: list[tuple[int, int]] = NVCC_FANS) -> list[tuple[int, int, int]]:
    """(op, fan-in, fan-out) of the modules nvcc compiles for ``dtype``."""
    ops = [op for d, op in COMBOS if d == dtype]
    wide = [(ops[0], WIDEST, WIDEST), (ops[0], WIDEST, 1)] if dtype in (pb.FLOAT16, pb.INT8) else []
    return [(op, i, o) for op in ops for i, o in fans] + wide


def translation_unit(dtype: int) -> str:
    """Every module of ``dtype`` in one file: each in a namespace of its own (they all
    define T, C, load, store...), the kernels' extern "C" names unique across them."""
    parts = [LEAD]
    for op, fan_in, fan_out in modules(dtype):
        src = gpu_kernels.reduce_module(dtype, op, fan_in, fan_out)
        assert src.startswith(LEAD)
        parts.append(f"namespace m_{op}_{fan_in}_{fan_out} {{\n{src[len(LEAD) :]}}}\n")
    return "".join(parts)


def _nvcc(folder: Path, dtype: int) -> tuple[int, str, str, str]:
    name = dtype_name(dtype)
    cu = folder / f"{name}.cu"
    cu.write_text(translation_unit(dtype))
    # One nvcc run per dtype: cubins for both architectures and sm_90's PTX in one fatbin.
    gencode = [
        "-gencode",
        "arch=compute_80,code=sm_80",
        "-gencode",
        "arch=compute_90,code=[sm_90,compute_90]",
    ]
    done = subprocess.run(
        ["nvcc", "--std=c++14", "-fatbin", *gencode, "-o", str(folder / f"{name}.fatbin"), str(cu)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    return done.returncode, done.stderr[-3000:], name, str(folder / f"{name}.fatbin")


@pytest.fixture(scope="module")
def nvcc_results(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, str, str, str]]:
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc (the CUDA toolkit) is not installed here")
    folder = tmp_path_factory.mktemp("nvcc")
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return list(pool.map(lambda d: _nvcc(folder, d), DTYPES))


@pytest.mark.timeout(1200)
def test_nvcc_compiles_every_module_for_sm80_and_sm90(nvcc_results) -> None:
    failed = [f"{name}:\n{err}" for rc, err, name, _ in nvcc_results if rc != 0]
    assert not failed, "nvcc refused generated modules:\n" + "\n".join(failed)
    for _rc, _, name, fatbin in nvcc_results:
        data = Path(fatbin).read_bytes()
        # Every kernel's symbol is in the fatbin (its cubins' symbol tables).
        dtype = next(d for d in DTYPES if dtype_name(d) == name)
        for op, fan_in, fan_out in modules(dtype):
            for vectorized in (False, True):
                symbol = gpu_kernels.kernel_name(dtype, op, fan_in, fan_out, vectorized)
                assert symbol.encode() in data, f"{symbol} missing from {fatbin}"


@pytest.mark.timeout(600)
def test_the_widest_kernels_keep_to_registers(tmp_path: Path) -> None:
    """ptxas reports no spill to local memory for the widest fan-ins (float16 at 64 x 64
    spilled 376 bytes per thread in 255 registers before the kernels read their inputs in
    passes of PASS_FAN_IN; float64 holds the most compute state per vector)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc (the CUDA toolkit) is not installed here")
    parts = [LEAD]
    mods = [
        (pb.FLOAT16, pb.SUM, 64, 64),
        (pb.FLOAT16, pb.SUM, WIDEST, WIDEST),
        (pb.FLOAT64, pb.MAX, WIDEST, 1),
        (pb.INT8, pb.SUM, WIDEST, 1),
    ]
    for dtype, op, fan_in, fan_out in mods:
        src = gpu_kernels.reduce_module(dtype, op, fan_in, fan_out)
        parts.append(f"namespace m_{dtype}_{fan_in}_{fan_out} {{\n{src[len(LEAD) :]}}}\n")
    cu = tmp_path / "wide.cu"
    cu.write_text("".join(parts))
    done = subprocess.run(
        [
            "nvcc",
            "--std=c++14",
            "-cubin",
            "-arch=sm_90",
            "-Xptxas",
            "-v",
            "-o",
            str(tmp_path / "wide.cubin"),
            str(cu),
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = done.stderr + done.stdout
    # Per kernel: "Compiling entry function 'NAME' ..." then "N bytes spill stores, ...".
    spills = dict(
        re.findall(
            r"Compiling entry function '(\w+)'.*?\n.*?(\d+) bytes spill stores", report, re.S
        )
    )
    names = [gpu_kernels.kernel_name(d, op, i, o, v) for d, op, i, o in mods for v in (False, True)]
    assert set(spills) == set(names), report[-3000:]
    assert all(spills[n] == "0" for n in names), {n: spills[n] for n in names}


@pytest.mark.timeout(300)
def test_the_half_conversions_are_the_ptx_cvt_instructions(tmp_path: Path) -> None:
    """The float16 module's PTX converts with cvt (round to nearest even on the way down):
    what the host-run check substitutes with _Float16 is really what runs on the GPU."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc (the CUDA toolkit) is not installed here")
    cu = tmp_path / "half.cu"
    cu.write_text(gpu_kernels.reduce_module(pb.FLOAT16, pb.SUM, 3, 1))
    subprocess.run(
        ["nvcc", "--std=c++14", "-ptx", "-arch=sm_90", "-o", str(tmp_path / "half.ptx"), str(cu)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    ptx = (tmp_path / "half.ptx").read_text()
    assert re.search(r"cvt\.f32\.f16\s", ptx) and re.search(r"cvt\.rn\.f16\.f32\s", ptx)
    # 64-bit indices: the grid-stride loop compares and steps in 64 bits.
    assert re.search(r"setp\.(ge|lt|le|gt)\.u64", ptx)


# -- NVRTC, as the daemon calls it ------------------------------------------------------------


def _cupy():
    try:
        import cupy
    except ImportError as exc:
        pytest.skip(f"CuPy does not import here ({exc})")
    try:
        cupy.cuda.nvrtc.getVersion()
    except Exception as exc:
        pytest.skip(f"CuPy's NVRTC is not usable here ({exc})")
    return cupy


@pytest.mark.timeout(1200)
def test_nvrtc_compiles_every_dtype_and_op_as_the_daemon_does() -> None:
    from smddp.server.gpu_runtime import compile_module

    cupy = _cupy()
    jobs = [("sm_90", d, op, i, o) for d, op in COMBOS for i, o in NVRTC_FANS] + [
        (arch, pb.FLOAT16, pb.SUM, WIDEST, WIDEST) for arch in ARCHS
    ]

    def one(job: tuple) -> tuple[tuple, bytes | str]:
        arch, *key = job
        try:
            return job, compile_module(cupy, *key, arch=arch)
        except Exception as exc:
            return job, f"{type(exc).__name__}: {exc}"

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(one, jobs))
    failed = [(job, r) for job, r in results if isinstance(r, str)]
    assert not failed, f"NVRTC refused {len(failed)} modules, e.g. {failed[0]}"
    for (_, dtype, op, i, o), cubin in results:
        assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF"
        for vectorized in (False, True):
            assert gpu_kernels.kernel_name(dtype, op, i, o, vectorized).encode() in cubin


def test_nvrtc_reports_what_it_refused() -> None:
    """A module NVRTC cannot compile fails with its log (here: an architecture it lacks)."""
    from smddp.server.gpu import CudaCallError
    from smddp.server.gpu_runtime import compile_module

    cupy = _cupy()
    with pytest.raises(
        CudaCallError, match=r"NVRTC cannot compile smddp_reduce_float32_SUM_2x2\.cu for sm_1:"
    ):
        compile_module(cupy, pb.FLOAT32, pb.SUM, 2, 2, arch="sm_1")
