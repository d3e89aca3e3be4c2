"""The human-readable result table."""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.collectives.results import Row
from benchmarks.collectives.sizes import format_size

_HEADER = (
    f"{'size':>9}  {'backend':<8} {'iters':>5} {'median us':>11} {'p10 us':>11} {'p90 us':>11}"
    f" {'algbw GB/s':>10} {'busbw GB/s':>10} {'memcpy GB/s':>11}  {'ratio':>11}"
)


def _num(value: float | None, width: int) -> str:
    # Significant digits rather than decimals: 4-byte rows have busbw around 1e-5 GB/s.
    return f"{value:{width}.4g}" if value is not None else f"{'-':>{width}}"


def _ratio(row: Row) -> str:
    if row.ratio is None:
        return ""
    tag = "bw" if row.ratio_kind == "busbw" else "lat"
    return f"{tag} {row.ratio:6.2f}x"


def format_table(rows: Sequence[Row], ops: Sequence[str], backends: Sequence[str]) -> str:
    """Render ``rows`` as one block per op and world size, one line per size and backend.

    Args:
        rows: result rows.
        ops: op order for the blocks.
        backends: backend order within a size.

    Returns:
        The table, ending in a newline.
    """
    lines = []
    baselines = sorted({r.baseline for r in rows if r.baseline})
    if baselines:
        lines.append(
            f"ratio = this backend vs {', '.join(baselines)}: 'bw' is the busbw ratio (higher is"
            " better), 'lat' the median-time ratio (lower is better)."
        )
    worlds = sorted({r.world_size for r in rows})
    for op in ops:
        for world in worlds:
            block = [r for r in rows if r.op == op and r.world_size == world]
            if not block:
                continue
            block.sort(key=lambda r: (r.size, backends.index(r.backend)))
            lines += ["", f"== {op}, world size {world} ==", _HEADER]
            for r in block:
                # The size actually moved, which busbw is computed from (4 B rounds up to n floats
                # where the op splits the message).
                size = format_size(r.bytes) if r.op != "barrier" else "-"
                lines.append(
                    f"{size:>9}  {r.backend:<8} {r.iters:>5} {r.median_us:11.1f}"
                    f" {r.p10_us:11.1f} {r.p90_us:11.1f} {_num(r.algbw_gbps, 10)}"
                    f" {_num(r.busbw_gbps, 10)} {_num(r.memcpy_gbps, 11)}  {_ratio(r):>11}"
                )
    return "\n".join(lines) + "\n"
