"""SageMaker's pre-1.4 PyTorch API, ``smdistributed.dataparallel.torch.distributed``, over
torch.distributed on backend "smddp".

Scripts written for the library's v1.3 and earlier call these instead of torch.distributed
(``dist.init_process_group()`` with no arguments, ``dist.get_local_rank()``, ...). Each
function here is torch's own with the library's defaults: the backend is always "smddp",
and ``group`` defaults to the world. Launch as for torch.distributed: torchrun, mpirun or
srun (importing smddp fills torchrun's variables from the MPI or Slurm launcher's).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as _dist

import smddp  # noqa: F401  (registers the backend and fills the launcher's environment)
from smddp.backend import BACKEND_NAME

ReduceOp = _dist.ReduceOp
group = _dist.group  # group.WORLD, as in torch.distributed

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "destroy_process_group",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "is_available",
    "is_initialized",
    "reduce",
]


def is_available() -> bool:
    """True: the library (smddp) and torch.distributed are importable."""
    return _dist.is_available()


def init_process_group(*args: Any, **kwargs: Any) -> None:
    """Joins the job's default process group on backend "smddp".

    Takes torch's arguments (init_method, timeout, world_size, rank, ...); a ``backend``
    other than "smddp" is refused, since this API is the smddp library's.
    """
    backend = kwargs.pop("backend", args[0] if args else BACKEND_NAME)
    args = args[1:] if args else args
    if str(backend).lower() != BACKEND_NAME:
        raise ValueError(
            f"smdistributed.dataparallel runs on backend {BACKEND_NAME!r}, not {backend!r}"
        )
    _dist.init_process_group(BACKEND_NAME, *args, **kwargs)


def is_initialized() -> bool:
    """Whether init_process_group() has run."""
    return _dist.is_initialized()


def destroy_process_group(group: Any = None) -> None:
    """Leaves the process group (the default one when ``group`` is None)."""
    _dist.destroy_process_group(group)


def get_world_size(group: Any = None) -> int:
    """Number of ranks in ``group`` (the world by default)."""
    return _dist.get_world_size(group)


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (the world by default)."""
    return _dist.get_rank(group)


def get_local_rank() -> int:
    """This process's rank among the ranks of its node (LOCAL_RANK)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_local_size() -> int:
    """Number of ranks on this node (LOCAL_WORLD_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    """torch.distributed.all_reduce."""
    return _dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """torch.distributed.reduce."""
    return _dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = None, async_op: bool = False) -> Any:
    """torch.distributed.broadcast."""
    return _dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """torch.distributed.all_gather."""
    return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_to_all_single(
    output_t: torch.Tensor,
    input_t: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> Any:
    """torch.distributed.all_to_all_single."""
    return _dist.all_to_all_single(
        output_t, input_t, output_split_sizes, input_split_sizes, group=group, async_op=async_op
    )


def barrier(group: Any = None, async_op: bool = False) -> Any:
    """torch.distributed.barrier."""
    return _dist.barrier(group=group, async_op=async_op)
