"""CUDA C source of the daemon's reduction kernels, one per dtype, reduce op and fan-in.

Pure text generation, no CuPy: the daemon compiles what ``reduce_module`` returns (NVRTC
through CuPy, see ``server/gpu.py``) and tests check it on machines without a GPU.

The kernels produce exactly the bits of the host path (``smddp.core.reduce.reduce_into``, numpy):

- the order is fixed by rank, ``((x0 op x1) op x2) ...``, one thread per element;
- every step is rounded to the element type, as numpy computes float16 and bfloat16 in
  float32 and rounds after each ufunc call (float32 is wide enough that this double rounding
  is exact for + - * /), and integers wrap around after each step;
- MIN/MAX propagate NaN the way numpy's minimum/maximum do (a NaN operand wins, the first
  one when both are);
- bool reduces logically (SUM/MAX/BOR or, PRODUCT/MIN/BAND and, BXOR xor);
- AVG divides the rounded sum by the world size converted to the element type.

Each dtype is described by three C expressions (``load`` from storage to the compute type,
``store`` back, and ``combine`` of two compute values ``a`` and ``b``) written in a small C
subset: identifiers, integer literals, casts to the scalar types below, the operators
``+ - * / & | ^ < <= > >= == != && || !`` and ``?:``, and the conversion helpers ``h2f``,
``f2h``, ``bf2f`` and ``f2bf`` of the preamble. ``tests/server/test_gpu_kernels.py``
evaluates exactly these strings with numpy and compares them with the host path.

No header is included (NVRTC finds none of the toolkit's by default): half conversions are
the PTX ``cvt`` instructions, bfloat16 ones are bit manipulation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from smddp.core.wire import REDUCE_NAMES, dtype_name, reduce_op_check
from smddp.v1 import smddp_pb2 as pb

# One vectorised access: 16 bytes per input per thread.
VECTOR_BYTES = 16
# Threads per block of every launch.
BLOCK_THREADS = 256
# Largest fan-in (ranks whose buffers one kernel reads): CUDA kernel parameters are limited
# to 4 KiB, and a node seldom hosts more ranks than this.
MAX_FAN_IN = 128
# Inputs one pass of a kernel reads before combining them: a thread holds one pass's values
# (16-byte vectors in the vectorised kernel) in registers, never all ``fan_in`` of them,
# which past ~16-32 ranks would spill to local memory. Each pass carries the accumulator in
# over the result (stored, so rounded to the element type, as every step already is), then
# combines its inputs in rank order: ``((((x0 op x1) op x2) ...)`` exactly as in one pass.
PASS_FAN_IN = 16
# Between passes: no load of the next pass may be hoisted above the previous pass's combines
# (so the compiler cannot bring all inputs into registers after all). An empty asm with a
# memory clobber emits no instruction.
PASS_BARRIER = 'asm volatile("" ::: "memory");'


@dataclass(frozen=True)
class DtypeSpec:
    """How a wire dtype is stored, computed and converted in the kernels."""

    wire: int
    storage: str  # C type of one element in memory
    compute: str  # C type a step computes in
    itemsize: int
    load: str  # C expression: compute value of the storage value ``x``
    store: str  # C expression: storage value of the compute value ``x``
    kind: str  # "float", "int" or "bool"


SPECS: dict[int, DtypeSpec] = {
    pb.FLOAT16: DtypeSpec(pb.FLOAT16, "unsigned short", "float", 2, "h2f(x)", "f2h(x)", "float"),
    pb.BFLOAT16: DtypeSpec(
        pb.BFLOAT16, "unsigned short", "float", 2, "bf2f(x)", "f2bf(x)", "float"
    ),
    pb.FLOAT32: DtypeSpec(pb.FLOAT32, "float", "float", 4, "x", "x", "float"),
    pb.FLOAT64: DtypeSpec(pb.FLOAT64, "double", "double", 8, "x", "x", "float"),
    # Narrow integers compute in int (no overflow is possible in one step) and wrap on store.
    pb.INT8: DtypeSpec(pb.INT8, "signed char", "int", 1, "(int)(x)", "(signed char)(x)", "int"),
    pb.UINT8: DtypeSpec(
        pb.UINT8,
        "unsigned char",
        "unsigned int",
        1,
        "(unsigned int)(x)",
        "(unsigned char)(x)",
        "int",
    ),
    pb.INT16: DtypeSpec(pb.INT16, "short", "int", 2, "(int)(x)", "(short)(x)", "int"),
    pb.INT32: DtypeSpec(pb.INT32, "int", "int", 4, "x", "x", "int"),
    pb.INT64: DtypeSpec(pb.INT64, "long long", "long long", 8, "x", "x", "int"),
    pb.BOOL: DtypeSpec(
        pb.BOOL, "unsigned char", "int", 1, "(x != 0)", "(unsigned char)(x)", "bool"
    ),
}

# int32 and int64 overflow in one step: signed overflow is undefined in C, so + and * go
# through the unsigned type, which wraps as numpy does.
_UNSIGNED: dict[int, str] = {pb.INT32: "unsigned int", pb.INT64: "unsigned long long"}


def combine_expr(dtype: int, reduce_op: int) -> str:
    """The C expression combining compute values ``a`` (the ranks so far) and ``b`` (the next).

    Raises:
        ValueError: the op does not apply to the dtype (e.g. BXOR on float32).
    """
    problem = reduce_op_check(dtype, reduce_op)
    if problem:
        raise ValueError(problem)
    spec = SPECS[dtype]
    if spec.kind == "bool":
        if reduce_op in (pb.SUM, pb.MAX, pb.BOR):
            return "a || b"
        if reduce_op in (pb.PRODUCT, pb.MIN, pb.BAND):
            return "a && b"
        return "a != b"  # BXOR
    if reduce_op == pb.MIN:
        # numpy: (a <= b || isnan(a)) ? a : b, so a NaN on either side wins.
        return "(a <= b || a != a) ? a : b" if spec.kind == "float" else "a <= b ? a : b"
    if reduce_op == pb.MAX:
        return "(a >= b || a != a) ? a : b" if spec.kind == "float" else "a >= b ? a : b"
    symbols: dict[int, str] = {
        pb.SUM: "+",
        pb.AVG: "+",
        pb.PRODUCT: "*",
        pb.BAND: "&",
        pb.BOR: "|",
        pb.BXOR: "^",
    }
    symbol = symbols[reduce_op]
    wide = _UNSIGNED.get(dtype)
    if wide is not None and symbol in "+*":
        return f"({spec.compute})(({wide})a {symbol} ({wide})b)"
    return f"a {symbol} b"


# A module's key: (dtype, reduce op, fan-in, fan-out). One module holds the scalar and the
# vectorised kernel of that combination.
ModuleKey = tuple[int, int, int, int]


def op_module_key(kind: int, dtype: int, reduce_op: int, world: int) -> ModuleKey | None:
    """The module a GPU op of ``world`` ranks launches, or None when it launches no kernel.

    all_reduce reads every rank's input and writes every rank's output; reduce and
    reduce_scatter write one output per launch (the root's, or the block's owner). The same
    key on any number of GPUs: each GPU's launch still reads all ``world`` ranks.
    """
    if kind not in (pb.ALL_REDUCE, pb.REDUCE, pb.REDUCE_SCATTER) or dtype not in SPECS:
        return None
    if reduce_op_check(dtype, reduce_op):
        return None
    return (dtype, reduce_op, world, world if kind == pb.ALL_REDUCE else 1)


def module_keys(worlds: Iterable[int]) -> list[ModuleKey]:
    """Every module GPU ops of the given world sizes can ask for (every reducing kind, dtype
    and reduce op the kernels cover), sorted: what a prepared kernel cache must hold."""
    keys = {
        key
        for world in worlds
        for kind in (pb.ALL_REDUCE, pb.REDUCE, pb.REDUCE_SCATTER)
        for dtype in SPECS
        for reduce_op in REDUCE_NAMES
        if (key := op_module_key(kind, dtype, reduce_op, world)) is not None
    }
    return sorted(keys)


def kernel_name(dtype: int, reduce_op: int, fan_in: int, fan_out: int, vectorized: bool) -> str:
    """The kernel's symbol, e.g. ``smddp_reduce_float16_SUM_3x3_v16``."""
    suffix = f"_v{VECTOR_BYTES}" if vectorized else ""
    return f"smddp_reduce_{dtype_name(dtype)}_{REDUCE_NAMES[reduce_op]}_{fan_in}x{fan_out}{suffix}"


