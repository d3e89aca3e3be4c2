"""CUDA tensors on a torch without CUDA: every collective says so clearly and sends nothing.

torch here may be a CPU-only build, where no real CUDA tensor can exist; FakeTensorMode
makes tensors that claim to be on ``cuda:0``, which is all the backend's routing looks at.
On a machine with CUDA, tests/gpu covers the real thing.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CUDA is available: tests/gpu covers GPU tensors"
)


def fake_cuda(*shape: int, dtype=None):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return torch.ones(*shape, device="cuda", dtype=dtype or torch.float32)


def test_routing_sees_cuda_tensors_anywhere_in_the_arguments() -> None:
    from smddp.backend.cuda import on_cuda

    cpu = torch.ones(2)
    gpu = fake_cuda(2)
    assert on_cuda(gpu) and on_cuda([cpu, gpu]) and on_cuda(cpu, [[cpu, gpu]])
    assert not on_cuda(cpu) and not on_cuda([cpu], [[cpu]]) and not on_cuda([])


def every_collective_refuses(rank: int, world: int, init_file: str) -> list[str]:
    """Calls each collective with fake CUDA tensors; returns the error messages."""
    import torch.distributed as dist

    import smddp  # noqa: F401

    dist.init_process_group("smddp", init_method=f"file://{init_file}", rank=rank, world_size=world)
    t = fake_cuda(8)
    # The process group's own methods (what torch's dispatcher calls); some torch.distributed
    # wrappers query the CUDA device themselves first, which a CPU-only torch cannot.
    pg = dist.group.WORLD
    c10d = dist.distributed_c10d
    calls = {
        "all_reduce (torch.distributed)": lambda: dist.all_reduce(t),
        "allreduce": lambda: pg.allreduce([t]),
        "broadcast": lambda: pg.broadcast([t], c10d.BroadcastOptions()),
        "reduce": lambda: pg.reduce([t], c10d.ReduceOptions()),
        "allgather": lambda: pg.allgather(
            [[fake_cuda(8) for _ in range(world)]], [t], c10d.AllgatherOptions()
        ),
        "_allgather_base": lambda: pg._allgather_base(
            fake_cuda(8 * world), t, c10d.AllgatherOptions()
        ),
        "_reduce_scatter_base": lambda: pg._reduce_scatter_base(
            t, fake_cuda(8 * world), c10d.ReduceScatterOptions()
        ),
        "alltoall_base": lambda: pg.alltoall_base(fake_cuda(8), t, [], [], c10d.AllToAllOptions()),
        "send": lambda: pg.send([t], 1 - rank, 0),
        "recv": lambda: pg.recv([t], 1 - rank, 0),
        "mixed": lambda: pg.allgather(
            [[torch.ones(8) for _ in range(world)]], [t], c10d.AllgatherOptions()
        ),
    }
    messages = []
    for name, call in calls.items():
        try:
            call()
            messages.append(f"{name}: no error")
        except ValueError as exc:  # UnsupportedError is a ValueError
            messages.append(f"{name}: {type(exc).__name__}: {exc}")
    # Nothing was sent: the communicator is healthy and numbers its next op #1.
    x = torch.full((4,), float(rank + 1))
    dist.all_reduce(x)
    assert x.tolist() == [float(sum(range(1, world + 1)))] * 4
    dist.destroy_process_group()
    return messages


@pytest.mark.timeout(120)
def test_cuda_tensors_without_cuda_are_refused_before_anything_is_sent(
    daemon, spawn_ranks, tmp_path
) -> None:
    env = dict(os.environ, SMDDP_SOCKET=daemon.socket, SMDDP_EMBEDDED="0")
    results = spawn_ranks(every_collective_refuses, 2, 2, str(tmp_path / "init"), env=env).join()
    for messages in results:
        for line in messages:
            assert "UnsupportedError" in line, line
            assert "this torch build has no usable CUDA" in line, line
            assert "smddp needs a CUDA build of torch and a GPU" in line, line
