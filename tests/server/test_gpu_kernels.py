"""The generated CUDA reduction kernels, checked without a GPU.

For every dtype x reduce op x fan-in the generated source must be well formed, read its
inputs in rank order, and compute exactly the host path's bits (``smddp.core.reduce``, numpy):

- by evaluating the generated C text with a small interpreter of its C subset
  (``c_subset``), for both the scalar and the vectorised kernel;
- by compiling the very same source as host C++ with g++ (CUDA keywords defined away, one
  "thread" looping over every element) and running it on the same data, where g++ exists.

Launch geometry (segments, chunks, vector alignment) is checked here too.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import c_subset

from smddp.core.reduce import reduce_into
from smddp.core.wire import REDUCE_NAMES, dtype_name, numpy_dtype, reduce_op_check, wire_dtype
from smddp.server import gpu_kernels
from smddp.v1 import smddp_pb2 as pb

DTYPES = list(gpu_kernels.SPECS)
COMBOS = [(d, op) for d in DTYPES for op in REDUCE_NAMES if reduce_op_check(d, op) is None]
# (35, 2): past the pass size, three passes (the last one partial) carry the accumulator.
FANS = [
    (1, 1),
    (2, 2),
    (3, 1),
    (4, 3),
    (5, 5),
    (8, 1),
    (8, 8),
    (2 * gpu_kernels.PASS_FAN_IN + 3, 2),
]
N = 4096

# numpy storage views of each dtype's element bits.
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def sample(dtype: int, n: int, seed: int) -> np.ndarray:
    """Values that exercise rounding, overflow, wrap-around and NaN/inf handling."""
    rng = np.random.default_rng(seed)
    np_dtype = numpy_dtype(dtype)
    if dtype == pb.BOOL:
        return rng.integers(0, 2, n).astype(np.bool_)
    if np_dtype.kind in "iu":
        info = np.iinfo(np_dtype)
        return rng.integers(info.min, info.max, n, endpoint=True, dtype=np_dtype)
    values = rng.standard_normal(n) * rng.choice([1e-3, 1.0, 300.0, 3e4], n)
    specials = np.array(
        [np.nan, np.inf, -np.inf, 65000.0, -65000.0, 1e-7, 3.0e38], dtype=np.float64
    )
    idx = rng.choice(n, n // 20, replace=False)
    values[idx] = specials[rng.integers(0, len(specials), len(idx))]
    with np.errstate(over="ignore"):  # 3e38 is inf in float16 and bfloat16: wanted
        return values.astype(np.float32).astype(np_dtype)


def storage(x: np.ndarray) -> np.ndarray:
    """The element bits as the kernels' storage type sees them."""
    spec = gpu_kernels.SPECS[wire_dtype(x.dtype)]
    return x.view(c_subset.CTYPES[spec.storage])


