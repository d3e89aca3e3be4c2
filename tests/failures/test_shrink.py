"""A lost rank does not end the job: the survivors learn who failed, shrink, and go on.

Real daemon, real rank processes, a rank killed with SIGKILL in the middle of an all_reduce
loop. Every survivor must get SmddpRankFailedError naming the same failed ranks (the
daemon's set) and generation 0, make a group of themselves with ``smddp.shrink_group``, and
get exact sums on it; ``smddpctl status`` shows the new communicator's generation and whom it
left out. Bad calls (a live rank excluded, survivors that disagree on whom to exclude, too few
ranks excluded) get a clear error, never a hang.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import time
from typing import Any

import pytest

WORLD = 4
VICTIM = 2
N = 4096  # float64 elements: the region path, a few chunks of its buffers


def _expected(ranks: list[int], step: int) -> Any:
    import torch

    return sum(torch.arange(N, dtype=torch.float64) * (r + 1) + step for r in ranks)


def _contribution(rank: int, step: int) -> Any:
    import torch

    return torch.arange(N, dtype=torch.float64) * (rank + 1) + step


def shrinking_rank(
    rank: int, world: int, init_file: str, victim: int, flags: str, group: str
) -> dict[str, Any]:
    """all_reduces until one fails, then shrinks (the default group, or a new_group of every
    rank) and all_reduces twice on the survivors' group; returns what it saw."""
    import torch
    import torch.distributed as dist

    import smddp
    from smddp.backend.errors import SmddpRankFailedError

    torch.set_num_threads(1)
    dist.init_process_group("smddp", init_method=f"file://{init_file}", rank=rank, world_size=world)
    pg = None if group == "default" else dist.new_group(list(range(world)), backend="smddp")
    dist.all_reduce(torch.ones(4), group=pg)
    print(f"pid {os.getpid()}", flush=True)
    print("ready", flush=True)
    step = 0
    try:
        while True:
            t = _contribution(rank, step)
            dist.all_reduce(t, group=pg)
            if not torch.equal(t, _expected(list(range(world)), step)):
                raise AssertionError(f"step {step}: wrong sum")
            step += 1
    except SmddpRankFailedError as exc:
        failed_at = time.time()
        error = {"message": str(exc), "failed": exc.failed_ranks, "generation": exc.generation}
    flag = smddp.SHRINK_ABORT if flags == "abort" else smddp.SHRINK_DEFAULT
    new = smddp.shrink_group(sorted(error["failed"]), group=pg, shrink_flags=flag)
    survivors = [r for r in range(world) if r not in error["failed"]]
    t = _contribution(rank, 1000)
    dist.all_reduce(t, group=new)
    first_op_at = time.time()
    exact = torch.equal(t, _expected(survivors, 1000))
    t2 = _contribution(rank, 1001)
    dist.all_reduce(t2, group=new)
    exact2 = torch.equal(t2, _expected(survivors, 1001))
    result = {
        **error,
        "failed_at": failed_at,
        "first_op_at": first_op_at,
        "exact": exact,
        "exact2": exact2,
        "new_rank": new.rank(),
        "new_size": new.size(),
        "world_size": dist.get_world_size(),
        "rank": dist.get_rank(),
        "is_default": dist.distributed_c10d._get_default_group() is new,
        "new_generation": new.comm.generation,  # type: ignore[attr-defined]
    }
    print("shrunk", flush=True)
    sys.stdin.readline()  # the test reads smddpctl status meanwhile
    dist.destroy_process_group()
    return result


