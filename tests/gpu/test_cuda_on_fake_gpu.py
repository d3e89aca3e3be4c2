"""The GPU rank programs without a GPU: on the CPU (the host path), and on the fake GPU
through every layer of the GPU path.

The fake GPU (tests/gpu/fake_device.py, given to the backend by cuda_ranks.init) gives the
ranks tensors in host shared memory; a real smddpd runs their GPU ops on its fake runtime
(tests/server/gpu_fakes.py:ipc_runtime, given by tests/gpu/fake_smddpd.py), whose reductions
run the generated kernels' code (interpreted). So backend/cuda.py -> client/cuda_ops.py and
cuda_ipc.py -> the daemon's GPU branches and server/gpu.py -> back run for every collective
over real processes, checked bitwise against the host path. What only a GPU shows (streams
really running concurrently, CUDA IPC itself, the PTX) is not checked here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
FAKE_RUNTIME = f"{HERE.parent / 'server' / 'gpu_fakes.py'}:ipc_runtime"
# smddpd with FAKE_RUNTIME given to its constructor (start_daemon's ``command``).
FAKE_SMDDPD = (sys.executable, str(HERE / "fake_smddpd.py"), FAKE_RUNTIME)


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

    daemon = start_daemon(command=FAKE_SMDDPD)
    env = dict(
        os.environ,
        SMDDP_SOCKET=daemon.socket,
        SMDDP_EMBEDDED="0",
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

    daemon = start_daemon(command=FAKE_SMDDPD)
    env = dict(
        os.environ,
        SMDDP_SOCKET=daemon.socket,
        SMDDP_EMBEDDED="0",
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
    daemon = start_daemon(command=FAKE_SMDDPD)
    env = dict(
        os.environ,
        SMDDP_SOCKET=daemon.socket,
        SMDDP_EMBEDDED="0",
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


def restart_rank(
    rank: int, world: int, init_first: str, init_second: str, library: str
) -> dict[str, Any]:
    """The free channel follows the process's daemon (run by the test below, which kills
    smddpd and starts a new one on the same socket when every rank has printed
    ``restart-me``). The hook's C library (the channel alone, built by the test) is
    installed as ``backend/cuda.py`` installs it, and frees are announced through the entry
    point torch's tracker calls."""
    import ctypes
    import logging
    import sys

    sys.path.insert(0, str(HERE))
    import cuda_ranks
    import torch
    import torch.distributed as dist
    from cuda_ranks import FAKE, Checker, host_reduce, host_values, init, to_torch

    from smddp.backend import cuda_free_hook
    from smddp.v1 import smddp_pb2 as pb

    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger("smddp.backend.cuda_free_hook")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    builds: list[int] = []

    def load() -> ctypes.CDLL:
        builds.append(1)
        return ctypes.CDLL(library)

    out: dict[str, Any] = {}
    check = Checker(rank)

    def reduced(salt: int) -> torch.Tensor:
        """A tensor on the fake GPU, all-reduced (so smddpd has its allocation mapped)."""
        x = to_torch(host_values(rank, 513, torch.float32, salt=salt), torch.device("cpu"))
        dist.all_reduce(x)
        want = [host_values(r, 513, torch.float32, salt=salt) for r in range(world)]
        check.same(f"all_reduce (salt {salt})", x, host_reduce(want, pb.SUM))
        return x

    def free(x: torch.Tensor, channel: cuda_free_hook.FreeChannel) -> tuple[int, bool]:
        """What the allocator's tracker does for x's segment: (its code, unmapped then)."""
        fake = cuda_ranks._fake
        (alloc,) = [a for a in fake.allocations if a.base <= x.data_ptr() < a.base + a.size]
        code = channel.segment_free(alloc.base, alloc.size)
        return code, os.path.exists(alloc.path + ".closed")

    def install() -> cuda_free_hook.FreeChannel | None:
        comm = dist.group.WORLD.comm  # the world is the SmddpProcessGroup itself
        return cuda_free_hook.install(comm.session, comm.cuda.exporter, comm.config, library=load)

    # The first daemon: the group's first op maps x, then the hook is installed (as on the
    # first GPU group of a process) and x's free is closed before it happens.
    init(rank, world, init_first, FAKE)
    x = reduced(0)
    channel = install()
    assert channel is not None, messages
    out["first"] = free(x, channel)
    out["opens_first"] = channel.stats()["opens"]
    print("restart-me", flush=True)
    sys.stdin.readline()
    # smddpd was killed and a new one started on the same socket; no free noticed it.
    out["open_after_kill"] = channel.is_open()
    try:
        dist.destroy_process_group()
    except Exception as exc:  # the old group's daemon is gone: whatever it says is fine here
        out["destroy"] = repr(exc)
    # A new group in the same process, on the new daemon: its attach (on its first GPU op,
    # where backend/cuda.py installs) reopens the channel.
    init(rank, world, init_second, FAKE)
    y = reduced(1)
    again = install()
    out["same_library"] = again is channel
    out["after_restart"] = free(y, channel)
    out["opens_restart"] = channel.stats()["opens"]
    # A channel that is no longer open (closed here; a free that finds it broken marks it
    # the same way) is reopened by the group's next op, which the free never fails.
    channel.close()
    z = reduced(2)
    out["after_op"] = free(z, channel)
    out["opens_op"] = channel.stats()["opens"]
    out["builds"] = len(builds)
    out["messages"] = messages
    out["failures"] = check.failures
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(300)
def test_the_free_channel_follows_a_restarted_daemon(start_daemon, spawn_ranks, tmp_path) -> None:
    """smddpd killed and restarted on the same socket while the ranks live on: a new
    process group in each rank process reopens the free channel on the new daemon (the
    library built once), a free is again closed before it happens, and a channel that is
    not open is reopened by the next op; each reopen logged once."""
    import signal

    from smddp.backend import cuda_free_hook

    library = cuda_free_hook.compile_library(cuda_free_hook.CHANNEL_SOURCES, tmp_path)
    daemon = start_daemon(command=FAKE_SMDDPD)
    env = dict(
        os.environ,
        SMDDP_SOCKET=daemon.socket,
        SMDDP_EMBEDDED="0",
        SMDDP_FREE_WAIT_MS="5000",
    )
    ranks = spawn_ranks(
        restart_rank,
        2,
        2,
        str(tmp_path / "init-1"),
        str(tmp_path / "init-2"),
        str(library),
        env=env,
        timeout_s=240,
    )
    ranks.wait_for("restart-me")
    daemon.stop(signal.SIGKILL)
    restarted = start_daemon(command=FAKE_SMDDPD)
    assert restarted.socket == daemon.socket
    ranks.send("go")
    results = ranks.join()
    closed = (cuda_free_hook.FreeChannel.CLOSED, True)
    for rank, r in enumerate(results):
        assert not r["failures"], r["failures"]
        assert r["first"] == closed and r["opens_first"] == 1, r
        assert r["open_after_kill"], "a free (or something) noticed the kill: test is moot"
        assert r["same_library"] and r["builds"] == 1, r
        assert r["after_restart"] == closed, f"rank {rank}: not closed before the free: {r}"
        assert r["opens_restart"] == 2, r
        assert r["after_op"] == closed and r["opens_op"] == 3, r
        reopened = [m for m in r["messages"] if "free channel reopened" in m]
        assert len(reopened) == 2, r["messages"]
        assert "broke or smddpd restarted" in reopened[0], reopened
        assert f"rank {rank}" in reopened[0]
        assert not [m for m in r["messages"] if "could not" in m], r["messages"]