HEADER = "// Generated by smddp.server.gpu_kernels; do not edit.\n"
# float16 <-> float32 with the PTX conversions cuda_fp16.h uses (round to nearest even).
HALF_CONVERSIONS = r"""__device__ __forceinline__ float h2f(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ unsigned short f2h(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
"""
# bfloat16 <-> float32 by bit manipulation: round to nearest even, as ml_dtypes (and so the
# host path) does; a NaN becomes the quiet NaN of its sign.
BFLOAT16_CONVERSIONS = r"""__device__ __forceinline__ float bf2f(unsigned short b) {
  return __uint_as_float(((unsigned int)b) << 16);
}
__device__ __forceinline__ unsigned short f2bf(float f) {
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u & 0x80000000u) ? 0xffc0 : 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}
"""


def reduce_module(dtype: int, reduce_op: int, fan_in: int, fan_out: int) -> str:
    """CUDA C source of the scalar and the vectorised kernel for one combination.

    Both take ``fan_in`` input addresses, ``fan_out`` output addresses and an element count,
    as ``unsigned long long``: ``(in0, ..., out0, ..., n)``. Outputs may alias inputs (each
    thread reads all its inputs before writing). The scalar kernel handles element ``i`` per
    thread; the vectorised one 16-byte vector ``i`` (``n`` counts vectors, every address must
    be 16-byte aligned). Inputs are read in passes of at most ``PASS_FAN_IN`` ranks, each pass
    carrying the accumulator in the thread's (stored) result, so large fan-ins keep to a
    bounded number of registers with the same rank order and rounding.

    Raises:
        ValueError: the op does not apply to the dtype, or the fan-in is out of range.
    """
    if not 1 <= fan_in <= MAX_FAN_IN or not 1 <= fan_out <= MAX_FAN_IN:
        raise ValueError(f"fan-in {fan_in} / fan-out {fan_out} outside 1..{MAX_FAN_IN}")
    spec = SPECS[dtype]
    combine = combine_expr(dtype, reduce_op)
    T, C = spec.storage, spec.compute
    per_vector = VECTOR_BYTES // spec.itemsize
    divide = reduce_op == pb.AVG and fan_in > 1
    params = ", ".join(
        [f"const unsigned long long in{r}" for r in range(fan_in)]
        + [f"const unsigned long long out{r}" for r in range(fan_out)]
        + ["const unsigned long long n"]
    )

    passes = [range(a, min(fan_in, a + PASS_FAN_IN)) for a in range(0, fan_in, PASS_FAN_IN)]

    def body(
        element: str, result: str, indent: str, ranks: range, first: bool, last: bool
    ) -> list[str]:
        """Combines ``element.format(r)`` over ``ranks`` in rank order into storage value
        ``result``: from the first rank's value in the first pass, else from ``result``
        (the accumulator the previous pass stored)."""
        if fan_in == 1:
            # One rank: copy the stored bits (a load/store round trip would canonicalise NaNs).
            return [f"{indent}{result} = {element.format(0)};"]
        if first:
            lines = [f"{indent}C acc = load({element.format(ranks[0])});"]
            rest = ranks[1:]
        else:
            lines = [f"{indent}C acc = load({result});"]
            rest = ranks
        lines += [f"{indent}acc = step(acc, {element.format(r)});" for r in rest]
        if last and divide:
            lines.append(f"{indent}acc = divide(acc);")
        lines.append(f"{indent}{result} = store(acc);")
        return lines

    out: list[str] = [HEADER + HALF_CONVERSIONS + BFLOAT16_CONVERSIONS]
    out.append(
        f"// {dtype_name(dtype)} {REDUCE_NAMES[reduce_op]}: {fan_in} inputs, {fan_out} outputs."
    )
    out.append(f"typedef {T} T;")
    out.append(f"typedef {C} C;")
    out.append(f"__device__ __forceinline__ C load(T x) {{ return {spec.load}; }}")
    out.append(f"__device__ __forceinline__ T store(C x) {{ return {spec.store}; }}")
    out.append(f"__device__ __forceinline__ C combine(C a, C b) {{ return {combine}; }}")
    out.append(
        "__device__ __forceinline__ C step(C a, T x) { return load(store(combine(a, load(x)))); }"
    )
    if divide:
        out.append(
            "__device__ __forceinline__ C divide(C a) "
            f"{{ return load(store(a / load(store((C)({fan_in}))))); }}"
        )
    out.append(
        f"union alignas({VECTOR_BYTES}) Vec "
        f"{{ unsigned long long raw[{VECTOR_BYTES // 8}]; T e[{per_vector}]; }};"
    )

    def kernel(
        vectorized: bool, value: str, one_pass: Callable[[range, bool, bool], list[str]]
    ) -> None:
        """One grid-stride kernel over elements (``T``) or 16-byte vectors (``Vec``)."""
        name = kernel_name(dtype, reduce_op, fan_in, fan_out, vectorized=vectorized)
        out.append(f'extern "C" __global__ void {name}({params}) {{')
        out.append(
            "  const unsigned long long stride = (unsigned long long)blockDim.x * gridDim.x;"
        )
        out.append(
            "  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x "
            "+ threadIdx.x; i < n; i += stride) {"
        )
        out.append(f"    {value} r;")
        for p, ranks in enumerate(passes):
            if p:
                out.append(f"    {PASS_BARRIER}")
            out.append("    {")
            out.extend(one_pass(ranks, p == 0, p == len(passes) - 1))
            out.append("    }")
        out.extend(f"    (({value}*)out{o})[i] = r;" for o in range(fan_out))
        out.append("  }")
        out.append("}")

    def scalar_pass(ranks: range, first: bool, last: bool) -> list[str]:
        return body("((const T*)in{})[i]", "r", "      ", ranks, first, last)

    def vector_pass(ranks: range, first: bool, last: bool) -> list[str]:
        return [
            *(f"      const Vec v{r} = ((const Vec*)in{r})[i];" for r in ranks),
            "#pragma unroll",
            f"      for (int k = 0; k < {per_vector}; ++k) {{",
            *body("v{}.e[k]", "r.e[k]", "        ", ranks, first, last),
            "      }",
        ]

    kernel(False, "T", scalar_pass)
    kernel(True, "Vec", vector_pass)
    return "\n".join(out) + "\n"


