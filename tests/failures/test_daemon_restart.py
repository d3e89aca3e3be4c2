"""The node daemon restarts under a running job.

Two torch ranks on a system daemon. Rank 0 is inside an all_reduce (rank 1 holds back)
when the daemon gets SIGTERM; a new daemon then starts on the same socket. Rank 0's op
fails at once, and every rank's next op fails with SmddpDaemonLostError: the next with the
daemon's parting "smddpd is shutting down", later ones saying the daemon went away; nothing hangs,
and the ranks still destroy their process
group and exit 0. A new job then runs on the new daemon.
"""

from __future__ import annotations

import signal
import sys
import time
from typing import Any

import grpc
import pytest

from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc

WORLD = 2


def old_job_rank(rank: int, world: int, init_file: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import smddp  # noqa: F401  (registers the backend)
    from smddp.backend.errors import SmddpDaemonLostError

    dist.init_process_group("smddp", init_method=f"file://{init_file}", rank=rank, world_size=world)
    t = torch.ones(4096)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4096,), float(world)))
    out: dict[str, Any] = {}

    def attempt(name: str) -> None:
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4096))
            out[name] = {"type": None}
        except Exception as exc:
            out[name] = {
                "type": type(exc).__name__,
                "message": str(exc),
                "daemon_lost": isinstance(exc, SmddpDaemonLostError),
                "dist_backend_error": isinstance(exc, dist.DistBackendError),
                "seconds": time.monotonic() - start,
            }

    print("ready", flush=True)
    if rank == 0:
        attempt("in flight")  # rank 1 never joins it: the daemon stops meanwhile
    assert sys.stdin.readline().strip() == "go"
    attempt("next op")
    attempt("op after")
    start = time.monotonic()
    dist.destroy_process_group()
    out["destroy_s"] = time.monotonic() - start
    return out


def new_job_rank(rank: int, world: int, init_file: str) -> float:
    import torch
    import torch.distributed as dist

    import smddp  # noqa: F401  (registers the backend)

    dist.init_process_group("smddp", init_method=f"file://{init_file}", rank=rank, world_size=world)
    t = torch.arange(100_000, dtype=torch.float64) * (rank + 1)
    dist.all_reduce(t)
    assert torch.equal(t, torch.arange(100_000, dtype=torch.float64) * 3)
    dist.destroy_process_group()
    return float(t.sum())


def _pending(socket_path: str) -> list[Any]:
    with grpc.insecure_channel("unix:" + socket_path) as ch:
        st = pb_grpc.NodeStub(ch).Status(pb.StatusRequest(), timeout=10)
    return [p for c in st.comms for p in c.pending]


@pytest.mark.timeout(120)
def test_daemon_restart_fails_the_old_job_and_serves_a_new_one(
    start_daemon, rank_env, spawn_ranks, tmp_path
):
    old = start_daemon(name="system")
    env = rank_env(old.socket)
    ranks = spawn_ranks(old_job_rank, WORLD, WORLD, str(tmp_path / "old"), env=env)
    ranks.wait_for("ready")
    deadline = time.monotonic() + 30
    while not _pending(old.socket):
        assert time.monotonic() < deadline, "rank 0's all_reduce never reached the daemon"
        time.sleep(0.05)

    assert old.stop(signal.SIGTERM) == 0, old.log()
    new = start_daemon(name="system")  # the same socket path
    assert new.socket == old.socket
    ranks.send("go")
    results = ranks.join()

    for rank, got in enumerate(results):
        for name in ("in flight", "next op", "op after") if rank == 0 else ("next op", "op after"):
            e = got[name]
            assert e["type"] == "SmddpDaemonLostError", f"rank {rank} {name}: {e}"
            assert e["daemon_lost"] and e["dist_backend_error"], f"rank {rank} {name}: {e}"
            assert e["seconds"] < 2.0, f"rank {rank} {name}: took {e['seconds']:.1f} s"
            print(f"rank {rank} {name}: {e['message']}")
        assert got["destroy_s"] < 10, got
    in_flight = results[0]["in flight"]["message"]
    assert "smddpd is shutting down" in in_flight, in_flight
    for got in results:
        # Between ops a rank hears why: the daemon told every rank as it stopped...
        assert got["next op"]["message"].endswith("smddpd is shutting down"), got["next op"]
        # ...and after that, that the connection is gone.
        msg = got["op after"]["message"]
        assert f"smddpd at {old.socket}" in msg and ("stopped" in msg or "restarted" in msg), msg

    # The new daemon knows nothing of the old job, and serves a new one.
    assert _pending(new.socket) == []
    totals = spawn_ranks(new_job_rank, WORLD, WORLD, str(tmp_path / "new"), env=env).join()
    assert totals == [float(sum(range(100_000)) * 3)] * WORLD
    assert new.stop(signal.SIGTERM) == 0, new.log()
