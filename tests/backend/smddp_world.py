"""Runs a function on every rank of a fresh "smddp" world and brings the results back.

``run_world(n, fn)`` spawns ``n`` processes (start method spawn), each of which imports
smddp, joins ``init_process_group("smddp")`` over a free TCP port, calls ``fn(rank, n)``
and reports its return value, or its traceback, on a multiprocessing queue. No daemon is
configured, so rank 0 starts the job's embedded one. The first rank that raises, dies or
stays silent past the deadline fails the run at once with what it said; the other ranks
are then killed instead of being left waiting for it.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp
from ports import free_port

# The process group's timeout: a stuck collective fails well inside the test's own timeout.
PG_TIMEOUT_S = 60.0


class WorldFailure(AssertionError):
    """A rank of the world raised, died or never reported; the message carries its traceback."""


def _entry(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[[int, int], Any],
    env: Mapping[str, str],
    results: Any,
    pg_timeout_s: float,
) -> None:
    try:
        os.environ.update(env)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch
        import torch.distributed as dist

        # Several ranks share few cores: intra-op thread pools would only fight each other.
        torch.set_num_threads(1)

        import smddp  # noqa: F401  (registers the backend)

        dist.init_process_group(
            "smddp", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
        )
        value = fn(rank, world_size)
        dist.destroy_process_group()
        results.put(("ok", rank, value))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


def run_world(
    world_size: int,
    fn: Callable[[int, int], Any],
    env: Mapping[str, str] | None = None,
    timeout_s: float = 120.0,
    pg_timeout_s: float = PG_TIMEOUT_S,
) -> list[Any]:
    """Runs ``fn(rank, world_size)`` on every rank of a new smddp world.

    Args:
        world_size: number of processes.
        fn: a module-level function (it is pickled by name into the spawned processes).
        env: extra environment variables for the ranks.
        timeout_s: the whole run's deadline.
        pg_timeout_s: the default process group's timeout.

    Returns:
        The ranks' return values, indexed by rank.

    Raises:
        WorldFailure: a rank raised (its traceback is in the message), died, or the
            deadline passed.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    # No daemon answers at this socket, so every world runs on its own embedded daemon.
    nowhere_dir = tempfile.mkdtemp(prefix="smddp-test-")
    nowhere = os.path.join(nowhere_dir, "absent.sock")
    full_env = {"SMDDP_SOCKET": nowhere, **(env or {})}
    procs = [
        ctx.Process(
            target=_entry,
            args=(r, world_size, port, fn, full_env, results, pg_timeout_s),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            try:
                kind, rank, payload = results.get(timeout=0.5)
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in values
                ]
                if dead:
                    time.sleep(0.5)  # a report may still be in the queue's pipe
                    if results.empty():
                        codes = ", ".join(f"rank {r}: exit code {procs[r].exitcode}" for r in dead)
                        raise WorldFailure(
                            f"world of {world_size}: a rank died without reporting ({codes})"
                        ) from None
                    continue
                if time.monotonic() > deadline:
                    silent = sorted(set(range(world_size)) - set(values))
                    raise WorldFailure(
                        f"world of {world_size}: ranks {silent} did not finish within "
                        f"{timeout_s:.0f} s"
                    ) from None
                continue
            if kind == "error":
                raise WorldFailure(f"world of {world_size}: rank {rank} raised:\n{payload}")
            values[rank] = payload
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        shutil.rmtree(nowhere_dir, ignore_errors=True)
    return [values[r] for r in range(world_size)]