@pytest.mark.timeout(120)
def test_gpu_warm_start_makes_the_gpu_ops_before_any_op(start_daemon) -> None:
    """--gpu-warm start: smddpd makes its GPU ops once it serves, before any GPU op (here the
    fake runtime; on a node CuPy, whose runtime then compiles the common kernels on every
    GPU in the background: tests/server/test_gpu_runtime.py); by default only the first GPU
    op does; where no GPU is usable (this machine without the fake) it says so and serves on."""
    import time

    def logged(daemon, text: str, timeout_s: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while text not in daemon.log():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    warm = start_daemon(args=["--gpu-warm", "start"], command=FAKE_SMDDPD, name="warm")
    assert logged(warm, "--gpu-warm start: GPU ops ready in"), warm.log()
    assert f"on the TEST runtime {FAKE_RUNTIME} (tests/gpu/fake_smddpd.py)" in warm.log()
    plain = start_daemon(command=FAKE_SMDDPD, name="plain")
    time.sleep(1.0)
    assert "TEST runtime" not in plain.log() and "--gpu-warm" not in plain.log(), plain.log()
    no_gpu = start_daemon(args=["--gpu-warm", "start"], name="nogpu")
    assert logged(no_gpu, "--gpu-warm start: no GPU ops at start: smddpd on node"), no_gpu.log()
    assert "cannot carry GPU tensors" in no_gpu.log()
    assert no_gpu.proc.poll() is None and warm.proc.poll() is None
