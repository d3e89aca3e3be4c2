"""A rank that dies in the middle of GPU ops: the others fail within seconds naming it, the
daemon survives, and a new job's GPU ops on the same daemon work."""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest
from cuda_world import measure, rank_env, requires_gpu

pytestmark = requires_gpu

WORLD = 3
VICTIM = 2
BOUND_S = 10.0


@pytest.mark.timeout(300)
def test_a_rank_killed_mid_op(daemon, spawn_ranks, tmp_path) -> None:
    from cuda_ranks import after_death_rank, dying_world_rank

    env = rank_env(daemon.socket)
    ranks = spawn_ranks(
        dying_world_rank, WORLD, WORLD, str(tmp_path / "init"), 0, VICTIM, env=env, timeout_s=120
    )
    ranks.wait_for("ready")
    time.sleep(0.5)  # well inside the loop of large GPU all_reduces
    victim = ranks.ranks[VICTIM]
    pid = victim.printed_pid()
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    victim.proc.wait()
    results = []
    for r in ranks.ranks:
        if r.rank == VICTIM:
            continue
        r.proc.wait(timeout=60)
        assert r.proc.returncode == 0, r.failure()
        with open(r.folder / "result", "rb") as f:
            results.append(pickle.load(f))
    measure(
        f"killed rank (SIGKILL mid-op, {WORLD} ranks on one GPU): survivors raised "
        + ", ".join(f"{g['type']} after {g['failed_at'] - killed_at:.2f} s" for g in results)
    )
    for got in results:
        assert got["type"] == "SmddpRankFailedError", got
        assert f"rank {VICTIM} (pid {pid}" in got["message"], got["message"]
        assert got["failed_at"] - killed_at < BOUND_S, got
    assert daemon.proc.poll() is None, f"smddpd died:\n{daemon.log()}"
    # The daemon's GPU side still works for a new job.
    failures = spawn_ranks(
        after_death_rank, 2, 2, str(tmp_path / "init2"), 0, env=env, timeout_s=120
    ).join()
    measure(
        "killed rank: the daemon "
        + ("is alive" if daemon.proc.poll() is None else "DIED")
        + "; a new job's GPU all_reduce on it "
        + ("is right" if not [f for result in failures for f in result] else "FAILED")
    )
    assert not [f for result in failures for f in result]
