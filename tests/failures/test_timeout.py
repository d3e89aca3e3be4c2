"""An op that some rank never reaches fails after the process group's timeout.

Three torch ranks on a system daemon, ``init_process_group(timeout=2 s)``. First, in a
group with a long timeout, rank 2 holds back until the parent has seen the waiting op in
``smddpctl status --json`` (the op then completes). Then, in the default group, rank 2
sleeps through an all_reduce: ranks 0 and 1 get SmddpTimeoutError naming rank 2 (its pid
and node), the op, and how long they waited; rank 2, arriving late, gets the same error;
``smddpctl status`` shows the communicator failed with that message.

Across nodes, the node whose peer stays silent asks that node's Peer service what holds it
up, so the message still names the rank that never arrived.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

WORLD = 3
LATE = 2
TIMEOUT_S = 2.0


def _join(rank: int, world: int, init_file: str) -> None:
    """Joins the default group on smddp with the group's timeout of TIMEOUT_S."""
    from datetime import timedelta

    import torch.distributed as dist

    import smddp  # noqa: F401  (registers the backend)

    dist.init_process_group(
        "smddp",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=TIMEOUT_S),
    )


def timeout_rank(rank: int, world: int, init_file: str) -> dict[str, Any]:
    import sys
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from smddp.backend.errors import SmddpTimeoutError

    _join(rank, world, init_file)
    out: dict[str, Any] = {}

    # 1. Watched: rank 2 arrives when the parent says so.
    patient = dist.new_group(backend="smddp", timeout=timedelta(seconds=60))
    print("watch", flush=True)
    if rank == LATE:
        assert sys.stdin.readline().strip() == "arrive"
    t = torch.ones(4096)
    dist.all_reduce(t, group=patient)
    assert torch.equal(t, torch.full((4096,), float(world)))
    dist.destroy_process_group(patient)

    # 2. Rank 2 sleeps past the default group's 2 s timeout.
    dist.barrier()
    print("timeout", flush=True)
    t = torch.ones(4096)
    start = time.monotonic()
    if rank == LATE:
        assert sys.stdin.readline().strip() == "arrive"
    try:
        dist.all_reduce(t)
        out["error"] = None
    except SmddpTimeoutError as exc:
        out.update(
            message=str(exc),
            seconds=time.monotonic() - start,
            dist_backend_error=isinstance(exc, dist.DistBackendError),
        )
    print("failed", flush=True)
    assert sys.stdin.readline().strip() == "leave"
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(120)
def test_timeout_names_who_never_arrived(
    system_daemon, rank_env, ctl_status, spawn_ranks, tmp_path
):
    ranks = spawn_ranks(
        timeout_rank, WORLD, WORLD, str(tmp_path / "init"), env=rank_env(system_daemon.socket)
    )
    pids = [r.proc.pid for r in ranks.ranks]
    late = ranks.ranks[LATE]

    # 1. While ranks 0 and 1 wait, smddpctl shows the op and who is missing.
    ranks.wait_for("watch")
    deadline = time.monotonic() + 30
    seen = None
    while seen is None and time.monotonic() < deadline:
        for comm in ctl_status(system_daemon.socket)["comms"]:
            for p in comm["pending"]:
                if p["arrived_ranks"] == [0, 1]:
                    seen = (comm, p)
    assert seen is not None, "smddpctl status never showed ranks 0 and 1 waiting"
    comm, pending = seen
    assert pending["missing_ranks"] == [LATE], pending
    assert pending["description"] == "all_reduce(SUM, 4096 x float32)", pending
    assert pending["seq"] == "1" or pending["seq"] == 1, pending
    assert pending["waited_seconds"] > 0, pending
    ranks_shown = {r["rank"]: r for r in comm["ranks"]}
    assert ranks_shown[LATE]["pid"] == pids[LATE] and ranks_shown[LATE]["node_id"] == "node-a", comm
    assert comm["failed"] == "", comm
    late.proc.stdin.write("arrive\n")
    late.proc.stdin.flush()

    # 2. The default group's op times out after 2 s.
    ranks.wait_for("timeout")
    time.sleep(TIMEOUT_S + 1.5)  # well past the timeout
    late.proc.stdin.write("arrive\n")
    late.proc.stdin.flush()
    ranks.wait_for("failed")
    failed = [c for c in ctl_status(system_daemon.socket)["comms"] if c["comm_id"] == "0"]
    ranks.send("leave")
    results = ranks.join()

    pattern = (
        r"job j[0-9a-f]{16} comm 0: op #2 all_reduce\(SUM, 4096 x float32\) timed out: "
        r"rank 2 never "
        rf"arrived \(rank 2 \(pid {pids[LATE]}, node node-a\)\) while ranks 0-1 waited "
        r"([0-9.]+) s, past the group's timeout of 2\.0 s"
    )
    message = results[0]["message"]
    print(message)
    m = re.fullmatch(pattern, message)
    assert m, message
    assert 2.0 <= float(m.group(1)) < 3.0, message
    for rank, got in enumerate(results):
        assert got["message"] == message, f"rank {rank}: {got['message']!r}"
        assert got["dist_backend_error"], got
        if rank != LATE:
            assert TIMEOUT_S <= got["seconds"] < TIMEOUT_S + 1.0, (
                f"rank {rank} waited {got['seconds']:.2f} s"
            )
    assert len(failed) == 1 and failed[0]["failed"] == message, failed
    assert failed[0]["pending"] == [], failed