# -- launch geometry ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """One kernel launch over elements ``[start, start + count)`` of every buffer.

    ``vectorized`` launches count 16-byte vectors in ``units``; scalar ones count elements.
    """

    start: int
    count: int
    vectorized: bool
    units: int
    grid: int


def split(n: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """Cuts ``[0, n)`` into ``parts`` contiguous ``(start, stop)`` ranges, in order.

    Inner boundaries fall on multiples of ``align`` (elements), so every range but the last
    keeps the vector alignment of the whole; ranges may be empty when ``n`` is small.
    """
    if parts < 1:
        raise ValueError("parts must be at least 1")
    units = -(-n // align) if align > 1 else n
    bounds = [min(n, (units * i // parts) * align) for i in range(parts + 1)]
    bounds[-1] = n
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def chunks(n: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Cuts ``[0, n)`` elements into ranges of at most ``chunk_bytes`` (at least one element,
    a whole number of 16-byte vectors where the size allows)."""
    per = max(1, chunk_bytes // itemsize)
    vec = max(1, VECTOR_BYTES // itemsize)
    if per > vec:
        per -= per % vec
    return [(a, min(n, a + per)) for a in range(0, n, per)] or [(0, 0)]


def plan_launches(
    start: int,
    stop: int,
    itemsize: int,
    addresses: list[int],
    max_grid: int,
) -> list[Launch]:
    """The launches reducing elements ``[start, stop)``: a vectorised body where every buffer
    (given by its element-0 address) is 16-byte aligned there, and scalar head and tail.

    ``max_grid`` caps blocks per launch (the kernels loop over the rest).
    """
    count = stop - start
    if count <= 0:
        return []
    per_vector = VECTOR_BYTES // itemsize
    firsts = [a + start * itemsize for a in addresses]
    # Elements before every buffer reaches a 16-byte boundary; only a common one works.
    heads = {(-f % VECTOR_BYTES) for f in firsts}
    launches: list[Launch] = []

    def add(a: int, b: int, vectorized: bool) -> None:
        if b <= a:
            return
        units = (b - a) // per_vector if vectorized else b - a
        grid = max(1, min(max_grid, -(-units // BLOCK_THREADS)))
        launches.append(Launch(a, b - a, vectorized, units, grid))

    if per_vector <= 1 or len(heads) != 1 or next(iter(heads)) % itemsize:
        add(start, stop, False)
        return launches
    head = min(count, next(iter(heads)) // itemsize)
    body = (count - head) // per_vector * per_vector
    add(start, start + head, False)
    add(start + head, start + head + body, True)
    add(start + head + body, stop, False)
    return launches
