"""The floors under the paired benchmark's figures, measured on the machine that runs it.

- handoff: a word handed between two processes through a shared page, one way, with the
  receiver spinning and with it asleep in a futex (floors.c, compiled here with the system's C
  compiler): the least a collective's synchronisation can cost;
- dispatch: ``dist.all_reduce`` of 4 bytes into a Python ProcessGroup that does nothing and
  returns a completed Work: what torch costs before a Python backend's first line runs;
- memcpy: one core copying each size (floors.c): the least time to move a rank's bytes once.

Where a floor cannot be measured (no C compiler), it is None and the table says why.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

_SOURCE = Path(__file__).with_name("floors.c")
_HANDOFF_ROUNDS = 20000
NOP_BACKEND = "smddp_bench_nop"


def native(sizes: list[int]) -> dict[str, Any]:
    """Handoff and memcpy floors from floors.c.

    Args:
        sizes: byte counts to time memcpy of.

    Returns:
        ``handoff_spin_s``, ``handoff_futex_s`` and ``memcpy_s`` (size as a string -> seconds);
        or ``{"error": why}`` where the program cannot be built or run.
    """
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return {"error": "no C compiler (cc, gcc) to build floors.c"}
    with tempfile.TemporaryDirectory(prefix="smddp-bench-floors-") as d:
        exe = os.path.join(d, "floors")
        built = subprocess.run(
            [cc, "-O2", "-o", exe, str(_SOURCE)], capture_output=True, text=True, check=False
        )
        if built.returncode != 0:
            return {"error": f"floors.c did not build: {built.stderr.strip()[:200]}"}
        ran = subprocess.run(
            [exe, str(_HANDOFF_ROUNDS), *map(str, sizes)],
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
        if ran.returncode != 0:
            return {"error": f"floors exited with {ran.returncode}: {ran.stderr.strip()[:200]}"}
        out: dict[str, Any] = json.loads(ran.stdout)
        return out


def register_nop_backend() -> None:
    """Registers the do-nothing Python backend (idempotent); every rank calls it before
    ``new_group([0], backend=NOP_BACKEND)``."""
    import torch
    import torch.distributed as dist

    if NOP_BACKEND in dist.Backend.backend_list:
        return

    class _Done(dist.Work):
        def wait(self, timeout: Any = None) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

    class _Nop(dist.ProcessGroup):
        def __init__(self, rank: int, size: int) -> None:
            super().__init__(rank, size)  # type: ignore[call-arg, arg-type]
            self._done = _Done()

        def getBackendName(self) -> str:
            return NOP_BACKEND

        def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
            return self._done

    def create(dist_opts: Any, pg_options: Any) -> dist.ProcessGroup:
        return _Nop(dist_opts.group_rank, dist_opts.group_size)

    dist.Backend.register_backend(NOP_BACKEND, create, extended_api=True, devices=["cpu"])


def dispatch(group: Any, calls: int = 20000) -> float:
    """Median seconds of ``dist.all_reduce`` of 4 bytes into ``group`` (the nop backend's),
    over batches of calls."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1, dtype=torch.float32)
    for _ in range(100):
        dist.all_reduce(t, group=group)
    per = max(1, calls // 20)
    batches = []
    for _ in range(20):
        start = time.perf_counter()
        for _ in range(per):
            dist.all_reduce(t, group=group)
        batches.append((time.perf_counter() - start) / per)
    return statistics.median(batches)
