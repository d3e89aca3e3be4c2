"""DTensor, torch's functional collectives (eager and under torch.compile), the coalescing
manager and all_gather_coalesced on backend "smddp".

torch.compile runs with backend "aot_eager": Dynamo and AOTAutograd trace the functional
collectives into the graph (c10d_functional ops and wait_tensor) as inductor does; inductor
itself would add a C++ build per rank that took over 10 minutes on the shared 2-core CI host.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from smddp_world import run_world  # noqa: E402

WORLD = 3


def _full(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def dtensor_rank(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    a, b = _full(1, 6, 4), _full(2, 4, 9)
    da = distribute_tensor(a, mesh, [Shard(0)])
    assert da.to_local().shape == (2, 4)
    assert torch.equal(da.full_tensor(), a)  # all_gather_into_tensor
    assert torch.equal(da.redistribute(mesh, [Shard(1)]).full_tensor(), a)  # all_to_all
    db = distribute_tensor(b, mesh, [Replicate()])
    torch.testing.assert_close((da @ db).full_tensor(), a @ b)
    # Partial -> Replicate is an all_reduce, Partial -> Shard a reduce_scatter.
    part = torch.distributed.tensor.DTensor.from_local(
        torch.full((3, 6), float(rank + 1)), mesh, [Partial()]
    )
    total = float(sum(range(1, world + 1)))
    assert torch.equal(part.redistribute(mesh, [Replicate()]).to_local(), torch.full((3, 6), total))
    assert torch.equal(part.redistribute(mesh, [Shard(1)]).to_local(), torch.full((3, 2), total))
    s = (da * 2).sum()  # a reduction across shards
    torch.testing.assert_close(s.full_tensor(), (a * 2).sum())
    return ["ok"]


def _funcol_ops(x: torch.Tensor, group: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import torch.distributed._functional_collectives as funcol

    gathered = funcol.all_gather_tensor(x, 0, group)
    scattered = funcol.reduce_scatter_tensor(gathered * 2, "sum", 0, group)
    reduced = funcol.all_reduce(x + 1, "sum", group)
    return gathered, scattered, reduced


def funcol_rank(rank: int, world: int, compiled: str | None) -> list[str]:
    import torch.distributed as dist

    group = dist.group.WORLD
    fn = (
        _funcol_ops
        if compiled is None
        else torch.compile(_funcol_ops, backend=compiled, fullgraph=True)
    )
    x = torch.arange(4, dtype=torch.float32) + 10 * rank
    gathered, scattered, reduced = fn(x, group)
    everyone = torch.cat([torch.arange(4, dtype=torch.float32) + 10 * r for r in range(world)])
    assert torch.equal(gathered, everyone), gathered
    assert torch.equal(scattered, everyone.reshape(world, 4)[rank] * 2 * world), scattered
    assert torch.equal(
        reduced, sum(torch.arange(4, dtype=torch.float32) + 10 * r + 1 for r in range(world))
    ), reduced
    return ["ok"]


def funcol_eager(rank: int, world: int) -> list[str]:
    return funcol_rank(rank, world, None)


def funcol_aot_eager(rank: int, world: int) -> list[str]:
    return funcol_rank(rank, world, "aot_eager")


def coalesced_rank(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    # all_gather_coalesced: output_lists[r][i] is rank r's input i.
    ins = [torch.full((2,), float(rank)), torch.full((3, 2), float(10 + rank))]
    outs = [[torch.empty_like(t) for t in ins] for _ in range(world)]
    dist.all_gather_coalesced(outs, ins)
    for r in range(world):
        assert torch.equal(outs[r][0], torch.full((2,), float(r)))
        assert torch.equal(outs[r][1], torch.full((3, 2), float(10 + r)))
    # The coalescing manager's fast path (no device): all_reduce, all_gather_into_tensor,
    # reduce_scatter_tensor batched into one call each.
    a, b = torch.ones(5) * rank, torch.ones(2) * (rank + 1)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    assert torch.equal(a, torch.full((5,), float(sum(range(world)))))
    assert torch.equal(b, torch.full((2,), float(sum(range(1, world + 1)))))
    src = [torch.full((2,), float(rank + i)) for i in range(2)]
    dst = [torch.empty(2 * world) for _ in range(2)]
    with dist._coalescing_manager():
        for s, d in zip(src, dst):
            dist.all_gather_into_tensor(d, s)
    for i in range(2):
        assert torch.equal(
            dst[i], torch.cat([torch.full((2,), float(r + i)) for r in range(world)])
        )
    big = [torch.arange(3 * world, dtype=torch.float32) * (i + 1) for i in range(2)]
    small = [torch.empty(3) for _ in range(2)]
    with dist._coalescing_manager():
        for s, d in zip(big, small):
            dist.reduce_scatter_tensor(d, s)
    for i in range(2):
        assert torch.equal(small[i], big[i][3 * rank : 3 * rank + 3] * world)
    # With a device (NCCL style): ops run as they come; the block's Work waits for them all.
    c = torch.zeros(4) if rank else torch.arange(4, dtype=torch.float32)
    d = torch.ones(3)
    with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        dist.broadcast(c, 0)
        dist.all_reduce(d)
    cm.wait()
    assert torch.equal(c, torch.arange(4, dtype=torch.float32)), c
    assert torch.equal(d, torch.full((3,), float(world))), d
    return ["ok"]


@pytest.mark.timeout(300)
def test_dtensor_ops() -> None:
    assert run_world(WORLD, dtensor_rank, timeout_s=280) == [["ok"]] * WORLD


@pytest.mark.timeout(300)
def test_functional_collectives_eager() -> None:
    assert run_world(WORLD, funcol_eager, timeout_s=280) == [["ok"]] * WORLD


@pytest.mark.timeout(400)
def test_functional_collectives_compiled_aot_eager() -> None:
    assert run_world(WORLD, funcol_aot_eager, timeout_s=380) == [["ok"]] * WORLD


@pytest.mark.timeout(300)
def test_coalesced_collectives_and_coalescing_manager() -> None:
    assert run_world(WORLD, coalesced_rank, timeout_s=280) == [["ok"]] * WORLD
