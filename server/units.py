"""Byte sizes as people write them: ``4MiB``, ``1GiB``, ``512k``, ``65536``.

smddpd's size settings (every ``*_bytes`` flag, variable and config-file key) go through
:func:`parse_size`, so that an operator never has to multiply by 1024 in their head, and their
help shows defaults with :func:`format_size`.
"""

from __future__ import annotations

import argparse
import re

# Binary units are what memory sizes usually mean; the SI forms are accepted too, and mean
# what they say, so that "4MB" is not silently 4 MiB.
_BINARY = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
}
_DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS = {**_BINARY, **_DECIMAL}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")

SIZE_HELP = (
    "bytes, with an optional unit: "
    "KiB, MiB, GiB, TiB (K, M, G, T mean the same), or kB, MB, GB, TB (powers of 1000)"
)


def is_size(name: str) -> bool:
    """True for the settings that hold a byte count (their names end in ``_bytes``)."""
    return name.endswith("_bytes")


def parse_size(value: str | int) -> int:
    """Returns the byte count that ``value`` (``"4MiB"``, ``"1.5GiB"``, ``"4096"``, ``4096``) names.

    Raises:
        ValueError: not a size, an unknown unit, a negative count or a fraction of a byte.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value} is negative")
        return value
    match = _SIZE.fullmatch(str(value))
    if match is None:
        raise ValueError(f"{value!r} is not a size ({SIZE_HELP})")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"{value!r}: unknown unit {unit!r} ({SIZE_HELP})")
    if "." in number:
        whole, frac = number.split(".")
        # Exact arithmetic: 1.5GiB is 1610612736, whatever a float would round it to.
        numerator = (int(whole) * 10 ** len(frac) + int(frac)) * factor
        count: int  # match.groups() is typed str | Any
        count, rest = divmod(numerator, 10 ** len(frac))
        if rest:
            raise ValueError(f"{value!r} is not a whole number of bytes")
        return count
    return int(number) * factor


def format_size(count: int) -> str:
    """``4194304`` -> ``"4MiB"``: the largest binary unit that divides ``count`` exactly."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count and count % factor == 0:
            return f"{count // factor}{unit}"
    return str(count)


def size_arg(value: str) -> int:
    """An argparse ``type=`` for size flags: the parse error becomes argparse's message."""
    try:
        return parse_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
