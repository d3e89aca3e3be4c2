"""Command line of the collectives benchmark and the loop over world sizes and backends.

The results go to ``--out`` (collectives.json, collectives.txt and, with matplotlib,
collectives.png), by default a new temporary folder, printed; ``--out docs/benchmarks``
refreshes the figures kept in the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.collectives.errors import BenchmarkError
from benchmarks.collectives.launch import RunResult, run_single_node
from benchmarks.collectives.memcpy import copy_bandwidth
from benchmarks.collectives.ops import COLLECTIVES
from benchmarks.collectives.outdir import OUT_HELP, OutFolder, matplotlib_installed
from benchmarks.collectives.plot import require_matplotlib, write_plot
from benchmarks.collectives.report import format_table
from benchmarks.collectives.results import Row, add_ratios, rows_from_run
from benchmarks.collectives.sizes import format_size, parse_size, size_ladder
from benchmarks.collectives.worker import Plan, load_backend

QUICK_SIZES = (4, 64 << 10, 1 << 20)

# Runs one backend at one world size; run_single_node today, a multi-node launcher later.
Runner = Callable[[str, int, Plan], RunResult]


@dataclass(frozen=True)
class BenchConfig:
    """The resolved command line.

    Attributes:
        backends: backends to run, in order; each world size runs all of them back to back.
        baseline: backend the others are compared against.
        world_sizes: world sizes to run.
        plan: what every run measures.
        json_path: where to write the JSON results, if not into ``out``.
        plot_path: where to write the PNG plot, if not into ``out``.
        out: the folder for the result files (None: a new temporary folder).
    """

    backends: tuple[str, ...]
    baseline: str
    world_sizes: tuple[int, ...]
    plan: Plan
    json_path: str | None
    plot_path: str | None
    out: str | None = None


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; defaults of None are filled in by ``--quick`` or the full sweep."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.collectives",
        description="Time torch.distributed collectives on this node for several backends "
        "(default smddp against gloo) and report latency, algbw and busbw (nccl-tests "
        "definitions) next to a single-process memcpy reference.",
    )
    p.add_argument(
        "--backends", default="smddp,gloo", help="comma-separated (default: %(default)s)"
    )
    p.add_argument("--baseline", default="gloo", help="backend ratios compare against")
    p.add_argument("--world-sizes", help="comma-separated rank counts (default 2,4; quick: 2)")
    p.add_argument("--ops", default=",".join(COLLECTIVES), help="comma-separated (default: all)")
    p.add_argument("--min-bytes", help="smallest message, e.g. 4 or 1KiB (default 4)")
    p.add_argument("--max-bytes", help="largest message, e.g. 256MiB (default 256MiB)")
    p.add_argument("--factor", type=int, default=4, help="size step factor (default 4)")
    p.add_argument("--iters", type=int, help="timed iterations at small sizes (default 50)")
    p.add_argument("--warmup", type=int, help="untimed iterations at small sizes (default 5)")
    p.add_argument(
        "--budget",
        default="2GiB",
        help="bytes worth of timed iterations per op and size; larger messages run fewer "
        "iterations (at least 3) so a full sweep takes minutes (default %(default)s)",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=3.0,
        help="cap on one op and size's timed loop, estimated from the warmup (default 3)",
    )
    p.add_argument("--no-check", action="store_true", help="skip the result check per size")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per backend run")
    p.add_argument("--out", metavar="DIR", help=OUT_HELP)
    p.add_argument(
        "--json",
        dest="json_path",
        metavar="PATH",
        help="write results as JSON here (default: collectives.json in --out)",
    )
    p.add_argument(
        "--plot",
        dest="plot_path",
        metavar="PATH",
        help="write busbw vs size PNG here (needs matplotlib; default: collectives.png in --out "
        "where matplotlib is installed)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small subset for tests: 4 B, 64 KiB, 1 MiB; world size 2; 3 iterations",
    )
    return p


def resolve(args: argparse.Namespace) -> BenchConfig:
    """Turn parsed flags into a config, applying ``--quick`` where a flag was not given.

    Raises:
        ValueError: a flag value is malformed or out of range.
    """
    ops = tuple(_csv(args.ops))
    unknown = [op for op in ops if op not in COLLECTIVES]
    if unknown or not ops:
        raise ValueError(f"unknown --ops {unknown}; choose from {', '.join(COLLECTIVES)}")
    backends = tuple(_csv(args.backends))
    if not backends:
        raise ValueError("--backends is empty")
    world_sizes = tuple(int(w) for w in _csv(args.world_sizes or ("2" if args.quick else "2,4")))
    if not world_sizes or min(world_sizes) < 2:
        raise ValueError("--world-sizes must be at least 2 each")
    if args.quick and args.min_bytes is None and args.max_bytes is None:
        sizes = QUICK_SIZES
    else:
        min_bytes = parse_size(args.min_bytes or "4")
        max_bytes = parse_size(args.max_bytes or "256MiB")
        sizes = tuple(size_ladder(min_bytes, max_bytes, args.factor))
    iters = args.iters if args.iters is not None else (3 if args.quick else 50)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    if iters < 1 or warmup < 0:
        raise ValueError("--iters must be at least 1 and --warmup at least 0")
    plan = Plan(
        ops=ops,
        sizes=sizes,
        iters=iters,
        warmup=warmup,
        budget_bytes=parse_size(args.budget),
        check=not args.no_check,
        timeout_s=args.timeout,
        max_seconds=args.max_seconds,
    )
    return BenchConfig(
        backends, args.baseline, world_sizes, plan, args.json_path, args.plot_path, args.out
    )


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def measure_memcpy(sizes: Sequence[int]) -> dict[int, float]:
    """Copy bandwidth for each size, in GB/s."""
    result = {}
    for size in sizes:
        result[size] = copy_bandwidth(size)
        _log(f"[memcpy] {format_size(size):>9}  {result[size]:8.2f} GB/s")
    return result


def run_all(config: BenchConfig, runner: Runner = run_single_node) -> dict[str, Any]:
    """Measure memcpy, then every world size and backend; return the JSON document.

    Args:
        config: what to run.
        runner: starts one backend run; replaceable for a multi-node mode.

    Returns:
        ``{"meta": ..., "memcpy": [...], "rows": [...], "errors": [...]}``; see ``Row`` for the
        row fields. ``errors`` holds one message per backend run that failed or was skipped.
    """
    started = time.time()
    errors: list[dict[str, Any]] = []
    backends = []
    for backend in config.backends:
        try:
            load_backend(backend)
            backends.append(backend)
        except BenchmarkError as exc:
            _log(f"skipping: {exc}")
            errors.append({"backend": backend, "world_size": None, "message": str(exc)})
    plan = config.plan
    sized = any(COLLECTIVES[op].sized for op in plan.ops)
    memcpy = measure_memcpy(plan.sizes) if sized and backends else {}
    rows: list[Row] = []
    for world in config.world_sizes:
        for backend in backends:
            _log(f"running {backend} with world size {world}")
            run = runner(backend, world, plan)
            rows += rows_from_run(run, memcpy)
            if run.error is not None:
                _log(f"error: {run.error}")
                errors.append({"backend": backend, "world_size": world, "message": run.error})
            else:
                _log(f"finished {backend} with world size {world} in {run.elapsed_s:.1f} s")
    add_ratios(rows, config.baseline)
    import torch

    return {
        "meta": {
            "argv": sys.argv,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "duration_s": time.time() - started,
            "host": platform.node(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "backends": list(config.backends),
            "baseline": config.baseline,
            "world_sizes": list(config.world_sizes),
            "plan": asdict(plan),
            "units": {
                "time": "microseconds per iteration, slowest rank",
                "bandwidth": "GB/s (1e9)",
            },
        },
        "memcpy": [{"size": s, "gbps": g} for s, g in memcpy.items()],
        "rows": [r.to_json() for r in rows],
        "errors": errors,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the table on stdout and progress on stderr.

    Returns:
        0 when every backend run completed, 1 when any failed or was skipped, 2 on bad usage.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = resolve(args)
        if config.plot_path:
            require_matplotlib()
    except (ValueError, BenchmarkError) as exc:
        parser.error(str(exc))
    doc = run_all(config)
    rows = [Row(**r) for r in doc["rows"]]
    table = format_table(rows, config.plan.ops, config.backends)
    sys.stdout.write(table)
    out = OutFolder(config.out, "smddp-bench-collectives-")
    with open(out.path("collectives.json", config.json_path), "w") as f:
        json.dump(doc, f, indent=1)
    with open(out.path("collectives.txt"), "w") as f:
        f.write(table)
    if config.plot_path or matplotlib_installed():
        memcpy = {m["size"]: m["gbps"] for m in doc["memcpy"]}
        write_plot(out.path("collectives.png", config.plot_path), rows, memcpy)
    else:
        _log("no collectives.png: matplotlib is not installed")
    out.announce()
    for error in doc["errors"]:
        _log(f"error: {error['message']}")
    return 1 if doc["errors"] else 0