def _lines_until(r: Any, marker: str, deadline: float) -> None:
    while True:
        try:
            line = r.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail(f"rank {r.rank} did not print {marker!r} in time:\n{r.stderr()[-4000:]}")
        if line is None:
            r.proc.wait()
            pytest.fail(f"rank {r.rank} ended before printing {marker!r}:\n{r.failure()}")
        if line == marker:
            return


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("flags", "group"), [("default", "default"), ("abort", "default"), ("default", "new_group")]
)
def test_survivors_agree_shrink_and_go_on(
    flags, group, system_daemon, rank_env, spawn_ranks, ctl_status, tmp_path
):
    env = rank_env(system_daemon.socket)
    ranks = spawn_ranks(
        shrinking_rank,
        WORLD,
        WORLD,
        str(tmp_path / "init"),
        VICTIM,
        flags,
        group,
        env=env,
        timeout_s=150,
    )
    ranks.wait_for("ready")
    time.sleep(0.5)  # some all_reduces in, at no particular point of one
    victim = ranks.ranks[VICTIM]
    killed_at = time.time()
    os.kill(victim.printed_pid(), signal.SIGKILL)
    victim.proc.wait()
    survivors = [r for r in ranks.ranks if r.rank != VICTIM]
    deadline = time.monotonic() + 60
    for r in survivors:
        _lines_until(r, "shrunk", deadline)

    st = ctl_status(system_daemon.socket)
    shrunk = [c for c in st.get("comms", []) if c.get("generation") == 1]
    assert len(shrunk) == 1, st
    assert shrunk[0]["excluded_ranks"] == [VICTIM], shrunk[0]
    assert shrunk[0]["world_size"] == WORLD - 1, shrunk[0]
    assert shrunk[0]["parent_comm_id"], shrunk[0]

    for r in survivors:
        assert r.proc.stdin is not None
        r.proc.stdin.write("go\n")
        r.proc.stdin.flush()
    for r in survivors:
        r.proc.wait(timeout=60)
        assert r.proc.returncode == 0, r.failure()
    results = []
    for r in survivors:
        import pickle

        with open(r.folder / "result", "rb") as f:
            results.append(pickle.load(f))

    took = [res["first_op_at"] - killed_at for res in results]
    print(f"kill -> first all_reduce on the shrunk group: {max(took):.3f} s (slowest survivor)")
    for old, res in zip([0, 1, 3], results):
        assert res["failed"] == frozenset({VICTIM}), res
        assert res["generation"] == 0, res
        assert res["exact"] and res["exact2"], res
        assert res["new_size"] == WORLD - 1, res
        assert res["new_rank"] == [0, 1, 3].index(old), res
        assert res["new_generation"] == 1, res
        if group == "default":
            assert res["is_default"] and res["world_size"] == WORLD - 1, res
            assert res["rank"] == res["new_rank"], res
        else:
            assert not res["is_default"] and res["world_size"] == WORLD, res
    # Generous: the target is 1 s on 2 cores; a loaded CI machine gets room.
    assert max(took) < 20.0, took


def live_excluded_rank(rank: int, world: int, init_file: str, flags: str) -> dict[str, Any]:
    """Ranks 0-2 exclude rank 3, which is alive: with SHRINK_ABORT while their all_reduce waits
    for it (the op fails, naming the shrink), with SHRINK_DEFAULT between ops. Rank 3's next op
    on the old group then fails, and it is told why."""
    import torch
    import torch.distributed as dist

    import smddp
    from smddp.backend.errors import SmddpBackendError

    torch.set_num_threads(1)
    dist.init_process_group("smddp", init_method=f"file://{init_file}", rank=rank, world_size=world)
    dist.all_reduce(torch.ones(4))
    result: dict[str, Any] = {}
    if rank == world - 1:
        print("left out", flush=True)
        sys.stdin.readline()  # the others have shrunk
        try:
            dist.all_reduce(torch.ones(4))
            result["old_group"] = None
        except SmddpBackendError as exc:
            result["old_group"] = f"{type(exc).__name__}: {exc}"
        dist.destroy_process_group()
        return result
    if flags == "abort":
        work = dist.all_reduce(torch.ones(4), async_op=True)  # waits for rank 3, in vain
        new = smddp.shrink_group([world - 1], shrink_flags=smddp.SHRINK_ABORT)
        try:
            work.wait()
            result["in_flight"] = None
        except SmddpBackendError as exc:
            result["in_flight"] = f"{type(exc).__name__}: {exc}"
    else:
        new = smddp.shrink_group([world - 1])
    t = torch.full((8,), float(rank + 1))
    dist.all_reduce(t)
    result["sum"] = t[0].item()
    result["world_size"] = dist.get_world_size()
    print("shrunk", flush=True)
    sys.stdin.readline()
    del new
    dist.destroy_process_group()
    return result


