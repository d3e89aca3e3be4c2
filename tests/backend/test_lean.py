"""The backend's lean paths: the cached numpy views of small tensors, and groups of one rank
whose collectives run in place (no daemon round trip) with the same checks and errors.

The results of every collective on a one-rank world, for every dtype and reduce op, are
checked by test_backend_collectives.py (world size 1); here: that nothing reached the
daemon, that errors read as they do in a larger group, and what a destroyed group and a
dead daemon raise.
"""

from __future__ import annotations

import gc
import os
import signal
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from smddp.backend.tensors import CACHED_VIEW_BYTES, CACHED_VIEWS, ViewCache

# -- the view cache (in-process) -------------------------------------------------------------


@pytest.mark.timeout(30)
def test_view_cache_hands_out_one_view_per_tensor_memory() -> None:
    cache = ViewCache()
    t = torch.arange(6, dtype=torch.float32)
    a = cache.flat(t, "all_reduce")
    assert cache.flat(t, "all_reduce") is a  # a hit builds nothing
    assert a.shape == (6,) and a.dtype.str == "<f4"
    a[2] = 40.0
    assert t[2].item() == 40.0  # the view shares the tensor's memory
    # Another tensor over the same memory (same address, length, dtype) gets the same view.
    alias = t.view(2, 3).reshape(-1)
    assert cache.flat(alias, "all_reduce") is a
    # Different length or dtype at the same address: a different view.
    assert cache.flat(t[:3], "all_reduce") is not a
    assert cache.flat(t.view(torch.int32), "all_reduce").dtype.str == "<i4"


@pytest.mark.timeout(30)
def test_view_cache_keeps_the_latest_tensor_alive_and_storage_resizable() -> None:
    cache = ViewCache()
    t = torch.ones(4)
    view = cache.flat(t, "all_reduce")
    ref = weakref.ref(t)
    del t
    gc.collect()
    # The view keeps its tensor alive (its memory cannot be handed to another tensor).
    assert ref() is not None
    assert float(view.sum()) == 4.0
    # Not Tensor.numpy(): the storage stays resizable (FSDP1 frees and re-allocates it).
    u = torch.ones(8)
    cache.flat(u, "broadcast")
    u.untyped_storage().resize_(0)
    u.untyped_storage().resize_(32)


