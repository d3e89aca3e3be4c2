"""What one rank of a multi-node failure test runs: ``python failure_rank.py PROGRAM SPEC OUT``.

Started by ``launch_world`` of ``tests/multinode/conftest.py`` in place of its
``rank_main.py`` (same command line, same environment, same result file).

Programs:
- ``until_failure``: all_reduces (checked) until one fails; prints ``ready`` after the
  first; returns the error's class and message and the wall-clock time it was raised.
- ``checked_ops``: a few all_reduces and a broadcast, checked; returns how many ran.
- ``until_stopped``: all_reduces (checked) until the parent writes a line to stdin;
  prints ``ready`` after the first; returns how many ran and when each one ended.
- ``late_rank``: one all_reduce, then rank ``spec["late"]`` sleeps ``spec["late_s"]``
  before the second; returns the second's error class and message.
- ``shrink_on_failure``: all_reduces (checked) until SmddpRankFailedError, then
  ``smddp.shrink_group`` by the failed ranks it names and two checked all_reduces on the
  shrunk default group; returns the failed ranks, generation and timings.
"""

from __future__ import annotations

import json
import pickle
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

N = 65_536  # 256 KiB of float32: one chunk, crossing nodes on every op


def _checked_all_reduce(step: int, n: int = N, dtype: torch.dtype = torch.float32) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((n,), float(rank + step), dtype=dtype)
    dist.all_reduce(t)
    want = float(sum(range(world)) + world * step)
    if not torch.equal(t, torch.full((n,), want, dtype=dtype)):
        raise AssertionError(f"op {step}: wrong result {t[:4].tolist()} instead of {want}")


def until_failure(spec: dict[str, Any]) -> dict[str, Any]:
    from smddp.backend.errors import SmddpBackendError

    step = 0
    deadline = time.monotonic() + spec.get("run_s", 60)
    try:
        _checked_all_reduce(step)
        print("ready", flush=True)
        step = 1
        while time.monotonic() < deadline:
            _checked_all_reduce(step)
            step += 1
    except SmddpBackendError as exc:
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "failed_at": time.time(),
            "ops": step,
            "dist_backend_error": isinstance(exc, dist.DistBackendError),
        }
    return {"type": None, "ops": step}


def until_stopped(spec: dict[str, Any]) -> dict[str, Any]:
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    _checked_all_reduce(0)
    print("ready", flush=True)
    ends = []
    step = 1
    while True:
        _checked_all_reduce(step)
        ends.append(time.time())
        step += 1
        # Every rank stops after the same op: once any of them has read its line.
        flag = torch.tensor([float(stop.is_set())])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            return {"ops": step, "ends": ends}


def checked_ops(spec: dict[str, Any]) -> dict[str, Any]:
    """all_reduces of a few sizes (one crossing several 512 KiB chunks) and dtypes, and a
    broadcast; every result checked."""
    sizes = [7, N, (1 << 20) + 3]
    for step, (n, dtype) in enumerate(
        (n, d) for n in sizes for d in (torch.float32, torch.bfloat16)
    ):
        _checked_all_reduce(step, n, dtype)
    t = torch.arange(1000, dtype=torch.float64) * (dist.get_rank() + 1)
    dist.broadcast(t, src=dist.get_world_size() - 1)
    if not torch.equal(t, torch.arange(1000, dtype=torch.float64) * dist.get_world_size()):
        raise AssertionError("broadcast: wrong result")
    return {"ops": 2 * len(sizes) + 1}


def late_rank(spec: dict[str, Any]) -> dict[str, Any]:
    from smddp.backend.errors import SmddpBackendError

    _checked_all_reduce(0)
    if dist.get_rank() == spec["late"]:
        time.sleep(spec["late_s"])
    try:
        _checked_all_reduce(1)
    except SmddpBackendError as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": None}


def shrink_on_failure(spec: dict[str, Any]) -> dict[str, Any]:
    """all_reduces (checked) until one fails with SmddpRankFailedError, shrinks the default
    group by the failed ranks it names, and all_reduces (checked) twice on the new group;
    returns the failure as it was told and what the new group is."""
    import os

    import smddp
    from smddp.backend.errors import SmddpRankFailedError

    _checked_all_reduce(0)
    print(f"pid {os.getpid()}", flush=True)
    print("ready", flush=True)
    step = 1
    try:
        while True:
            _checked_all_reduce(step)
            step += 1
    except SmddpRankFailedError as exc:
        failed_at = time.time()
        told = {"failed": sorted(exc.failed_ranks), "generation": exc.generation}
        told["message"] = str(exc)
    smddp.shrink_group(told["failed"])
    _checked_all_reduce(1000)
    first_op_at = time.time()
    _checked_all_reduce(1001)
    return {
        **told,
        "failed_at": failed_at,
        "first_op_at": first_op_at,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
    }


PROGRAMS = {
    "shrink_on_failure": shrink_on_failure,
    "until_failure": until_failure,
    "until_stopped": until_stopped,
    "checked_ops": checked_ops,
    "late_rank": late_rank,
}


def main() -> None:
    program, spec_path, out_path = sys.argv[1:4]
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        import smddp  # noqa: F401  (registers the backend)

        torch.set_num_threads(1)
        dist.init_process_group("smddp", timeout=timedelta(seconds=spec.get("pg_timeout_s", 60)))
        result = PROGRAMS[program](spec)
        started = time.monotonic()
        dist.destroy_process_group()
        result["destroy_s"] = time.monotonic() - started
    except BaseException:
        with open(out_path, "wb") as f:
            pickle.dump({"error": traceback.format_exc()}, f)
        sys.exit(1)
    with open(out_path, "wb") as f:
        pickle.dump({"result": result}, f)


if __name__ == "__main__":
    main()
