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

from smddp.client.errors import UnsupportedError
from smddp.v1 import smddp_pb2 as pb

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
    dist.ReduceOp.SUM: pb.SUM,
    dist.ReduceOp.AVG: pb.AVG,
    dist.ReduceOp.MIN: pb.MIN,
    dist.ReduceOp.MAX: pb.MAX,
    dist.ReduceOp.PRODUCT: pb.PRODUCT,
    dist.ReduceOp.BAND: pb.BAND,
    dist.ReduceOp.BOR: pb.BOR,
    dist.ReduceOp.BXOR: pb.BXOR,
}


def check(t: torch.Tensor, what: str) -> None:
    """Raises UnsupportedError for a tensor smddp cannot carry."""
    if not isinstance(t, torch.Tensor):
        raise UnsupportedError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise UnsupportedError(f"{what}: {t.layout} tensors are not supported, only dense ones")
    if t.device.type != "cpu":
        raise UnsupportedError(
            f"{what}: tensors on {t.device} are not supported; smddp carries CPU and CUDA tensors, "
            "all of one call's tensors on the same device"
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
        import ml_dtypes  # here, not at the top: its import costs ~1 s (see smddp.wire)

        return arr.view(ml_dtypes.bfloat16)
    return arr


def reduce_op(op: dist.ReduceOp | dist.ReduceOp.RedOpType, what: str) -> int:
    """The wire ReduceOp for torch's, or UnsupportedError (e.g. PREMUL_SUM)."""
    for torch_op, wire in _REDUCE_OPS.items():
        if op == torch_op:
            return wire
    raise UnsupportedError(
        f"{what}: reduce op {op} is not supported (SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR)"
    )