def reference(dtype: int, op: int, inputs: list[np.ndarray]) -> np.ndarray:
    out = np.empty_like(inputs[0])
    reduce_into([out], inputs, op)
    return out


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Bitwise equality, except that any NaN matches any NaN (payloads are not specified)."""
    g = got.view(_BITS[got.dtype.itemsize])
    w = want.view(_BITS[want.dtype.itemsize])
    differ = g != w
    if want.dtype.kind == "f" or want.dtype == ml_dtypes.bfloat16:
        gf = got.astype(np.float64)
        wf = want.astype(np.float64)
        differ &= ~(np.isnan(gf) & np.isnan(wf))
    if differ.any():
        i = int(np.flatnonzero(differ)[0])
        raise AssertionError(
            f"{what}: {int(differ.sum())} elements differ from the host path, first at {i}: "
            f"kernel {got[i]!r} (bits {g[i]:#x}) vs host {want[i]!r} (bits {w[i]:#x})"
        )


# -- the source is well formed --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "op"), COMBOS, ids=[f"{dtype_name(d)}-{REDUCE_NAMES[o]}" for d, o in COMBOS]
)
def test_source_is_well_formed(dtype: int, op: int) -> None:
    for fan_in, fan_out in FANS:
        src = gpu_kernels.reduce_module(dtype, op, fan_in, fan_out)
        assert "#include" not in src  # NVRTC finds no toolkit headers by default
        for opening, closing in ("{}", "()", "[]"):
            assert src.count(opening) == src.count(closing), f"unbalanced {opening}{closing}"
        for vectorized in (False, True):
            name = gpu_kernels.kernel_name(dtype, op, fan_in, fan_out, vectorized)
            m = re.search(rf'extern "C" __global__ void {name}\(([^)]*)\)', src)
            assert m, f"kernel {name} missing"
            params = [p.strip() for p in m.group(1).split(",")]
            assert params == [f"const unsigned long long in{r}" for r in range(fan_in)] + [
                f"const unsigned long long out{o}" for o in range(fan_out)
            ] + ["const unsigned long long n"]
        # The compute and storage types are the spec's.
        spec = gpu_kernels.SPECS[dtype]
        assert f"typedef {spec.storage} T;" in src and f"typedef {spec.compute} C;" in src


def test_invalid_combinations_are_refused() -> None:
    with pytest.raises(ValueError, match="BXOR is only defined for integer"):
        gpu_kernels.reduce_module(pb.FLOAT32, pb.BXOR, 2, 1)
    with pytest.raises(ValueError, match="AVG is only defined for floating-point"):
        gpu_kernels.combine_expr(pb.INT32, pb.AVG)
    with pytest.raises(ValueError, match="fan-in"):
        gpu_kernels.reduce_module(pb.FLOAT32, pb.SUM, 0, 1)


def test_kernel_names_are_unique() -> None:
    names = {
        gpu_kernels.kernel_name(d, op, i, o, v)
        for d, op in COMBOS
        for i, o in FANS
        for v in (False, True)
    }
    assert len(names) == len(COMBOS) * len(FANS) * 2


# -- the C text computes the host path's bits, in rank order --------------------------------------


@pytest.mark.parametrize(
    ("dtype", "op"), COMBOS, ids=[f"{dtype_name(d)}-{REDUCE_NAMES[o]}" for d, o in COMBOS]
)
def test_interpreted_kernels_match_host_path(dtype: int, op: int) -> None:
    for fan_in, fan_out in FANS:
        src = gpu_kernels.reduce_module(dtype, op, fan_in, fan_out)
        program = c_subset.load_program(src)
        bodies = c_subset.kernel_bodies(src)
        assert set(bodies) == {
            gpu_kernels.kernel_name(dtype, op, fan_in, fan_out, v) for v in (False, True)
        }
        scalar, vector = (
            bodies[gpu_kernels.kernel_name(dtype, op, fan_in, fan_out, v)] for v in (False, True)
        )
        # Both kernels do the same per element.
        assert scalar == vector
        # Inputs are read once each, in rank order; every output gets the result.
        reads = [int(m) for line in scalar for m in re.findall(r"\bin(\d+)\b", line)]
        assert reads == list(range(fan_in))
        writes = [line for line in scalar if line.startswith("out")]
        assert writes == [f"out{o} = r;" for o in range(fan_out)]
        inputs = [sample(dtype, N, seed=100 * fan_in + r) for r in range(fan_in)]
        outs = c_subset.run_body(program, scalar, [storage(x) for x in inputs])
        want = reference(dtype, op, inputs)
        for o in range(fan_out):
            got = outs[f"out{o}"].view(want.dtype)
            assert_same_bits(
                got, want, f"{dtype_name(dtype)} {REDUCE_NAMES[op]} {fan_in}x{fan_out} out{o}"
            )


def test_large_fan_ins_read_their_inputs_in_bounded_passes() -> None:
    """Past PASS_FAN_IN a kernel loads one pass's inputs, combines them, and only then (after
    a compiler barrier) loads the next pass's, carrying the accumulator in ``r``."""
    fan_in = 2 * gpu_kernels.PASS_FAN_IN + 3
    src = gpu_kernels.reduce_module(pb.FLOAT16, pb.SUM, fan_in, 1)
    vector = src[src.index("_v16(") :]
    assert vector.count(gpu_kernels.PASS_BARRIER) == 2
    passes = vector.split(gpu_kernels.PASS_BARRIER)
    for p, text in enumerate(passes):
        loads = [int(m) for m in re.findall(r"const Vec v(\d+) = ", text)]
        lo = p * gpu_kernels.PASS_FAN_IN
        assert loads == list(range(lo, min(fan_in, lo + gpu_kernels.PASS_FAN_IN)))
        if p:
            assert "C acc = load(r.e[k]);" in text
    # Up to the pass size a kernel is one pass, as before.
    assert gpu_kernels.PASS_BARRIER not in gpu_kernels.reduce_module(
        pb.FLOAT16, pb.SUM, gpu_kernels.PASS_FAN_IN, 1
    )