@pytest.mark.timeout(180)
@pytest.mark.parametrize("flags", ["abort", "default"])
def test_a_live_rank_left_out_is_told(flags, system_daemon, rank_env, spawn_ranks, tmp_path):
    env = rank_env(system_daemon.socket)
    ranks = spawn_ranks(
        live_excluded_rank, WORLD, WORLD, str(tmp_path / "init"), flags, env=env, timeout_s=150
    )
    deadline = time.monotonic() + 90
    _lines_until(ranks.ranks[WORLD - 1], "left out", deadline)
    for r in ranks.ranks[: WORLD - 1]:
        _lines_until(r, "shrunk", deadline)
    ranks.send("go")
    results = ranks.join()
    for res in results[: WORLD - 1]:
        assert res["sum"] == 6.0 and res["world_size"] == WORLD - 1, res
        if flags == "abort":
            assert res["in_flight"] is not None, res
            assert "called shrink_group(SHRINK_ABORT) excluding ranks [3]" in res["in_flight"], res
    told = results[WORLD - 1]["old_group"]
    assert told is not None, results[WORLD - 1]
    if flags == "abort":
        # The first survivor's SHRINK_ABORT failed the old group for every rank.
        assert "called shrink_group(SHRINK_ABORT) excluding ranks [3]" in told, told
    else:
        # The survivors left the old group for the new one, and said so.
        assert "has left the communicator for a shrunk group: " in told, told
        assert "called shrink_group excluding ranks [3]" in told, told


def disagreeing_rank(rank: int, world: int, init_file: str, victim: int) -> dict[str, Any]:
    """After rank ``victim`` dies, rank 3 excludes ranks 1 and 2 while 0 and 1 exclude 2 only:
    every survivor must get an error naming both sets (at shrink_group, or at its first op on
    the new group), not wait until the group's timeout. First, a call that keeps the failed
    rank and one that excludes the caller are refused before anything changes."""
    import torch
    import torch.distributed as dist

    import smddp
    from smddp.backend.errors import SmddpRankFailedError

    torch.set_num_threads(1)
    dist.init_process_group(
        "smddp",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=__import__("datetime").timedelta(seconds=120),
    )
    dist.all_reduce(torch.ones(4))
    print(f"pid {os.getpid()}", flush=True)
    print("ready", flush=True)
    if rank == victim:
        time.sleep(600)
    try:
        dist.all_reduce(torch.ones(4))
        raise AssertionError("the all_reduce completed without the victim")
    except SmddpRankFailedError as exc:
        failed = sorted(exc.failed_ranks)
    result: dict[str, Any] = {"failed": failed}
    for bad in ([1] if rank != 1 else [3], [rank, victim]):
        # Too few ranks (a failed one kept), or itself: refused before anything changes.
        try:
            smddp.shrink_group(bad)
        except (ValueError, RuntimeError) as exc:
            result.setdefault("refused", []).append(f"{type(exc).__name__}: {exc}")
    exclude = [1, victim] if rank == 3 else [victim]
    start = time.monotonic()
    try:
        smddp.shrink_group(exclude)
        dist.all_reduce(torch.ones(4))
        result["error"] = None
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["took"] = time.monotonic() - start
    return result


@pytest.mark.timeout(180)
def test_survivors_that_disagree_are_told_both_sets(system_daemon, rank_env, spawn_ranks, tmp_path):
    env = rank_env(system_daemon.socket)
    ranks = spawn_ranks(
        disagreeing_rank, WORLD, WORLD, str(tmp_path / "init"), VICTIM, env=env, timeout_s=150
    )
    ranks.wait_for("ready")
    victim = ranks.ranks[VICTIM]
    os.kill(victim.printed_pid(), signal.SIGKILL)
    victim.proc.wait()
    for r in ranks.ranks:
        if r.rank != VICTIM:
            r.proc.wait(timeout=120)
            assert r.proc.returncode == 0, r.failure()
    import pickle

    for r in ranks.ranks:
        if r.rank == VICTIM:
            continue
        with open(r.folder / "result", "rb") as f:
            res = pickle.load(f)
        assert res["failed"] == [VICTIM], res
        err = res["error"]
        assert err is not None, res
        assert (
            "excluding ranks [2]" in err
            and "excluded ranks [1, 2]" in err
            or ("excluding ranks [1, 2]" in err and "excluded ranks [2]" in err)
        ), err
        assert "every surviving rank must exclude the same ranks" in err, err
        assert res["took"] < 60, res  # told, not left to the group's timeout of 120 s
        too_few, itself = res["refused"]
        assert too_few.startswith("ValueError: ") and "ranks [2] would never join" in too_few, res
        assert itself.startswith("RuntimeError: ") and "is in ranks_to_exclude" in itself, res


