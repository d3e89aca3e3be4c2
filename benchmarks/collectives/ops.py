"""The benchmarked collectives: their buffers, a correctness check and nccl-tests bandwidth.

Sizes follow nccl-tests (``doc/PERFORMANCE.md`` there): a row's byte count is the all_reduce and
broadcast tensor, the *gathered* output of all_gather and the *unscattered* input of
reduce_scatter. ``algbw = bytes / time`` and ``busbw = algbw * bus_factor(n)``, the factor making
busbw comparable to link bandwidth across world sizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

DTYPE = torch.float32
ELEMENT_BYTES = 4
BROADCAST_ROOT = 0

# torch 2.13 renamed the tensor variants and warns on the old names; keep both working.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Prepared:
    """One op at one size, ready to run on this rank.

    Attributes:
        nbytes: the row's byte count (see the module docstring), after rounding to whole
            elements divisible among ranks.
        run: issues the collective once and waits for it.
        verify: raises ``AssertionError`` unless the last ``run`` after ``prepare`` gave the right
            result; afterwards resets the buffers so that repeated runs cannot overflow.
    """

    nbytes: int
    run: Callable[[], None]
    verify: Callable[[], None]


def _elements(nbytes: int, multiple: int) -> int:
    """Whole elements covering ``nbytes``, rounded up to a multiple of ``multiple``."""
    count = max(1, math.ceil(nbytes / ELEMENT_BYTES))
    return math.ceil(count / multiple) * multiple


def _expect(tensor: torch.Tensor, expected: torch.Tensor | float, what: str) -> None:
    if not bool(torch.all(tensor == expected)):
        raise AssertionError(
            f"{what}: wrong result (first elements {tensor.flatten()[:4].tolist()})"
        )


def _all_reduce(nbytes: int, rank: int, world: int) -> Prepared:
    count = _elements(nbytes, 1)
    x = torch.full((count,), float(rank + 1), dtype=DTYPE)

    def verify() -> None:
        _expect(x, world * (world + 1) / 2, "all_reduce")
        x.zero_()

    return Prepared(count * ELEMENT_BYTES, lambda: dist.all_reduce(x), verify)


def _all_gather(nbytes: int, rank: int, world: int) -> Prepared:
    count = _elements(nbytes, world)
    part = torch.full((count // world,), float(rank + 1), dtype=DTYPE)
    out = torch.empty(count, dtype=DTYPE)

    def verify() -> None:
        want = torch.arange(1, world + 1, dtype=DTYPE).repeat_interleave(count // world)
        _expect(out, want, "all_gather")

    return Prepared(count * ELEMENT_BYTES, lambda: _all_gather_tensor(out, part), verify)


def _reduce_scatter(nbytes: int, rank: int, world: int) -> Prepared:
    count = _elements(nbytes, world)
    # Chunk j of rank r holds (r+1)*(j+1): a swapped or unreduced chunk shows up in the check.
    scale = torch.arange(1, world + 1, dtype=DTYPE).repeat_interleave(count // world)
    inp = scale * float(rank + 1)
    out = torch.empty(count // world, dtype=DTYPE)

    def verify() -> None:
        _expect(out, float((rank + 1) * world * (world + 1) // 2), "reduce_scatter")

    return Prepared(count * ELEMENT_BYTES, lambda: _reduce_scatter_tensor(out, inp), verify)


def _broadcast(nbytes: int, rank: int, world: int) -> Prepared:
    count = _elements(nbytes, 1)
    x = torch.full((count,), float(rank + 1), dtype=DTYPE)

    def verify() -> None:
        _expect(x, float(BROADCAST_ROOT + 1), "broadcast")

    return Prepared(count * ELEMENT_BYTES, lambda: dist.broadcast(x, BROADCAST_ROOT), verify)


def _barrier(nbytes: int, rank: int, world: int) -> Prepared:
    return Prepared(0, lambda: dist.barrier(), lambda: None)


@dataclass(frozen=True)
class Collective:
    """A benchmarked op.

    Attributes:
        name: the ``--ops`` name.
        prepare: allocates and fills this rank's buffers for a row size, world size and rank;
            called as ``prepare(nbytes, rank, world)``.
        bus_factor: busbw/algbw for a world size; ``None`` for ops that move no data.
    """

    name: str
    prepare: Callable[[int, int, int], Prepared]
    bus_factor: Callable[[int], float] | None

    @property
    def sized(self) -> bool:
        """Whether the op moves data, so runs once per message size rather than once."""
        return self.bus_factor is not None


COLLECTIVES: dict[str, Collective] = {
    c.name: c
    for c in (
        Collective("all_reduce", _all_reduce, lambda n: 2 * (n - 1) / n),
        Collective("all_gather", _all_gather, lambda n: (n - 1) / n),
        Collective("broadcast", _broadcast, lambda n: 1.0),
        Collective("reduce_scatter", _reduce_scatter, lambda n: (n - 1) / n),
        Collective("barrier", _barrier, None),
    )
}
