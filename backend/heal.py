"""``smddp.heal``: a live rank's model and optimizer state, sent to every rank of the group.

After ``smddp.grow`` the replacements hold a freshly built model and an optimizer with no
state; the survivors hold the training's. ``heal`` makes every rank hold ``src``'s, bitwise:
the parameters and buffers, and the optimizer's whole ``state_dict`` (its step counts, moments
and momentum buffers, and its param_groups' settings, a scheduler's learning rate included).
The optimizer's state is created lazily, at its first step, so a replacement's has none:
``src`` first sends its structure (keys, shapes, dtypes, the plain values) as one pickled
object, every other rank builds empty tensors of that structure, and the tensors follow.

The tensors travel through the group's own collectives (smddp's broadcast), one flat tensor
per dtype: a model of many small tensors costs a few ops, not one per tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d as c10d

from smddp.backend.process_group import SmddpProcessGroup

__all__ = ["heal"]


def heal(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Gives every rank of ``group`` rank ``src``'s parameters, buffers and optimizer state.

    Every rank of the group calls it, with the same model structure (the same code built it)
    and an optimizer over the same parameters, in the same order, or none on every rank. After
    it, each rank's state is bitwise ``src``'s.

    Args:
        module: the model (not a DistributedDataParallel wrapper built on an old group: wrap
            it again after healing).
        optimizer: its optimizer, or None to send the model only.
        src: the rank (in ``group``) whose state everyone takes: a survivor.
        group: an smddp group; None: the default group.

    Raises:
        TypeError: ``group`` is not an smddp group.
        ValueError: ``src`` is not a rank of the group, or the model's structure differs from
            ``src``'s (the message names the first difference).
        SmddpBackendError: a collective failed (a rank died meanwhile, say).
    """
    pg = group if group is not None else c10d._get_default_group()
    if not isinstance(pg, SmddpProcessGroup):
        raise TypeError(
            f"smddp.heal sends state through smddp groups; this group's backend is {dist.get_backend(pg)}"  # noqa: E501
        )
    if not 0 <= src < pg.size():
        raise ValueError(f"src {src} is not a rank of the group of {pg.size()}")
    me = pg.rank()
    tensors = [p.data for p in module.parameters()] + list(module.buffers())
    shape = [(tuple(t.shape), str(t.dtype)) for t in tensors]
    skeleton: Any = None
    state: list[torch.Tensor] = []
    if me == src and optimizer is not None:
        skeleton = _strip(optimizer.state_dict(), state)
    meta = [(tuple(t.shape), t.dtype, t.device.type) for t in state]
    box: list[Any] = [(shape, skeleton, meta)]
    dist.broadcast_object_list(box, group_src=src, group=pg)
    src_shape, skeleton, state_meta = box[0]
    if src_shape != shape:
        differ = [i for i, (a, b) in enumerate(zip(src_shape, shape)) if a != b]
        first = differ[0] if differ else min(len(shape), len(src_shape))
        raise ValueError(
            f"rank {me}: the model's tensor {first} differs from rank {src}'s (rank {src}: {src_shape[first] if first < len(src_shape) else 'none'}, here: {shape[first] if first < len(shape) else 'none'}): heal needs the same model on every rank"  # noqa: E501
        )
    if me != src and optimizer is not None:
        # On the device kind src keeps it on (this rank's current CUDA device for a GPU
        # tensor): every rank's part of a broadcast lives on the same kind of device.
        state = [
            torch.empty(s, dtype=d, device="cuda" if kind == "cuda" else "cpu")
            for s, d, kind in state_meta
        ]
    _broadcast_flat(tensors + state, src, pg)
    if me != src and optimizer is not None and skeleton is not None:
        optimizer.load_state_dict(_fill(skeleton, iter(state)))


class _Slot:
    """Where ``_strip`` took a tensor out of the state dict (its index in the list)."""

    def __init__(self, index: int) -> None:
        self.index = index


def _strip(value: Any, out: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by a _Slot, the tensors appended to ``out``."""
    if isinstance(value, torch.Tensor):
        out.append(value.detach())
        return _Slot(len(out) - 1)
    if isinstance(value, dict):
        return {k: _strip(v, out) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_strip(v, out) for v in value)
    return value


def _fill(value: Any, tensors: Any) -> Any:
    """The inverse of ``_strip``: slots replaced by the received tensors, in order."""
    if isinstance(value, _Slot):
        return next(tensors)
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(v, tensors) for v in value)
    return value


def _broadcast_flat(tensors: list[torch.Tensor], src: int, pg: dist.ProcessGroup) -> None:
    """Broadcasts ``tensors`` from ``src``, one flat tensor per (dtype, device), in place."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for (dtype, device), group in by_kind.items():
            if pg.rank() == src:
                flat = torch.cat([t.reshape(-1) for t in group])
            else:
                flat = torch.empty(sum(t.numel() for t in group), dtype=dtype, device=device)
            dist.broadcast(flat, group_src=src, group=pg)
            if pg.rank() == src:
                continue
            at = 0
            for t in group:
                t.copy_(flat[at : at + t.numel()].view(t.shape))
                at += t.numel()
