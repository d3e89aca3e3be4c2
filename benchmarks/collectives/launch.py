"""Starting one process group's ranks on this node and collecting what they measure.

``run_single_node`` is the only place that knows ranks are local processes. A multi-node mode
would sit beside it: each node's ranks started by torchrun call ``worker.run_rank`` directly and
rank 0 gathers the measurements; everything downstream takes the same ``RunResult``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from benchmarks.collectives.errors import BenchmarkError
from benchmarks.collectives.worker import Measurement, Plan, run_rank

MASTER_ADDR = "127.0.0.1"
# How long a dead rank's last messages may take to arrive before it counts as crashed.
_DEATH_GRACE_S = 2.0
_POLL_S = 0.2


@dataclass
class RunResult:
    """Everything one backend run (one process group) produced.

    Attributes:
        backend: torch.distributed backend name.
        world_size: number of ranks.
        measurements: per rank, its measurements in the order taken.
        error: why the run stopped early, or ``None`` when every rank finished.
        elapsed_s: wall time of the run including process start-up.
    """

    backend: str
    world_size: int
    measurements: dict[int, list[Measurement]] = field(default_factory=dict)
    error: str | None = None
    elapsed_s: float = 0.0


def free_port() -> int:
    """A TCP port on ``MASTER_ADDR`` that was free a moment ago (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((MASTER_ADDR, 0))
        return int(sock.getsockname()[1])


def _rank_main(backend: str, rank: int, world: int, port: int, plan: Plan, out: Any) -> None:
    """Body of one spawned rank: set the rendezvous variables, run, and report to the parent."""
    os.environ.update(
        MASTER_ADDR=MASTER_ADDR,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    try:
        run_rank(backend, plan, lambda m: out.put(("measurement", rank, m)))
    except BenchmarkError as exc:
        out.put(("error", rank, f"{backend} n={world} rank {rank}: {exc}"))
    except BaseException:
        out.put(("error", rank, f"{backend} n={world} rank {rank}:\n{traceback.format_exc()}"))
    else:
        out.put(("done", rank, None))


def run_single_node(backend: str, world_size: int, plan: Plan) -> RunResult:
    """Spawn ``world_size`` local ranks of one ``backend`` process group and run ``plan``.

    Never raises for a failing backend: a rank's exception, a crashed rank or the run exceeding
    ``plan.timeout_s`` ends the run, kills the remaining ranks and is returned as ``error``
    together with the measurements that were complete by then.

    Args:
        backend: torch.distributed backend name (its plugin is imported by each rank).
        world_size: number of ranks to start.
        plan: what to measure.

    Returns:
        The run's measurements and error.
    """
    ctx = mp.get_context("spawn")
    inbox = ctx.Queue()
    port = free_port()
    result = RunResult(backend, world_size, {r: [] for r in range(world_size)})
    started = time.monotonic()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(backend, rank, world_size, port, plan, inbox),
            name=f"bench-{backend}-{rank}",
        )
        for rank in range(world_size)
    ]
    failed = True
    try:
        for proc in procs:
            proc.start()
        _collect(procs, inbox, result, started, plan.timeout_s)
        failed = result.error is not None
    finally:
        _stop(procs, kill=failed)
    result.elapsed_s = time.monotonic() - started
    return result


def _collect(
    procs: list[Any], inbox: Any, result: RunResult, started: float, timeout_s: float
) -> None:
    """Receive the ranks' messages into ``result`` until all finish or the run fails."""
    world_size = len(procs)
    backend = result.backend
    done: set[int] = set()
    dead_since: dict[int, float] = {}
    while len(done) < world_size and result.error is None:
        try:
            kind, rank, payload = inbox.get(timeout=_POLL_S)
        except queue.Empty:
            now = time.monotonic()
            if now - started > timeout_s:
                result.error = f"{backend} n={world_size}: timed out after {timeout_s:.0f} s"
            for rank, proc in enumerate(procs):
                if rank not in done and proc.exitcode is not None:
                    since = dead_since.setdefault(rank, now)
                    if now - since > _DEATH_GRACE_S:
                        result.error = (
                            f"{backend} n={world_size} rank {rank}: "
                            f"exited with code {proc.exitcode} without reporting"
                        )
            continue
        if kind == "measurement":
            result.measurements[rank].append(payload)
        elif kind == "done":
            done.add(rank)
        else:
            result.error = payload


def _stop(procs: list[Any], kill: bool) -> None:
    """Reap the ranks; after a failure the survivors are usually stuck in a collective."""
    started = [proc for proc in procs if proc.pid is not None]
    if kill:
        for proc in started:
            if proc.is_alive():
                proc.terminate()
    for proc in started:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
