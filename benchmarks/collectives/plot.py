"""The optional PNG: bus bandwidth against message size."""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.collectives.errors import BenchmarkError
from benchmarks.collectives.results import Row

MISSING = "--plot needs matplotlib, which is not installed (pip install matplotlib)"


def require_matplotlib() -> None:
    """Fail before any measurement if ``--plot`` cannot be honoured.

    Raises:
        BenchmarkError: matplotlib cannot be imported.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise BenchmarkError(MISSING) from exc


def write_plot(path: str, rows: Sequence[Row], memcpy_gbps: dict[int, float]) -> None:
    """Plot busbw against size, one line per backend, op and world size, plus the memcpy line.

    Args:
        path: PNG file to write.
        rows: result rows; barrier rows are left out (they have no bandwidth).
        memcpy_gbps: copy bandwidth by size, drawn as a dashed reference.
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 7))
    lines: dict[tuple[str, int, str], dict[int, Row]] = {}
    for row in rows:
        if row.busbw_gbps is not None:
            # Keyed by bytes moved: a tiny size rounded up to n elements would otherwise
            # duplicate the next size's point; the later row is the one asked for exactly.
            lines.setdefault((row.op, row.world_size, row.backend), {})[row.bytes] = row
    # One colour per op and world size, one line style per backend, so pairs are easy to read.
    colours = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors
    series = sorted({(op, world) for op, world, _ in lines})
    styles = ["-", ":", "--", "-."]
    backends = sorted({backend for _, _, backend in lines}, key=lambda b: b != "smddp")
    for (op, world, backend), points in sorted(lines.items()):
        sizes = sorted(points)
        ax.plot(
            sizes,
            [points[s].busbw_gbps for s in sizes],
            marker="o",
            markersize=3,
            color=colours[series.index((op, world)) % len(colours)],
            linestyle=styles[backends.index(backend) % len(styles)],
            label=f"{backend} {op} n={world}",
        )
    if memcpy_gbps:
        sizes = sorted(memcpy_gbps)
        ax.plot(
            sizes,
            [memcpy_gbps[s] for s in sizes],
            "k-",
            lw=2,
            alpha=0.5,
            label="memcpy (1 process)",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title("Collective bus bandwidth")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