def test_the_comparison_detects_a_different_order() -> None:
    """The data above tells rank orders apart: reversed inputs give other float16 bits."""
    inputs = [sample(pb.FLOAT16, N, seed=300 + r) for r in range(3)]
    forward = reference(pb.FLOAT16, pb.SUM, inputs)
    backward = reference(pb.FLOAT16, pb.SUM, inputs[::-1])
    with pytest.raises(AssertionError, match="differ from the host path"):
        assert_same_bits(backward, forward, "reversed")


def test_interpreter_follows_c_conversions() -> None:
    program = c_subset.Program({"C": "int", "T": "signed char"}, {})
    env = {"a": np.array([2**31 - 1], dtype=np.int32), "b": np.array([1], dtype=np.int32)}
    # int32 + through unsigned wraps to INT_MIN; a cast to signed char keeps the low byte.
    assert program.eval(program.parse("(int)((unsigned int)a + (unsigned int)b)"), env)[0] == -(
        2**31
    )
    assert program.eval(program.parse("(signed char)(a)"), env)[0] == -1
    assert program.eval(program.parse("a <= b ? a : b"), env)[0] == 1
    assert c_subset.common(np.dtype(np.int64), np.dtype(np.uint32)) == np.int64
    assert c_subset.common(np.dtype(np.int32), np.dtype(np.uint32)) == np.uint32


# -- the same source compiled as host C++ --------------------------------------------------------

