"""Turning per-rank samples into result rows: statistics, bandwidth and the smddp/gloo ratio."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from benchmarks.collectives.launch import RunResult
from benchmarks.collectives.ops import COLLECTIVES

# Below this size a row's time is mostly fixed per-call cost, so the headline ratio compares
# latency; from here up it compares bus bandwidth.
LATENCY_REGIME_BYTES = 64 << 10


@dataclass
class Row:
    """One backend, op, world size and message size.

    Times are per iteration, in microseconds; an iteration's time is the slowest rank's, since
    the collective is complete only when every rank has its result. Bandwidths are in GB/s
    (10**9 bytes per second) from the median time, as nccl-tests defines them.

    Attributes:
        backend: torch.distributed backend name.
        op: op name.
        world_size: number of ranks.
        size: requested message size in bytes (0 for barrier).
        bytes: actual message size in bytes (``size`` rounded to whole float32 elements
            divisible by the world size where the op splits the message).
        iters: timed iterations.
        warmup: untimed iterations.
        median_us, p10_us, p90_us, min_us, max_us, mean_us: statistics of the iteration times.
        algbw_gbps: ``bytes / median``; ``None`` for barrier.
        busbw_gbps: ``algbw * bus factor``; ``None`` for barrier.
        memcpy_gbps: single-process copy bandwidth at ``size`` (``None`` for barrier).
        baseline: backend the ratios compare against, or ``None`` on the baseline's own rows
            and where the baseline has no matching row.
        ratio: headline ratio, ``busbw_ratio`` or ``latency_ratio`` per ``ratio_kind``.
        ratio_kind: ``"busbw"`` (this / baseline, higher is better) or ``"latency"``
            (this / baseline median time, lower is better).
        busbw_ratio: this row's busbw / the baseline's.
        latency_ratio: this row's median time / the baseline's.
    """

    backend: str
    op: str
    world_size: int
    size: int
    bytes: int
    iters: int
    warmup: int
    median_us: float
    p10_us: float
    p90_us: float
    min_us: float
    max_us: float
    mean_us: float
    algbw_gbps: float | None
    busbw_gbps: float | None
    memcpy_gbps: float | None
    baseline: str | None = None
    ratio: float | None = None
    ratio_kind: str | None = None
    busbw_ratio: float | None = None
    latency_ratio: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The row as a JSON-ready dict."""
        return asdict(self)


def rows_from_run(run: RunResult, memcpy_gbps: dict[int, float]) -> list[Row]:
    """Rows for every op and size that all ranks of ``run`` measured.

    Args:
        run: one backend run.
        memcpy_gbps: copy bandwidth by requested size.

    Returns:
        The rows, in the order rank 0 measured them.
    """
    by_rank = [
        {(m.op, m.size): m for m in run.measurements[rank]} for rank in range(run.world_size)
    ]
    rows = []
    for m in run.measurements[0]:
        key = (m.op, m.size)
        if not all(key in ranks for ranks in by_rank):
            continue
        # Iteration i's time is the slowest rank's i-th sample.
        times = np.max([ranks[key].samples_s for ranks in by_rank], axis=0) * 1e6
        median = float(np.median(times))
        factor = COLLECTIVES[m.op].bus_factor
        algbw = m.nbytes / median / 1e3 if factor is not None else None
        rows.append(
            Row(
                backend=run.backend,
                op=m.op,
                world_size=run.world_size,
                size=m.size,
                bytes=m.nbytes,
                iters=len(times),
                warmup=m.warmup,
                median_us=median,
                p10_us=float(np.percentile(times, 10)),
                p90_us=float(np.percentile(times, 90)),
                min_us=float(times.min()),
                max_us=float(times.max()),
                mean_us=float(times.mean()),
                algbw_gbps=algbw,
                busbw_gbps=algbw * factor(run.world_size) if algbw is not None else None,
                memcpy_gbps=memcpy_gbps.get(m.size) if factor is not None else None,
            )
        )
    return rows


def add_ratios(rows: list[Row], baseline: str) -> None:
    """Fill the ratio fields of every non-baseline row that has a matching baseline row.

    Args:
        rows: rows of all runs; changed in place.
        baseline: backend to compare against (gloo).
    """
    base = {(r.op, r.world_size, r.size): r for r in rows if r.backend == baseline}
    for row in rows:
        ref = base.get((row.op, row.world_size, row.size))
        if row.backend == baseline or ref is None:
            continue
        row.baseline = baseline
        row.latency_ratio = row.median_us / ref.median_us
        if row.busbw_gbps is not None and ref.busbw_gbps:
            row.busbw_ratio = row.busbw_gbps / ref.busbw_gbps
        if row.busbw_ratio is None or row.size < LATENCY_REGIME_BYTES:
            row.ratio, row.ratio_kind = row.latency_ratio, "latency"
        else:
            row.ratio, row.ratio_kind = row.busbw_ratio, "busbw"
