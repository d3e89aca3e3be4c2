"""The GPU rank programs without a GPU: on the CPU (the host path), and on the fake GPU
through every layer of the GPU path.

The fake GPU (tests/gpu/fake_device.py, SMDDP_TEST_CUDA_DEVICE) gives the ranks tensors
in host shared memory; a real smddpd runs their GPU ops on its fake runtime
(tests/server/gpu_fakes.py:ipc_runtime, SMDDP_TEST_GPU_RUNTIME), whose reductions run the
generated kernels' code (interpreted). So backend/cuda.py -> client/cuda_ops.py and
cuda_ipc.py -> the daemon's GPU branches and server/gpu.py -> back run for every
collective over real processes, checked bitwise against the host path. What only a GPU
shows (streams really running concurrently, CUDA IPC itself, the PTX) is not checked here.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FAKE_DEVICE = f"{HERE / 'fake_device.py'}:get"
FAKE_RUNTIME = f"{HERE.parent / 'server' / 'gpu_fakes.py'}:ipc_runtime"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2])
def test_the_gpu_rank_programs_run_on_the_cpu(world: int, daemon, spawn_ranks, tmp_path) -> None:
    """cuda_ranks' programs with device -1 (CPU tensors, the host path): the programs
    themselves and their expectations are right before any GPU runs them."""
    from cuda_ranks import CPU, collectives_rank, ddp_rank

    env = dict(os.environ, SMDDP_SOCKET=daemon.socket, SMDDP_EMBEDDED="0")
    results = spawn_ranks(
        collectives_rank,
        world,
        world,
        str(tmp_path / "init"),
        [CPU] * world,
        [1, 1003],
        env=env,
        timeout_s=240,
    ).join()
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures[:40])
    ddp = spawn_ranks(
        ddp_rank,
        world,
        world,
        str(tmp_path / "init-ddp"),
        [CPU] * world,
        3,
        env=env,
        timeout_s=240,
    ).join()
    import torch

    for r in ddp:
        assert all(torch.equal(a, b) for a, b in zip(ddp[0]["params"], r["params"]))
        for a, b in zip(r["params"], r["reference"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [3])
def test_every_collective_through_a_real_daemon_on_the_fake_gpu(
    world: int, start_daemon, spawn_ranks, tmp_path
) -> None:
    from cuda_ranks import fake_gpu_rank

    daemon = start_daemon(env=dict(os.environ, SMDDP_TEST_GPU_RUNTIME=FAKE_RUNTIME))
    env = dict(
        os.environ,
        SMDDP_SOCKET=daemon.socket,
        SMDDP_EMBEDDED="0",
        SMDDP_TEST_CUDA_DEVICE=FAKE_DEVICE,
    )
    results = spawn_ranks(
        fake_gpu_rank, world, world, str(tmp_path / "init"), [1, 1003], env=env, timeout_s=360
    ).join()
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:40])
    assert "runs GPU ops on the TEST runtime" in daemon.log()
    for rank, r in enumerate(results):
        # The GPU path ran: allocations exported over "CUDA IPC", the stream waited on the
        # daemon's done event of every op, each recorded by the daemon before its reply.
        recorded, unrecorded = r["done_waits"]
        assert r["exports"] > 0 and recorded > 100 and unrecorded == 0, r
        assert r["work_type"] == "GpuWork" and r["is_gpu_work"]
        assert r["future_value_is_x"], f"rank {rank}: get_future() gave other tensors"
        assert r["capture"].startswith(
            "UnsupportedError: all_reduce: smddp cannot run inside CUDA graph capture"
        ), r["capture"]
        assert "the stream cannot wait on the daemon's done event" in r["fence"], r["fence"]
        assert "illegal memory access" in r["fence"]


@pytest.mark.timeout(300)
def test_a_freed_allocation_is_unmapped_by_the_rank_s_next_op(
    start_daemon, spawn_ranks, tmp_path
) -> None:
    """Close before free through every layer: the fake allocator's free count moves, the
    exporter finds the allocation gone, the next op tells the daemon, whose fake runtime
    has unmapped it by the time that op completes."""
    from cuda_ranks import free_rank

    daemon = start_daemon(env=dict(os.environ, SMDDP_TEST_GPU_RUNTIME=FAKE_RUNTIME))
    env = dict(
        os.environ,
        SMDDP_SOCKET=daemon.socket,
        SMDDP_EMBEDDED="0",
        SMDDP_TEST_CUDA_DEVICE=FAKE_DEVICE,
    )
    results = spawn_ranks(free_rank, 2, 2, str(tmp_path / "init"), env=env, timeout_s=240).join()
    for rank, r in enumerate(results):
        assert not r["failures"], r["failures"]
        assert not r["closed_before"], f"rank {rank}: unmapped before the daemon was told"
        assert r["closed_after"], f"rank {rank}: the freed allocation is still mapped"


@pytest.mark.timeout(300)
def test_close_before_free_through_the_allocator_hook_s_entry_point(
    start_daemon, spawn_ranks, tmp_path
) -> None:
    """The hook's C library on a real daemon's free channel: the daemon has unmapped a
    segment when the hook's call returns, the next op maps it afresh (right bits); a
    stopped daemon makes the call return after the bound with a log line."""
    from cuda_ranks import free_hook_rank

    from smddp.backend import cuda_free_hook

    library = cuda_free_hook.compile_library(cuda_free_hook.CHANNEL_SOURCES, tmp_path)
    daemon = start_daemon(env=dict(os.environ, SMDDP_TEST_GPU_RUNTIME=FAKE_RUNTIME))
    env = dict(
        os.environ,
        SMDDP_SOCKET=daemon.socket,
        SMDDP_EMBEDDED="0",
        SMDDP_TEST_CUDA_DEVICE=FAKE_DEVICE,
        SMDDP_FREE_WAIT_MS="1500",
    )
    results = spawn_ranks(
        free_hook_rank,
        2,
        2,
        str(tmp_path / "init"),
        str(library),
        daemon.proc.pid,
        env=env,
        timeout_s=240,
    ).join()
    for rank, r in enumerate(results):
        assert not r["failures"], r["failures"]
        assert r["installed"] and r["watched"] >= 1, r
        assert r["code"] == cuda_free_hook.FreeChannel.CLOSED, r
        assert r["closed_at_return"], f"rank {rank}: still mapped when the hook's call returned"
        assert r["reopened"] == 1, f"rank {rank}: the next op did not map it afresh: {r}"
    r0 = results[0]
    assert r0["stopped_code"] == cuda_free_hook.FreeChannel.TIMEOUT, r0
    assert 1.4 <= r0["stopped_s"] < 10, r0
    assert "did not confirm unmapping GPU segment" in r0["stopped_log"], r0["stopped_log"]
    assert "within 1500 ms; freeing it anyway" in r0["stopped_log"]
    # The stopped request's late answer was dropped; the next call got its own.
    assert r0["after_code"] in (cuda_free_hook.FreeChannel.CLOSED,), r0
    assert r0["stats"]["timeouts"] == 1 and r0["stats"]["failed"] == 0, r0
