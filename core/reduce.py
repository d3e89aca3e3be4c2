"""Element-wise reduction and copies over numpy views, split across threads.

Shared by the daemon (which reduces in its arenas) and the client (whose ranks reduce their
own segment of a large all_reduce straight from each other's arenas): one implementation,
so both produce the same bits.

The order of a reduction is fixed by rank: ``((x0 op x1) op x2) ...``, every element computed
the same way whatever the arrival order, so every rank gets the same bits and a rerun too.
numpy releases the GIL in its inner loops, so the pieces of a large array run in parallel.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from smddp.core.op import ReduceOp

# Below this many bytes a second thread costs more than it saves.
PARALLEL_MIN_BYTES = 1 << 20

_THREADS = max(1, min(8, os.cpu_count() or 1))
_pool = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="smddp-reduce")

# Keyed by int: ops carry the enum's value as a plain int.
_UFUNCS: dict[int, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}
# bool has no arithmetic in numpy that stays bool for every op; use logic.
_BOOL_UFUNCS: dict[int, np.ufunc] = {
    ReduceOp.SUM: np.logical_or,
    ReduceOp.MAX: np.logical_or,
    ReduceOp.BOR: np.logical_or,
    ReduceOp.MIN: np.logical_and,
    ReduceOp.PRODUCT: np.logical_and,
    ReduceOp.BAND: np.logical_and,
    ReduceOp.BXOR: np.logical_xor,
}


def parallel_ranges(
    n: int, itemsize: int, fn: Callable[[int, int], None], threads: int = _THREADS
) -> None:
    """Calls ``fn(start, stop)`` over pieces covering ``range(n)``, in parallel when large."""
    pieces = min(threads, _THREADS, max(1, (n * itemsize) // PARALLEL_MIN_BYTES))
    if pieces <= 1:
        fn(0, n)
        return
    bounds = [n * i // pieces for i in range(pieces + 1)]
    futures = [_pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(1, pieces)]
    fn(bounds[0], bounds[1])
    for f in futures:
        f.result()


def reduce_into(
    outputs: Sequence[np.ndarray],
    inputs: Sequence[np.ndarray],
    reduce_op: int,
    divisor: int | None = None,
    threads: int = _THREADS,
) -> None:
    """Reduces ``inputs`` in order into every array of ``outputs``.

    For AVG the sum is divided by ``divisor`` (default: the number of inputs); a partial sum
    that another step will finish passes ``divisor=1``. ``threads`` caps the parallelism (a
    rank that reduces beside its peers on the same cores takes one).

    ``outputs[0]`` may be the same memory as ``inputs[0]`` (an in-place op); any other output
    may alias its own rank's input, which is only overwritten once every input is consumed.
    The caller has checked that ``reduce_op`` suits the dtype.
    """
    first = inputs[0]
    ufunc = _BOOL_UFUNCS[reduce_op] if first.dtype == np.bool_ else _UFUNCS[reduce_op]
    world = len(inputs)
    divide_by = world if divisor is None else divisor
    target = outputs[0]
    # Writing into outputs[0] early is only safe if it aliases nothing but inputs[0].
    safe = not any(np.may_share_memory(target, x) for x in inputs[1:])

    def piece(a: int, b: int) -> None:
        with np.errstate(all="ignore"):  # integers wrap around, as in torch
            _reduce_piece(a, b)

    def _reduce_piece(a: int, b: int) -> None:
        acc = target[a:b] if safe else np.empty(b - a, dtype=first.dtype)
        if world == 1:
            np.copyto(acc, first[a:b])
        else:
            ufunc(first[a:b], inputs[1][a:b], out=acc)
            for x in inputs[2:]:
                ufunc(acc, x[a:b], out=acc)
        if reduce_op == ReduceOp.AVG and divide_by != 1:
            np.divide(acc, np.asarray(divide_by, dtype=first.dtype), out=acc)
        for out in outputs if not safe else outputs[1:]:
            np.copyto(out[a:b], acc)

    parallel_ranges(first.size, first.dtype.itemsize, piece, threads)


def copy_into(outputs: Sequence[np.ndarray], source: np.ndarray) -> None:
    """Copies ``source`` into every array of ``outputs`` (which may include ``source``)."""
    targets = [o for o in outputs if o.ctypes.data != source.ctypes.data]

    def piece(a: int, b: int) -> None:
        for out in targets:
            np.copyto(out[a:b], source[a:b])

    parallel_ranges(source.size, source.dtype.itemsize, piece)
