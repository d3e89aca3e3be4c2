"""Message sizes: parsing ``1MiB``-style flags, the size ladder and iteration scaling."""

from __future__ import annotations

# Sizes are parsed as smddpd's settings are (4, 4B, 64KiB, 1M, 1.5GiB, 4MB = 4*10**6): one
# parser of the unit rules for the daemon's flags and the benchmark's.
from smddp.server.units import parse_size as parse_size

# Never fewer timed iterations than this after scaling, so p10/p90 still mean something.
MIN_SCALED_ITERS = 3


def format_size(nbytes: int) -> str:
    """Format a byte count with the largest binary unit that divides it exactly (``64 KiB``)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def size_ladder(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Sizes ``min_bytes * factor**k`` that do not exceed ``max_bytes``.

    Args:
        min_bytes: smallest size, at least 1.
        max_bytes: largest size allowed; included only when it lies on the ladder.
        factor: growth factor, at least 2 (2 or 4 in practice).

    Returns:
        The ascending list of sizes; never empty when ``min_bytes <= max_bytes``.
    """
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"bad size ladder: min={min_bytes} max={max_bytes} factor={factor}")
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def scaled_count(requested: int, nbytes: int, budget_bytes: int, floor: int) -> int:
    """How many repetitions to run at ``nbytes`` so their total stays near ``budget_bytes``.

    Small messages keep ``requested``; large ones drop towards ``floor`` so that a full sweep
    to 256 MiB finishes in minutes. The count never exceeds ``requested``.

    Args:
        requested: the count asked for on the command line (``--iters``/``--warmup``).
        nbytes: message size.
        budget_bytes: bytes worth of repetitions to allow per op and size.
        floor: the smallest count scaling may produce.

    Returns:
        The repetition count.
    """
    by_budget = budget_bytes // max(nbytes, 1)
    return min(requested, max(floor, by_budget))