@pytest.mark.timeout(120)
def test_timeout_across_nodes_names_the_rank_on_the_silent_node(
    loopback_daemons, launch_failure_world
):
    nodes = loopback_daemons([(), ()])
    # Ranks 0 and 1 on node0, rank 2 alone on node1, late: node1 has no op in flight.
    results = launch_failure_world(
        "late_rank",
        nodes,
        [0, 0, 1],
        {"late": 2, "late_s": 3 * TIMEOUT_S, "pg_timeout_s": TIMEOUT_S},
    ).join()
    message = results[0]["message"]
    print(message)
    assert re.fullmatch(
        r"job j[0-9a-f]{16} comm 0: op #\d+: node node1 sent nothing within 2 s: "
        r"node node1 says rank 2 has "
        r"not called it \(\d+ ops completed there\)",
        message,
    ), message
    for rank, got in enumerate(results):
        assert got["type"] == "SmddpTimeoutError", f"rank {rank}: {got}"
        assert got["message"] == message, f"rank {rank}: {got['message']!r}"


STALL_S = 8.0


def stalled_inside_rank(rank: int, world: int, init_file: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from smddp.backend.errors import SmddpTimeoutError
    from smddp.client import direct

    _join(rank, world, init_file)
    t = torch.full((4 << 20,), float(rank))  # 16 MiB: read in place, between two synchronisations
    dist.broadcast(t, 0)  # the ranks find that they can read each other
    assert torch.equal(t, torch.zeros_like(t))
    if rank == 1:
        # Rank 1 stops after the op's first synchronisation, before it has read the root's
        # data: every rank is in the op, and rank 1 is behind at the next one.
        read = direct.read

        def stalled(*args: Any) -> None:
            time.sleep(STALL_S)
            read(*args)

        direct.read = stalled  # type: ignore[assignment]
    dist.barrier()
    start = time.monotonic()
    out: dict[str, Any] = {"error": None}
    try:
        dist.broadcast(t, 0)
        # Rank 1, back, may complete the broadcast: the root's data was there to read, and
        # the root had passed the last synchronisation before it gave up. Its next op fails.
        out["completed"] = True
        dist.barrier()
    except SmddpTimeoutError as exc:
        out.update(message=str(exc), seconds=time.monotonic() - start)
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(120)
def test_a_rank_stopped_inside_an_op_is_timed_out_and_named(
    system_daemon, rank_env, spawn_ranks, tmp_path
):
    """Both ranks are in a large broadcast when rank 1 stops before its second
    synchronisation: rank 0 fails after the group's timeout (not 30 s later, as when only
    ranks behind the op's number counted), naming rank 1; rank 1, back, gets the same error
    (from the broadcast, or from its next op if it could complete the broadcast)."""
    ranks = spawn_ranks(
        stalled_inside_rank, 2, 2, str(tmp_path / "init"), env=rank_env(system_daemon.socket)
    )
    pid1 = ranks.ranks[1].proc.pid
    results = ranks.join()
    message = results[0].get("message")
    print(message)
    assert message is not None, results
    pattern = (
        r"job j[0-9a-f]{16} comm 0: op #\d+ broadcast\(src=0, 4194304 x float32\) timed out: "
        rf"rank 1 never arrived at a synchronisation inside it \(rank 1 \(pid {pid1}, node "
        r"node-a\)\) while rank 0 waited ([0-9.]+) s, past the group's timeout of 2\.0 s"
    )
    assert re.fullmatch(pattern, message), message
    assert results[0]["seconds"] < TIMEOUT_S + 3.0, results[0]
    assert "completed" not in results[0], results[0]
    assert results[1].get("message") == message, results[1]
