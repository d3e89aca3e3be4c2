"""A rank killed with SIGKILL while the others are inside an all_reduce.

The survivors must get SmddpRankFailedError within 2 s of the kill, naming the dead rank,
its node and its pid, and must still be able to destroy the process group and exit 0.
Two shapes: the victim never reached the op (the others wait for it), and every rank loops
over large all_reduces (the victim dies somewhere inside one, with its arena mapped by the
others on the direct path).
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import time
from typing import Any

import grpc
import pytest

from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc

WORLD = 3
VICTIM = 2
BOUND_S = 2.0


def survivor_rank(rank: int, world: int, init_file: str, mode: str) -> dict[str, Any]:
    """Joins, reports its pid, then all_reduces until the op fails; returns what failed."""
    import torch
    import torch.distributed as dist

    import smddp  # noqa: F401  (registers the backend)
    from smddp.backend.errors import SmddpRankFailedError

    torch.set_num_threads(1)
    dist.init_process_group("smddp", init_method=f"file://{init_file}", rank=rank, world_size=world)
    x = torch.ones(16)
    dist.all_reduce(x)  # everyone is registered and attached
    print(f"pid {os.getpid()}", flush=True)
    print("ready", flush=True)
    if rank == VICTIM and mode == "waiting":
        time.sleep(600)  # never reaches the op; the parent kills it
    n = 1 << 20 if mode == "looping" else 4096  # 4 MiB of float32: chunked and "direct"
    ops = 0
    try:
        while True:
            t = torch.full((n,), float(rank))
            if ops == 0:
                print("inside", flush=True)
            dist.all_reduce(t)
            ops += 1
            assert t[0].item() == sum(range(world))
            if mode == "waiting":
                raise AssertionError("the all_reduce completed without the victim")
    except SmddpRankFailedError as exc:
        failed_at = time.time()
        error = {
            "type": type(exc).__name__,
            "message": str(exc),
            "failed_at": failed_at,
            "dist_backend_error": isinstance(exc, dist.DistBackendError),
            "ops": ops,
        }
    # Later ops fail at once with the same cause.
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        error["after"] = None
    except dist.DistBackendError as exc:
        error["after"] = str(exc)
    error["after_s"] = time.monotonic() - start
    dist.destroy_process_group()
    return error


def status(path: str) -> pb.StatusReply:
    with grpc.insecure_channel("unix:" + path) as ch:
        return pb_grpc.NodeStub(ch).Status(pb.StatusRequest(), timeout=10)


def survivors_results(
    ranks: Any, survivors: list[int], timeout_s: float = 30.0
) -> list[dict[str, Any]]:
    """Waits for the survivors to exit 0 and returns their results."""
    results = []
    for r in (ranks.ranks[i] for i in survivors):
        try:
            r.proc.wait(timeout=timeout_s)
        except Exception:
            ranks.kill()
            pytest.fail(
                f"rank {r.rank} did not end within {timeout_s} s of the kill:\n{r.stderr()[-4000:]}"
            )
        assert r.proc.returncode == 0, r.failure()
        with open(r.folder / "result", "rb") as f:
            results.append(pickle.load(f))
    return results


def _wait_pending(socket_path: str, arrived: list[int], deadline_s: float = 30.0) -> None:
    """Waits until the daemon holds an op at which exactly ``arrived`` have arrived."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for comm in status(socket_path).comms:
            for p in comm.pending:
                if sorted(p.arrived_ranks) == arrived:
                    return
        time.sleep(0.05)
    pytest.fail(f"the daemon never showed an op with ranks {arrived} waiting")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["waiting", "looping"])
def test_killed_rank_fails_the_others_fast(mode, system_daemon, rank_env, spawn_ranks, tmp_path):
    env = rank_env(system_daemon.socket)
    ranks = spawn_ranks(
        survivor_rank, WORLD, WORLD, str(tmp_path / "init"), mode, env=env, timeout_s=90
    )
    ranks.wait_for("ready")
    victim = ranks.ranks[VICTIM]
    pid = victim.printed_pid()
    assert pid == victim.proc.pid
    if mode == "waiting":
        _wait_pending(system_daemon.socket, [r for r in range(WORLD) if r != VICTIM])
    else:
        ranks.wait_for("inside")
        time.sleep(1.0)  # a few large all_reduces in, at no particular point of one
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    victim.proc.wait()
    # The survivors must end cleanly on their own.
    results = survivors_results(ranks, [r for r in range(WORLD) if r != VICTIM])

    expected = (
        rf"job j[0-9a-f]{{16}} comm 0: rank {VICTIM} \(pid {pid}, node node-a\) "
        r"disconnected without "
        # The kernel ends a dead process's connection with EOF, or a reset if data was unread.
        r"leaving the communicator "
        r"\((connection closed|connection error: \[Errno 104\] Connection reset by peer)\); "
        r"its process died or closed its connection"
    )
    for rank, got in zip((0, 1), results):
        assert got["type"] == "SmddpRankFailedError" and got["dist_backend_error"], got
        assert re.fullmatch(expected, got["message"]), f"rank {rank}: {got['message']!r}"
        took = got["failed_at"] - killed_at
        assert took < BOUND_S, f"rank {rank} heard of the death after {took:.2f} s"
        assert got["after"] == got["message"] and got["after_s"] < 1.0, got
        if mode == "looping":
            assert got["ops"] > 0, got
    print(results[0]["message"])
    assert results[0]["message"] == results[1]["message"]
    # The daemon forgot the job once the survivors left, and still serves.
    assert status(system_daemon.socket).comms == []
