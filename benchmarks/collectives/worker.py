"""What one rank does: load the backend, join the process group, time every op and size.

``run_rank`` only assumes that the ``env://`` rendezvous variables are set, so it serves the
single-node launcher in ``launch`` today and a torchrun-started multi-node mode later.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

# Backends that exist only after importing a plugin module which registers them with torch.
PLUGIN_MODULES: dict[str, str] = {"smddp": "smddp"}


@dataclass(frozen=True)
class Plan:
    """What every rank of every run measures; the same for all backends so rows compare.

    Attributes:
        ops: op names, in run order (keys of ``ops.COLLECTIVES``).
        sizes: requested row sizes in bytes, ascending.
        iters: timed iterations for small sizes (scaled down for large ones).
        warmup: untimed iterations for small sizes (scaled down for large ones).
        budget_bytes: bytes worth of iterations per op and size before scaling kicks in.
        check: verify each op's result once per size before timing it.
        timeout_s: limit for one run, also the process group's collective timeout.
        max_seconds: cap on the timed loop of one op and size, estimated from the warmup, so a
            slow backend cannot stretch a sweep (at least ``MIN_SCALED_ITERS`` still run).
    """

    ops: tuple[str, ...]
    sizes: tuple[int, ...]
    iters: int
    warmup: int
    budget_bytes: int
    check: bool
    timeout_s: float
    max_seconds: float


@dataclass(frozen=True)
class Measurement:
    """One rank's timings of one op at one size.

    Attributes:
        op: op name.
        size: requested row size in bytes (0 for barrier).
        nbytes: actual row size in bytes after rounding to whole, evenly divided elements.
        warmup: untimed iterations run.
        samples_s: wall time of each timed iteration, in seconds.
    """

    op: str
    size: int
    nbytes: int
    warmup: int
    samples_s: tuple[float, ...]


def load_backend(backend: str) -> None:
    """Make ``backend`` usable by ``init_process_group``, importing its plugin if it has one.

    Raises:
        BackendUnavailable: the plugin cannot be imported or does not register the backend.
    """
    import torch.distributed as dist

    from benchmarks.collectives.errors import BackendUnavailable

    module = PLUGIN_MODULES.get(backend)
    if module is not None:
        try:
            importlib.import_module(module)
        except Exception as exc:  # an ImportError, or the plugin failing while it loads
            raise BackendUnavailable(
                f"backend {backend!r} is unavailable: `import {module}` failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    if backend.lower() not in dist.Backend.backend_list:
        hint = f" although `import {module}` succeeded" if module else ""
        raise BackendUnavailable(
            f"backend {backend!r} is not registered with torch.distributed{hint}"
        )


def _agree_iters(iters: int, warmup_s: float | None, max_seconds: float) -> int:
    """Timed iterations that fit ``max_seconds``, as rank 0 estimates them, on every rank."""
    import torch
    import torch.distributed as dist

    from benchmarks.collectives.sizes import MIN_SCALED_ITERS

    if warmup_s is not None and warmup_s > 0:
        iters = min(iters, max(MIN_SCALED_ITERS, int(max_seconds / warmup_s)))
    # Ranks must run the same count or the loop deadlocks; rank 0's estimate wins.
    count = torch.tensor([float(iters)], dtype=torch.float32)
    dist.broadcast(count, 0)
    return int(count.item())


def _time_one(
    prepared: Any, iters: int, warmup: int, check: bool, max_seconds: float
) -> tuple[float, ...]:
    import torch.distributed as dist

    from benchmarks.collectives.errors import CheckFailed

    if check:
        prepared.run()
        try:
            prepared.verify()
        except AssertionError as exc:
            raise CheckFailed(str(exc)) from exc
    start = time.perf_counter()
    for _ in range(warmup):
        prepared.run()
    warmup_s = (time.perf_counter() - start) / warmup if warmup else None
    iters = _agree_iters(iters, warmup_s, max_seconds)
    # Ranks start the timed loop together, and nobody frees buffers while a peer still times.
    dist.barrier()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        prepared.run()
        samples.append(time.perf_counter() - start)
    dist.barrier()
    return tuple(samples)


def run_rank(
    backend: str,
    plan: Plan,
    report: Callable[[Measurement], None],
) -> None:
    """Join the process group described by the environment and measure ``plan``.

    Args:
        backend: torch.distributed backend name.
        plan: what to measure.
        report: called with each measurement as soon as it is taken, so that a later failure
            keeps the earlier rows.

    Raises:
        BenchmarkError: the backend is unavailable or an op gave a wrong result.
    """
    import torch
    import torch.distributed as dist

    from benchmarks.collectives.ops import COLLECTIVES
    from benchmarks.collectives.sizes import MIN_SCALED_ITERS, format_size, scaled_count

    load_backend(backend)
    # Ranks share few cores; intra-op threads would only fight over them.
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend, timeout=timedelta(seconds=plan.timeout_s))
    try:
        for op_name in plan.ops:
            op = COLLECTIVES[op_name]
            for size in plan.sizes if op.sized else (0,):
                iters = scaled_count(plan.iters, size, plan.budget_bytes, MIN_SCALED_ITERS)
                warmup = scaled_count(plan.warmup, size, plan.budget_bytes // 4, 1)
                prepared = op.prepare(size, rank, world)
                samples = _time_one(prepared, iters, warmup, plan.check, plan.max_seconds)
                report(Measurement(op_name, size, prepared.nbytes, warmup, samples))
                del prepared  # free large buffers before the next size allocates
                if rank == 0:
                    label = format_size(size) if op.sized else "-"
                    median = sorted(samples)[len(samples) // 2]
                    print(
                        f"[{backend} n={world}] {op_name:<14} {label:>9}  {len(samples):>3} iters"
                        f"  median {median * 1e6:10.1f} us (rank 0)",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        dist.destroy_process_group()
