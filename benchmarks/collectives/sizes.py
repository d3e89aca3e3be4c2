"""Message sizes: parsing ``1MiB``-style flags, the size ladder and iteration scaling."""

from __future__ import annotations

import re

# Binary multiples unless the unit says otherwise; bare K/M/G are binary, as in nccl-tests.
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")

# Never fewer timed iterations than this after scaling, so p10/p90 still mean something.
MIN_SCALED_ITERS = 3


def parse_size(text: str) -> int:
    """Parse a byte count such as ``4``, ``4B``, ``64KiB``, ``1M`` or ``256MiB``.

    Args:
        text: the flag value.

    Returns:
        The number of bytes.

    Raises:
        ValueError: the text is not a non-negative integer with a known unit.
    """
    match = _SIZE_RE.match(text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 4, 4B, 64KiB, 1MiB, 2GiB)")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


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
