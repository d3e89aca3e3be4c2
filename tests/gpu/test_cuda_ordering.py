"""Stream ordering of GPU ops: the daemon never reads inputs before the rank's stream wrote
them (ready event), a rank's later kernels never read results before the daemon wrote them
(done event), wait() does not block the host on the GPU, side streams and many ops in flight
are ordered too."""

from __future__ import annotations

import pytest
from cuda_world import rank_env, requires_gpu

pytestmark = requires_gpu


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_events_order_the_daemon_and_the_ranks(world: int, daemon, spawn_ranks, tmp_path) -> None:
    from cuda_ranks import ordering_rank

    results = spawn_ranks(
        ordering_rank,
        world,
        world,
        str(tmp_path / "init"),
        0,
        env=rank_env(daemon.socket),
        timeout_s=240,
    ).join()
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures)
    # The call returned while the rank's stream was still sleeping: the host never waited
    # for the GPU, only for the daemon to queue the work.
    for rank, r in enumerate(results):
        assert r["gpu_busy_after_wait"], (
            f"rank {rank}: all_reduce returned only after the GPU was idle ({r['host_wait_s']:.3f} "
            "s)"
        )
