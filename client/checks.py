"""The argument checks every collective makes before anything is sent or written.

One place for the messages a user sees for a bad call: a dtype the wire does not carry, an
output that cannot be written, a rank outside the world, a reduce op the dtype lacks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from smddp.client.errors import UnsupportedError
from smddp.core.wire import WIRE_CODES, dtype_name, reduce_op_check, wire_dtype


def flat(array: np.ndarray, what: str, writable: bool = False) -> np.ndarray:
    """``array`` as one dimension, after checking that the wire carries it.

    Raises:
        UnsupportedError: its dtype is not carried, or (``writable``) it cannot be an output.
    """
    if wire_dtype(array.dtype) is None:
        names = ", ".join(dtype_name(code) for code in WIRE_CODES)
        raise UnsupportedError(f"{what}: dtype {array.dtype} is not supported ({names})")
    if writable:
        if not array.flags.c_contiguous:
            raise UnsupportedError(f"{what}: output arrays must be C-contiguous")
        if not array.flags.writeable:
            raise UnsupportedError(f"{what}: output array is read-only")
    return array.reshape(-1)


def code_of(dtype: np.dtype) -> int:
    """The wire code of a dtype that ``flat`` accepted."""
    code = wire_dtype(dtype)
    assert code is not None, f"{dtype} passed no check"
    return code


def check_root(root: int, world_size: int, what: str) -> None:
    """Raises UnsupportedError unless ``root`` is a rank of the world."""
    if not 0 <= root < world_size:
        raise UnsupportedError(f"{what}: rank {root} is outside a world of {world_size}")


def check_peer(peer: int, rank: int, world_size: int, what: str) -> None:
    """Raises UnsupportedError unless ``peer`` is another rank of the world."""
    check_root(peer, world_size, what)
    if peer == rank:
        raise UnsupportedError(f"{what}: rank {peer} cannot {what} to or from itself")


def check_reduce(code: int, reduce_op: int) -> None:
    """Raises UnsupportedError unless ``reduce_op`` applies to wire dtype ``code``."""
    problem = reduce_op_check(code, reduce_op)
    if problem:
        raise UnsupportedError(problem)


def per_rank(
    arrays: Sequence[np.ndarray] | None,
    world_size: int,
    n: int,
    dtype: np.dtype,
    what: str,
    writable: bool,
) -> list[np.ndarray] | None:
    """One flat array per rank, each of ``n`` elements of ``dtype`` (None stays None).

    Raises:
        UnsupportedError: the count, a dtype or a size is wrong.
    """
    if arrays is None:
        return None
    if len(arrays) != world_size:
        raise UnsupportedError(
            f"{what}: expected {world_size} tensors (one per rank), got {len(arrays)}"
        )
    flats = [flat(a, what, writable) for a in arrays]
    for r, f in enumerate(flats):
        if f.dtype != dtype:
            raise UnsupportedError(f"{what}: tensor {r} has dtype {f.dtype} but the op is {dtype}")
        if f.size != n:
            raise UnsupportedError(
                f"{what}: tensor {r} has {f.size} elements where {n} were expected"
            )
    return flats