_HOST_PRELUDE = r"""
#include <cstring>
#define __device__
#define __global__
#define __forceinline__ inline
// The launch geometry a "thread" sees: set by smddp_geometry before each call, so a call runs
// one thread's grid-stride loop, and the test calls every thread of a several-block grid.
struct smddp_dim3 { unsigned int x; };
static smddp_dim3 blockIdx = {0}, threadIdx = {0}, blockDim = {1}, gridDim = {1};
extern "C" void smddp_geometry(unsigned int grid, unsigned int block, unsigned int b, unsigned int t) {
  gridDim.x = grid; blockDim.x = block; blockIdx.x = b; threadIdx.x = t;
}
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
// The PTX half conversions (cvt.f32.f16, cvt.rn.f16.f32), in host terms: both round to
// nearest even. The PTX itself is checked by nvcc/ptxas (test_nvcc_compiles_every_module).
static inline float h2f(unsigned short h) { _Float16 v; std::memcpy(&v, &h, 2); return (float)v; }
static inline unsigned short f2h(float f) { _Float16 v = (_Float16)f; unsigned short h; std::memcpy(&h, &v, 2); return h; }
"""
# Several blocks of several threads, neither dividing the element count: the grid-stride
# loops run more than once per thread, with a partial last round.
GRID, BLOCK = 3, 5


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip(
            "g++ is not installed: the generated kernels are only checked by the interpreter"
        )
    parts = [
        _HOST_PRELUDE,
        gpu_kernels.BFLOAT16_CONVERSIONS.replace("__device__ __forceinline__", "static inline"),
    ]
    lead = gpu_kernels.HEADER + gpu_kernels.HALF_CONVERSIONS + gpu_kernels.BFLOAT16_CONVERSIONS
    for k, (dtype, op) in enumerate(COMBOS):
        for fan_in, fan_out in FANS:
            src = gpu_kernels.reduce_module(dtype, op, fan_in, fan_out)
            assert src.startswith(lead)
            parts.append(f"namespace m{k}_{fan_in}_{fan_out} {{\n{src[len(lead) :]}}}\n")
    folder = tmp_path_factory.mktemp("kernels")
    (folder / "kernels.cpp").write_text("".join(parts))
    result = subprocess.run(
        [
            compiler,
            "-std=c++14",
            "-O1",
            "-fno-strict-aliasing",
            "-w",
            "-shared",
            "-fPIC",
            "-o",
            str(folder / "kernels.so"),
            str(folder / "kernels.cpp"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, (
        f"the generated kernels do not compile as C++:\n{result.stderr[-4000:]}"
    )
    return ctypes.CDLL(str(folder / "kernels.so"))


def _aligned_copy(x: np.ndarray) -> np.ndarray:
    raw = np.empty(x.nbytes + 16, dtype=np.uint8)
    start = -raw.ctypes.data % 16
    out = raw[start : start + x.nbytes].view(x.dtype)
    out[...] = x
    return out


def _launch(lib: ctypes.CDLL, fn, args: list[int]) -> None:
    """Runs every thread of a GRID x BLOCK launch of ``fn`` (one call per thread)."""
    for b in range(GRID):
        for t in range(BLOCK):
            lib.smddp_geometry(GRID, BLOCK, b, t)
            fn(*args)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("dtype", "op"), COMBOS, ids=[f"{dtype_name(d)}-{REDUCE_NAMES[o]}" for d, o in COMBOS]
)
def test_compiled_kernels_match_host_path(host_kernels: ctypes.CDLL, dtype: int, op: int) -> None:
    per_vector = gpu_kernels.VECTOR_BYTES // gpu_kernels.SPECS[dtype].itemsize
    host_kernels.smddp_geometry.argtypes = [ctypes.c_uint] * 4
    for fan_in, fan_out in FANS:
        inputs = [
            _aligned_copy(sample(dtype, N, seed=500 + 10 * fan_in + r)) for r in range(fan_in)
        ]
        want = reference(dtype, op, inputs)
        for vectorized in (False, True):
            name = gpu_kernels.kernel_name(dtype, op, fan_in, fan_out, vectorized)
            fn = getattr(host_kernels, name)
            fn.argtypes = [ctypes.c_ulonglong] * (fan_in + fan_out + 1)
            fn.restype = None
            # Outputs start as a pattern no reduction leaves everywhere: an element no thread
            # wrote shows up as a difference.
            outs = [_aligned_copy(np.empty_like(want)) for _ in range(fan_out)]
            for o in outs:
                o.view(np.uint8)[...] = 0xA5
            units = N // per_vector if vectorized else N
            _launch(
                host_kernels,
                fn,
                [*[x.ctypes.data for x in inputs], *[o.ctypes.data for o in outs], units],
            )
            for o, got in enumerate(outs):
                assert_same_bits(got, want, f"{name} out{o}")
        # In place: output 0 is input 0's memory.
        inplace = [x.copy() for x in inputs]
        fn = getattr(host_kernels, gpu_kernels.kernel_name(dtype, op, fan_in, fan_out, False))
        extra = [_aligned_copy(np.zeros_like(want)) for _ in range(fan_out - 1)]
        _launch(
            host_kernels,
            fn,
            [
                *[x.ctypes.data for x in inplace],
                inplace[0].ctypes.data,
                *[o.ctypes.data for o in extra],
                N,
            ],
        )
        assert_same_bits(inplace[0], want, f"{dtype_name(dtype)} {REDUCE_NAMES[op]} in place")


def test_a_thread_covers_only_its_grid_stride_share(host_kernels: ctypes.CDLL) -> None:
    """One thread of the launch writes elements t, t + stride, ...: the others stay as they
    were (so the test above really depends on every thread of every block)."""
    name = gpu_kernels.kernel_name(pb.FLOAT32, pb.SUM, 3, 1, False)
    fn = getattr(host_kernels, name)
    fn.argtypes = [ctypes.c_ulonglong] * 5
    host_kernels.smddp_geometry.argtypes = [ctypes.c_uint] * 4
    a, b = np.arange(100, dtype=np.float32), np.ones(100, dtype=np.float32)
    out = np.full(100, -1.0, dtype=np.float32)
    host_kernels.smddp_geometry(GRID, BLOCK, 1, 2)  # block 1, thread 2: element 7, 22, ...
    fn(a.ctypes.data, b.ctypes.data, b.ctypes.data, out.ctypes.data, 100)
    mine = np.arange(1 * BLOCK + 2, 100, GRID * BLOCK)
    assert np.array_equal(np.flatnonzero(out != -1.0), mine)
    assert np.array_equal(out[mine], a[mine] + 2)


# -- launch geometry ----------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 7, 15, 16, 17, 1000, 4099])
@pytest.mark.parametrize("parts", [1, 2, 3, 8])
@pytest.mark.parametrize("align", [1, 2, 8, 16])
def test_split_covers_in_order_on_aligned_boundaries(n: int, parts: int, align: int) -> None:
    ranges = gpu_kernels.split(n, parts, align)
    assert len(ranges) == parts
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    for (a, b), (c, _) in zip(ranges, ranges[1:]):
        assert a <= b == c
        assert b % align == 0 or b == n


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 100, 4096, 10_000_019])
def test_chunks_bound_each_launch(itemsize: int, n: int) -> None:
    chunk_bytes = 1 << 20
    ranges = gpu_kernels.chunks(n, itemsize, chunk_bytes)
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    for (_, b), (c, _) in zip(ranges, ranges[1:]):
        assert b == c
    for a, b in ranges:
        assert (b - a) * itemsize <= chunk_bytes
        assert a % (16 // itemsize) == 0  # every chunk starts on a vector boundary


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("misalign", [0, 0, 2, 4, 8, 12])
@pytest.mark.parametrize(("start", "stop"), [(0, 0), (0, 1), (0, 1000), (3, 997), (16, 1 << 20)])
def test_plan_launches_vectorises_only_aligned_spans(
    itemsize: int, misalign: int, start: int, stop: int
) -> None:
    base = 0x7F0000000000
    addresses = [base, base + 4096, base + 8192 + (misalign // itemsize) * itemsize]
    launches = gpu_kernels.plan_launches(start, stop, itemsize, addresses, max_grid=1000)
    covered = [(x.start, x.start + x.count) for x in launches]
    assert sum(b - a for a, b in covered) == stop - start
    pos = start
    for (a, b), launch in zip(covered, launches):
        assert a == pos and b > a
        pos = b
        assert 1 <= launch.grid <= 1000
        if launch.vectorized:
            per = 16 // itemsize
            assert launch.count % per == 0 and launch.units == launch.count // per
            assert all((addr + a * itemsize) % 16 == 0 for addr in addresses)
        else:
            assert launch.units == launch.count
    aligned = len({(a + start * itemsize) % 16 for a in addresses}) == 1 and itemsize < 16
    if stop - start >= 64 and aligned:
        assert any(x.vectorized for x in launches), (
            "an aligned span of 64 elements should vectorise"
        )
    if not aligned:
        assert not any(x.vectorized for x in launches)