def _survivor_results(world: Any, survivors: list[int], timeout_s: float = 90) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    for r in survivors:
        proc = world.procs[r]
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except Exception:
            world.kill()
            pytest.fail(world._failures({r}), pytrace=False)
        if proc.returncode != 0:
            world.kill()
            pytest.fail(world._failures({r}), pytrace=False)
    return [world._outcome(r)["result"] for r in survivors]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("lost", ["rank", "daemon"])
def test_two_nodes_agree_and_shrink(lost, loopback_nodes, launch_failure_world):
    """2 daemons x 2 ranks. ``rank``: rank 1 (node0) is killed; ranks 0, 2 and 3, on both
    nodes, are told failed ranks [1] and shrink to 3 ranks across both nodes. ``daemon``:
    node1's daemon is killed; ranks 0 and 1 are told [2, 3] and shrink to their own node."""
    nodes = loopback_nodes(2)
    world = launch_failure_world("shrink_on_failure", nodes, [0, 0, 1, 1], {}, timeout_s=200)
    world.wait_for("ready")
    time.sleep(0.5)
    killed_at = time.time()
    if lost == "rank":
        os.kill(world.procs[1].pid, signal.SIGKILL)
        failed, survivors = [1], [0, 2, 3]
    else:
        nodes[1].daemon.proc.kill()
        nodes[1].daemon.proc.wait()
        failed, survivors = [2, 3], [0, 1]
    results = _survivor_results(world, survivors)
    world.kill()
    took = max(res["first_op_at"] for res in results) - killed_at
    print(f"{lost} lost: kill -> first all_reduce on the shrunk group {took:.3f} s")
    for old, res in zip(survivors, results):
        assert res["failed"] == failed, (old, res)
        assert res["generation"] == 0, (old, res)
        assert res["world_size"] == len(survivors), (old, res)
        assert res["rank"] == survivors.index(old), (old, res)
    assert took < 30.0, took


def asking_rank(rank: int, world: int, init_file: str, victim: int) -> dict[str, Any]:
    """Asks ``smddp.failed_ranks()`` before and after rank ``victim`` dies (what a script
    calls when the error reached it without ``failed_ranks``), and of a gloo group."""
    import torch
    import torch.distributed as dist

    import smddp
    from smddp.backend.errors import SmddpRankFailedError

    torch.set_num_threads(1)
    dist.init_process_group("smddp", init_method=f"file://{init_file}", rank=rank, world_size=world)
    gloo = dist.new_group(list(range(world)), backend="gloo")
    dist.all_reduce(torch.ones(4))
    result: dict[str, Any] = {"before": smddp.failed_ranks()}
    try:
        smddp.failed_ranks(gloo)
    except TypeError as exc:
        result["gloo"] = str(exc)
    print(f"pid {os.getpid()}", flush=True)
    print("ready", flush=True)
    if rank == victim:
        time.sleep(600)
    try:
        dist.all_reduce(torch.ones(4))
        raise AssertionError("the all_reduce completed without the victim")
    except SmddpRankFailedError as exc:
        result["told"] = exc.failed_ranks
    result["asked"] = smddp.failed_ranks()
    result["asked_group"] = smddp.failed_ranks(dist.group.WORLD)
    return result


@pytest.mark.timeout(180)
def test_failed_ranks_asks_the_daemon(system_daemon, rank_env, spawn_ranks, tmp_path):
    env = rank_env(system_daemon.socket)
    ranks = spawn_ranks(
        asking_rank, WORLD, WORLD, str(tmp_path / "init"), VICTIM, env=env, timeout_s=150
    )
    ranks.wait_for("ready")
    victim = ranks.ranks[VICTIM]
    os.kill(victim.printed_pid(), signal.SIGKILL)
    victim.proc.wait()
    import pickle

    for r in ranks.ranks:
        if r.rank == VICTIM:
            continue
        r.proc.wait(timeout=120)
        assert r.proc.returncode == 0, r.failure()
        with open(r.folder / "result", "rb") as f:
            res = pickle.load(f)
        assert res["before"] == frozenset(), res
        assert "smddp.failed_ranks asks smddp groups; this group's backend is gloo" in res["gloo"]
        assert res["told"] == res["asked"] == res["asked_group"] == frozenset({VICTIM}), res
