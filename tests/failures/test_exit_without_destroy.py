"""A script that never calls ``destroy_process_group`` exits 0 under torchrun, every time.

The script is the exit soak's worker (``scripts/exit_soak.py``): collectives, a DDP step, a
large async all_reduce of a non-contiguous tensor whose Future is taken (the completer
thread copies its result back, a torch call that releases the GIL, after the script's next
all_reduce has returned), an async all_reduce left in flight on the progress thread, a
success line per rank, and the end of the script. Before ``backend/exit_gate.py`` the
completer was still inside torch when the interpreter finalized and the rank aborted
(SIGABRT, "terminate called without an active exception"): every run failed (3 of 3
under the embedded daemon, 1 of 1 under a system daemon), each after every rank had printed
its success line.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
RUNS = 2  # each failed on the old code: two runs, and one more under a system daemon


def _soak() -> Any:
    spec = importlib.util.spec_from_file_location("exit_soak", REPO / "scripts" / "exit_soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def _runs(tmp_path: Path, socket_path: str, runs: int) -> None:
    soak = _soak()
    script = soak.write_worker(tmp_path)
    env = soak.soak_env(socket_path)
    env["PYTHONPATH"] = str(REPO)
    failed = []
    for i in range(runs):
        result = soak.run_once(i, script, env, tmp_path)
        if not result.ok:
            failed.append(soak.report(result))
    assert not failed, f"{len(failed)} of {runs} runs failed:\n" + "\n".join(failed)


@pytest.mark.timeout(600)
def test_exit_without_destroy_embedded_daemon(tmp_path: Path) -> None:
    # No daemon answers there: each run's local rank 0 starts an embedded one.
    _runs(tmp_path, str(tmp_path / "absent.sock"), RUNS)


@pytest.mark.timeout(600)
def test_exit_without_destroy_system_daemon(tmp_path: Path, daemon_at: Callable[..., Any]) -> None:
    socket_path = str(tmp_path / "system.sock")
    daemon_at(socket_path)
    _runs(tmp_path, socket_path, 1)
