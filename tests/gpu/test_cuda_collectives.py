"""Every collective x dtype on CUDA tensors, 2 to 4 ranks sharing one GPU (and spread over
GPUs where there are several), bitwise against the host path; one large all_reduce cut
into several kernel launches."""

from __future__ import annotations

import pytest
from cuda_world import layouts, rank_env, requires_gpu, worlds

pytestmark = requires_gpu


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", worlds(2, 3, 4))
def test_every_collective_and_dtype(world: int, daemon, spawn_ranks, tmp_path) -> None:
    from cuda_ranks import collectives_rank

    for k, devices in enumerate(layouts(world)):
        ranks = spawn_ranks(
            collectives_rank,
            world,
            world,
            str(tmp_path / f"init{k}"),
            devices,
            [1, 1003],
            env=rank_env(daemon.socket),
            timeout_s=480,
        )
        failures = [f for result in ranks.join() for f in result]
        assert not failures, f"ranks on GPUs {devices}:\n" + "\n".join(failures[:40])


@pytest.mark.timeout(300)
def test_a_large_all_reduce_in_several_launches(start_daemon, spawn_ranks, tmp_path) -> None:
    import os

    from cuda_ranks import large_rank

    env = dict(os.environ, SMDDP_GPU_CHUNK_BYTES=str(4 << 20))  # 64 MiB ops: 16 launches each
    daemon = start_daemon(env=env)
    n = (16 << 20) + 3  # not a whole number of vectors
    ranks = spawn_ranks(
        large_rank, 3, 3, str(tmp_path / "init"), 0, n, env=rank_env(daemon.socket), timeout_s=240
    )
    failures = [f for result in ranks.join() for f in result]
    assert not failures, "\n".join(failures)
