"""Torch tensors as numpy arrays for the client, and the reduce ops torch passes.

The arrays are built from the tensor's data pointer, never with ``Tensor.numpy()``: that call
marks the tensor's storage as not resizable for good, and FSDP1 frees and re-allocates its flat
parameters' storage (``_free_storage``), which then fails with "Trying to resize storage that
is not resizable".
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from smddp.client import ReduceOp
from smddp.client.errors import UnsupportedError

SUPPORTED = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
)
_REDUCE_OPS = {
    dist.ReduceOp.SUM: ReduceOp.SUM,
    dist.ReduceOp.AVG: ReduceOp.AVG,
    dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.MAX: ReduceOp.MAX,
    dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT,
    dist.ReduceOp.BAND: ReduceOp.BAND,
    dist.ReduceOp.BOR: ReduceOp.BOR,
    dist.ReduceOp.BXOR: ReduceOp.BXOR,
}


def check(t: torch.Tensor, what: str) -> None:
    """Raises UnsupportedError for a tensor smddp cannot carry."""
    if not isinstance(t, torch.Tensor):
        raise UnsupportedError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise UnsupportedError(f"{what}: {t.layout} tensors are not supported, only dense ones")
    if t.device.type != "cpu":
        raise UnsupportedError(
            f"{what}: "
            f"tensors on {t.device} are not supported; "
            "smddp carries CPU and CUDA tensors, all of one call's tensors on the same device"
        )
    if t.dtype not in SUPPORTED:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED)
        raise UnsupportedError(
            f"{what}: dtype {str(t.dtype).removeprefix('torch.')} is not supported ({names})"
        )


_TYPESTR = {
    torch.float16: "<f2",
    torch.bfloat16: "<i2",
    torch.float32: "<f4",
    torch.float64: "<f8",
    torch.int8: "|i1",
    torch.uint8: "|u1",
    torch.int16: "<i2",
    torch.int32: "<i4",
    torch.int64: "<i8",
    torch.bool: "|b1",
}


class _TensorMemory:
    """Exposes a tensor's memory to numpy through the array interface; the array's ``base``
    chain ends here, so the tensor lives as long as any array made over it."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        shape = t.shape
        self.__array_interface__ = {
            "version": 3,
            "shape": shape,
            "typestr": _TYPESTR[t.dtype],
            "data": (t.data_ptr(), False),
            # None: C-contiguous, most tensors (building strides is a third of this call).
            "strides": None
            if t.is_contiguous()
            else tuple(s * t.element_size() for s in t.stride()),
        }


def as_numpy(t: torch.Tensor, what: str) -> np.ndarray:
    """A numpy view of ``t`` sharing its memory (bfloat16 through ml_dtypes).

    Leaves the tensor's storage resizable (unlike ``Tensor.numpy()``).
    """
    check(t, what)
    if t.numel() == 0:
        # No memory to share (the data pointer may be null); an empty array says the same.
        arr = np.empty(tuple(t.shape), dtype=_TYPESTR[t.dtype])
    else:
        arr = np.asarray(_TensorMemory(t.detach()))
    if t.dtype == torch.bfloat16:
        import ml_dtypes  # here, not at the top: its import costs ~1 s (see smddp.core.wire)

        return arr.view(ml_dtypes.bfloat16)
    return arr


# The view cache's bounds: it keeps the latest tensor of each entry alive (see ViewCache), so
# at most CACHED_VIEWS x CACHED_VIEW_BYTES stay pinned; larger tensors' ops are long enough
# that a fresh view (~1 us) does not show.
CACHED_VIEWS = 16
CACHED_VIEW_BYTES = 64 << 10


class _Holder:
    """The base of a cached view: the memory's address stays fixed, the tensor that owns it
    is the latest one the view was handed out for."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.__array_interface__ = {
            "version": 3,
            "shape": (t.numel(),),
            "typestr": _TYPESTR[t.dtype],
            "data": (t.data_ptr(), False),
            "strides": None,
        }


class ViewCache:
    """Flat numpy views of small contiguous CPU tensors, by data pointer, length and dtype.

    A view is only an address, a length and a dtype, so it serves every tensor with the same
    three (the same tensor op after op, most often). Each hit hands the view out for the
    tensor at hand and makes that tensor the one the view keeps alive: while a view is in
    use (an op in flight) no other memory can come to have its address, so the view always
    reads and writes the tensor the op was called with. Building a view costs ~3 us, a hit
    ~0.5 us. The caller has checked the tensor (``check``) and that it is contiguous.
    """

    def __init__(self) -> None:
        self._views: dict[tuple[int, int, torch.dtype], tuple[np.ndarray, _Holder]] = {}

    def flat(self, t: torch.Tensor, what: str) -> np.ndarray:
        """A flat view of contiguous ``t`` (cached when it is small and not empty)."""
        n = t.numel()
        dtype = t.dtype
        if n == 0 or n * t.element_size() > CACHED_VIEW_BYTES:
            return as_numpy(t, what).reshape(-1)
        key = (t.data_ptr(), n, dtype)
        hit = self._views.get(key)
        if hit is not None:
            hit[1].tensor = t
            return hit[0]
        if len(self._views) >= CACHED_VIEWS:
            self._views.clear()
        holder = _Holder(t)
        arr = np.asarray(holder)
        if dtype == torch.bfloat16:
            import ml_dtypes  # see as_numpy

            arr = arr.view(ml_dtypes.bfloat16)
        self._views[key] = (arr, holder)
        return arr


def reduce_op(op: dist.ReduceOp | dist.ReduceOp.RedOpType, what: str) -> ReduceOp:
    """smddp's ReduceOp for torch's, or UnsupportedError (e.g. PREMUL_SUM)."""
    for torch_op, wire in _REDUCE_OPS.items():
        if op == torch_op:
            return wire
    raise UnsupportedError(
        f"{what}: reduce op {op} is not supported (SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR)"
    )