@pytest.mark.timeout(30)
def test_view_cache_is_bounded_and_skips_large_or_empty_tensors() -> None:
    cache = ViewCache()
    keep = [torch.ones(2) for _ in range(3 * CACHED_VIEWS)]
    for t in keep:
        cache.flat(t, "all_reduce")
        assert len(cache._views) <= CACHED_VIEWS
    big = torch.ones(CACHED_VIEW_BYTES // 4 + 1)
    first = cache.flat(big, "all_reduce")
    assert cache.flat(big, "all_reduce") is not first and first.shape == (big.numel(),)
    assert cache.flat(torch.ones(0), "all_reduce").shape == (0,)
    bf = torch.full((3,), 1.5, dtype=torch.bfloat16)
    assert [float(x) for x in cache.flat(bf, "all_reduce")] == [1.5, 1.5, 1.5]


# -- groups of one rank ------------------------------------------------------------------------


def solo_group(rank: int, world: int, init_file: str) -> dict[str, Any]:
    """Every rank makes a group of itself and runs every collective on it; the errors it gets
    for bad arguments are compared with the default group's (world 2)."""
    import torch.distributed as dist

    import smddp  # noqa: F401
    from smddp.backend.errors import SmddpBackendError

    dist.init_process_group(
        "smddp",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    groups = [dist.new_group([r], backend="smddp") for r in range(world)]
    g = groups[rank]
    pg = g  # the SmddpProcessGroup itself (torch hands back the creator's object)
    comm = pg.comm
    out: dict[str, Any] = {"solo": type(pg._ops).__name__, "fails": []}

    def expect(name: str, ok: bool) -> None:
        if not ok:
            out["fails"].append(name)

    x = torch.arange(5, dtype=torch.float32) + rank
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
        y = x.clone()
        dist.all_reduce(y, op=op, group=g)
        expect(f"all_reduce {op}", torch.equal(y, x))
    y = x.clone()
    dist.all_reduce(y[::2], group=g)  # not contiguous: the general path
    expect("all_reduce strided", torch.equal(y, x))
    y = x.clone()
    dist.broadcast(y, src=rank, group=g)
    expect("broadcast", torch.equal(y, x))
    dist.reduce(y, dst=rank, group=g)
    expect("reduce", torch.equal(y, x))
    outs = [torch.zeros(5)]
    dist.all_gather(outs, x, group=g)
    expect("all_gather", torch.equal(outs[0], x))
    flat = torch.zeros(5)
    dist.all_gather_into_tensor(flat, x, group=g)
    expect("all_gather_into_tensor", torch.equal(flat, x))
    rs = torch.zeros(5)
    dist.reduce_scatter_tensor(rs, x, group=g)
    expect("reduce_scatter_tensor", torch.equal(rs, x))
    gl = [torch.zeros(5)]
    dist.gather(x, gl, dst=rank, group=g)
    expect("gather", torch.equal(gl[0], x))
    sc = torch.zeros(5)
    dist.scatter(sc, [x], src=rank, group=g)
    expect("scatter", torch.equal(sc, x))
    a2a = torch.zeros(5)
    dist.all_to_all_single(a2a, x, group=g)
    expect("all_to_all_single", torch.equal(a2a, x))
    dist.barrier(group=g)
    work = dist.all_reduce(x.clone(), group=g, async_op=True)
    expect("async", work.wait() and work.get_future().wait()[0].equal(x))
    out["daemon ops"] = comm._seq  # ops numbered for the daemon: none

    # Bad arguments: the same errors as in a group of two.
    for name, call in {
        "band on float": lambda grp: dist.all_reduce(x.clone(), op=dist.ReduceOp.BAND, group=grp),
        "avg on int": lambda grp: dist.all_reduce(
            torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.AVG, group=grp
        ),
        "gather size": lambda grp: dist.all_gather_into_tensor(
            torch.zeros(3 * dist.get_world_size(grp) + 1), torch.ones(3), group=grp
        ),
    }.items():
        texts = []
        for grp in (g, None):
            try:
                call(grp)
                texts.append("no error")
            except ValueError as exc:
                texts.append(str(exc).replace(f"{world} ranks", "N ranks").split(" but ")[0])
        out[name] = texts

    dist.destroy_process_group(g)
    try:
        pg.allreduce([torch.ones(2)], dist.AllreduceOptions()).wait()
        out["destroyed"] = "no error"
    except dist.DistBackendError as exc:
        out["destroyed"] = f"{type(exc) is SmddpBackendError}: {exc}"
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(120)
def test_group_of_one_runs_in_place(daemon, spawn_ranks, tmp_path: Path) -> None:
    env = dict(os.environ, SMDDP_SOCKET=daemon.socket, SMDDP_EMBEDDED="0")
    got = spawn_ranks(solo_group, 2, 2, str(tmp_path / "init"), env=env).join()
    for out in got:
        assert out["solo"] == "SoloOps", out
        assert out["fails"] == [], out
        assert out["daemon ops"] == 0, out
        for name in ("band on float", "avg on int"):
            assert out[name][0] == out[name][1] != "no error", (name, out[name])
        assert out["gather size"][0].startswith("all_gather_into_tensor: output has 4"), out
        assert out["destroyed"].startswith("True: job "), out
        assert "rank 0: the communicator has been destroyed" in out["destroyed"], out


def solo_after_daemon_dies(rank: int, world: int, init_file: str, flag: str) -> dict[str, Any]:
    """A world of one: ops run in place; once the test kills the daemon, an op raises."""
    import torch.distributed as dist

    import smddp  # noqa: F401

    dist.init_process_group("smddp", init_method=f"file://{init_file}", rank=rank, world_size=world)
    t = torch.ones(3)
    dist.all_reduce(t)
    Path(flag).write_text("ready")
    deadline = time.monotonic() + 20
    ops = 0
    try:
        while time.monotonic() < deadline:
            dist.all_reduce(t)
            ops += 1
            time.sleep(0.01)
        error = "no error"
    except dist.DistBackendError as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "ops": ops}


@pytest.mark.timeout(120)
def test_group_of_one_sees_the_daemon_die(start_daemon, spawn_ranks, tmp_path: Path) -> None:
    d = start_daemon()
    env = dict(os.environ, SMDDP_SOCKET=d.socket, SMDDP_EMBEDDED="0")
    flag = tmp_path / "ready"
    ranks = spawn_ranks(solo_after_daemon_dies, 1, 1, str(tmp_path / "init"), str(flag), env=env)
    deadline = time.monotonic() + 90
    while not flag.exists():
        assert time.monotonic() < deadline, "the rank never got ready"
        time.sleep(0.1)
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(timeout=10)
    (got,) = ranks.join()
    assert "gone" in got["error"] and d.socket in got["error"], got
