"""DistributedDataParallel with device_ids on CUDA tensors over smddp: several ranks sharing
one GPU train like a local reference that averages every rank's gradients, and every rank
ends with the same bits."""

from __future__ import annotations

import pytest
from cuda_world import layouts, rank_env, requires_gpu, worlds

pytestmark = requires_gpu


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", worlds(2, 3))
def test_ddp_on_cuda_trains_like_the_reference(world: int, daemon, spawn_ranks, tmp_path) -> None:
    import torch
    from cuda_ranks import ddp_rank

    for k, devices in enumerate(layouts(world)):
        results = spawn_ranks(
            ddp_rank,
            world,
            world,
            str(tmp_path / f"init{k}"),
            devices,
            5,
            env=rank_env(daemon.socket),
            timeout_s=240,
        ).join()
        first = results[0]["params"]
        for rank, r in enumerate(results):
            assert all(torch.equal(a, b) for a, b in zip(first, r["params"])), (
                f"rank {rank} differs from rank 0"
            )
            for a, b in zip(r["params"], r["reference"]):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
            assert r["losses"][-1] < r["losses"][0], f"rank {rank} did not learn: {r['losses']}"
