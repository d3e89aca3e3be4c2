"""A replacement joins the survivors (``smddp.join``, ``smddp.grow``) and is healed.

Real daemons, real rank processes, the job's store a real TCPStore held by the test (as the
example's launcher holds it). The example's test kills a rank of four, lets the launcher start
a replacement and checks that the four ranks end bitwise equal to each other and to a
four-rank run from the state the replacement was healed with. The others check the parts: a
grow with nobody waiting returns the same group and registers nothing; a joiner that no grow
admits gets a named error at its timeout and is not admitted later; heal gives a joiner the
source rank's model and optimizer state bitwise (Adam, SGD with momentum); ``smddpctl status``
shows the grown communicator's generation and who joined.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from test_elastic_example import (  # noqa: E402
    EXAMPLE,
    RUN_TIMEOUT_S,
    _assert_bitwise_equal,
    _follow,
    _load,
    _run,
)

FIRST_STEP_BOUND_S = 60.0  # replacement start -> first step; 6 s measured on a loaded 2-core VM


def _store(port: int) -> Any:
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=90))


def _init(rank: int, world: int, port: int) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import smddp  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    dist.init_process_group(
        "smddp", store=_store(port), rank=rank, world_size=world, timeout=timedelta(seconds=90)
    )


@pytest.fixture
def store_port() -> Any:
    """A TCPStore held by the test, as the example's launcher holds it: its port."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=90)
    )
    yield store.port
    del store


# -- the example: kill, shrink, replace, heal, bitwise --------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_a_replacement_joins_and_the_four_match_a_four_rank_run(tmp_path: Path) -> None:
    """Rank 2 of 4 SIGKILLs itself at step 20; the three survivors shrink, the launcher starts a
    replacement, which joins at their next grow as rank 3 and is healed; 4 ranks train on to
    step 60. Every rank ends with the same bits, which are those of a 4-rank run from the
    state the replacement was healed with."""
    steps = 60
    dumps = tmp_path / "dumps"
    out = _run(
        tmp_path,
        "--nproc=4",
        "--kill-rank=2",
        "--kill-at-step=20",
        f"--steps={steps}",
        "--replace",
        f"--dump-dir={dumps}",
    )
    assert "launcher: ranks [2] were killed; ranks [] failed; the others finished" in out, out
    assert "launcher: replacements of ranks [2]; those of ranks [] failed" in out, out
    assert "ranks [2] failed; 3 ranks go on from step 20" in out, out
    assert "ranks [3] joined; 4 ranks go on from step" in out, out
    for r in range(4):
        assert f"rank {r}: trained {steps} steps on 4 ranks" in out, out
    took = [
        float(line.rsplit(" ", 2)[-2])
        for line in out.splitlines()
        if line.startswith("launcher: the replacement of rank 2 (now rank 3): start -> first step")
    ]
    assert len(took) == 1, out
    print(f"replacement start -> its first step: {took[0]:.3f} s")
    assert took[0] < FIRST_STEP_BOUND_S, out

    grown = _load(dumps / "grow.pt")
    assert 20 < grown["step"] < steps - 10, grown["step"]
    finals = [_load(dumps / f"final.rank{r}.pt") for r in range(4)]
    for r in range(1, 4):
        _assert_bitwise_equal(finals[r]["model"], finals[0]["model"], f"rank {r} model")
        _assert_bitwise_equal(finals[r]["optimizer"], finals[0]["optimizer"], f"rank {r} opt")
    assert any(not finals[0]["model"][k].equal(grown["model"][k]) for k in grown["model"])

    ref = tmp_path / "reference"
    out = _run(
        tmp_path,
        "--nproc=4",
        f"--resume={dumps / 'grow.pt'}",
        f"--steps={steps}",
        f"--dump-dir={ref}",
    )
    assert "launcher: ranks [] were killed; ranks [] failed" in out, out
    reference = _load(ref / "final.pt")
    assert reference["step"] == finals[0]["step"] == steps
    _assert_bitwise_equal(finals[0]["model"], reference["model"], "model")
    _assert_bitwise_equal(finals[0]["optimizer"], reference["optimizer"], "optimizer")


# -- the parts ---------------------------------------------------------------------------------


def idle_grow_rank(rank: int, world: int, port: int, calls: int) -> dict[str, Any]:
    """Calls grow() ``calls`` times with nobody waiting; returns what it saw and what it cost."""
    import torch
    import torch.distributed as dist

    import smddp

    _init(rank, world, port)
    pg = dist.distributed_c10d._get_default_group()
    dist.barrier()
    started = time.perf_counter()
    same = all(smddp.grow() is pg for _ in range(calls))
    per_call = (time.perf_counter() - started) / calls
    t = torch.ones(4)
    dist.all_reduce(t)
    result = {
        "same": same,
        "sum": t[0].item(),
        "generation": pg.comm.generation,  # type: ignore[attr-defined]
        "per_call_s": per_call,
    }
    print("grew nothing", flush=True)
    sys.stdin.readline()  # the test reads smddpctl status meanwhile
    dist.destroy_process_group()
    return result


@pytest.mark.timeout(240)
def test_grow_with_nobody_waiting_returns_the_same_group(
    system_daemon, rank_env, spawn_ranks, ctl_status, store_port
):
    calls = 200
    ranks = spawn_ranks(
        idle_grow_rank, 3, 3, store_port, calls, env=rank_env(system_daemon.socket), timeout_s=200
    )
    ranks.wait_for("grew nothing")
    st = ctl_status(system_daemon.socket)
    comms = st.get("comms", [])
    # No communicator was made: the one default group, generation 0.
    assert len(comms) == 1 and not comms[0].get("generation"), st
    ranks.send("go")
    results = ranks.join()
    for res in results:
        assert res["same"] and res["sum"] == 3.0 and res["generation"] == 0, res
    slowest = max(res["per_call_s"] for res in results)
    print(f"grow() with nobody waiting: {slowest * 1e6:.0f} us per call (slowest of 3 ranks)")
    assert slowest < 0.5, results  # generous: one store read and one tiny broadcast


def lonely_joiner(rank: int, port: int, timeout_s: float) -> dict[str, Any]:
    """Joins a job whose ranks never grow (within ``timeout_s``); returns the error."""
    import torch.distributed as dist

    import smddp
    from smddp.backend.errors import SmddpJoinTimeoutError

    started = time.monotonic()
    try:
        smddp.join(_store(port), timeout=timeout_s)
    except SmddpJoinTimeoutError as exc:
        return {
            "error": str(exc),
            "took": time.monotonic() - started,
            "initialized": dist.is_initialized(),
        }
    return {"error": None, "rank": dist.get_rank()}


def late_grow_rank(rank: int, world: int, port: int) -> dict[str, Any]:
    """Waits for the test's word (the joiner has given up), then grows: nobody is admitted."""
    import torch.distributed as dist

    import smddp

    _init(rank, world, port)
    pg = dist.distributed_c10d._get_default_group()
    print("ready", flush=True)
    sys.stdin.readline()
    same = smddp.grow() is pg and dist.get_world_size() == world
    dist.destroy_process_group()
    return {"same": same}


@pytest.mark.timeout(240)
def test_a_joiner_that_no_grow_admits_gets_a_named_error(
    system_daemon, rank_env, spawn_ranks, store_port
):
    env = rank_env(system_daemon.socket)
    ranks = spawn_ranks(late_grow_rank, 2, 2, store_port, env=env, timeout_s=200)
    ranks.wait_for("ready")
    joiner = spawn_ranks(lonely_joiner, 1, store_port, 3.0, env=env, timeout_s=200)
    (res,) = joiner.join()
    assert res["error"] is not None, res
    assert "no smddp.grow admitted it within 3 s; it has left the queue" in res["error"], res
    assert res["took"] < 60 and not res["initialized"], res
    # The withdrawn joiner is still in the queue's records: the next grow must skip it.
    ranks.send("go")
    assert all(r["same"] for r in ranks.join())


def healing_rank(rank: int, survivors: int, port: int, src: int, optimizer: str) -> dict[str, Any]:
    """Ranks 0..survivors-1 make a job and train apart (different seeds and step counts, so
    their states differ); rank ``survivors`` joins. After grow, heal from ``src``: every rank
    returns its state."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import smddp

    def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
        if optimizer == "adam":
            opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, opt

    torch.set_num_threads(1)
    if rank < survivors:
        _init(rank, survivors, port)
        model, opt = make(rank)
        for _ in range(rank + 2):  # rank r takes r + 2 steps alone: states differ
            opt.zero_grad()
            model(torch.randn(16, 8)).square().mean().backward()
            opt.step()
        if rank == src:
            opt.param_groups[0]["lr"] = 0.003  # as a scheduler would: heal sends it too
        group = smddp.grow(wait_for=1, timeout=120)
    else:
        model, opt = make(100)  # no state: its optimizer never stepped
        group = smddp.join(_store(port), timeout=120)
    print("grown", flush=True)
    sys.stdin.readline()  # the test reads smddpctl status meanwhile
    smddp.heal(model, opt, src=src)
    state = {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "generation": group.comm.generation,  # type: ignore[attr-defined]
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
    }
    # The healed ranks train on as one: a step of DDP-free all_reduced gradients agrees too.
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(7 + dist.get_rank()))
    opt.zero_grad()
    model(x).square().mean().backward()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
    opt.step()
    state["after"] = {k: v.clone() for k, v in model.state_dict().items() if "running" not in k}
    dist.destroy_process_group()
    return state


@pytest.mark.timeout(240)
@pytest.mark.parametrize("optimizer", ["adam", "sgd_momentum"])
def test_heal_gives_the_joiner_the_source_ranks_state_bitwise(
    optimizer, system_daemon, rank_env, spawn_ranks, ctl_status, store_port
):
    survivors, src = 2, 1
    ranks = spawn_ranks(
        healing_rank,
        survivors + 1,
        survivors,
        store_port,
        src,
        optimizer,
        env=rank_env(system_daemon.socket),
        timeout_s=200,
    )
    ranks.wait_for("grown")
    st = ctl_status(system_daemon.socket)
    grown = [c for c in st.get("comms", []) if c.get("generation") == 1]
    assert len(grown) == 1, st
    assert grown[0]["joined_ranks"] == [survivors], grown[0]
    assert grown[0]["world_size"] == survivors + 1 and grown[0]["parent_comm_id"], grown[0]
    assert not grown[0].get("excluded_ranks"), grown[0]
    ranks.send("go")
    results = ranks.join()
    assert [r["rank"] for r in results] == [0, 1, 2], results
    assert all(r["world"] == 3 and r["generation"] == 1 for r in results), results
    want = results[src]
    state = want["optimizer"]["state"]
    assert state, "the source rank's optimizer has state"
    key = "exp_avg_sq" if optimizer == "adam" else "momentum_buffer"
    assert all(key in s for s in state.values()), state
    assert all(r["optimizer"]["param_groups"][0]["lr"] == 0.003 for r in results), results
    for r in results:
        _assert_bitwise_equal(r["model"], want["model"], f"rank {r['rank']} model")
        _assert_bitwise_equal(r["optimizer"], want["optimizer"], f"rank {r['rank']} optimizer")
        _assert_bitwise_equal(r["after"], want["after"], f"rank {r['rank']} after a step")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("joined", "excluded", "message"),
    [
        ([0], [], "must be the last ranks of the 3, after at least one rank of the parent"),
        ([1, 2], [1], "a communicator made by grow excludes no ranks"),
        ([0, 1, 2], [], "must be the last ranks of the 3, after at least one rank of the parent"),
    ],
)
def test_the_daemon_refuses_a_grown_lineage_that_makes_no_sense(
    joined, excluded, message, system_daemon
):
    """The daemon checks a grown communicator's joined_ranks (RegisterRequest field 15)."""
    import secrets

    from smddp.client.communicator import connect
    from smddp.client.config import ClientConfig
    from smddp.client.errors import SmddpError

    with pytest.raises(SmddpError, match=message):
        connect(
            job_id="jgrowcheck",
            job_token=secrets.token_bytes(32),
            rank=0,
            world_size=3,
            comm_id="0#1",
            socket_path=system_daemon.socket,
            timeout_s=10,
            config=ClientConfig(),
            parent_comm_id="0",
            excluded_ranks=excluded,
            generation=1,
            joined_ranks=joined,
        )


def _launcher(
    tmp_path: Path, node: Any, socket: str, port: int, *args: str
) -> subprocess.Popen[str]:
    env = dict(os.environ, SMDDP_SOCKET=socket, SMDDP_NODE_ID=node, SMDDP_EMBEDDED="0")
    cmd = [
        sys.executable,
        str(EXAMPLE),
        "--nnodes=2",
        f"--node-rank={0 if node == 'node0' else 1}",
        "--nproc=2",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        *args,
    ]
    return subprocess.Popen(
        cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _wait_all(procs: list[subprocess.Popen[str]], timeout_s: float) -> list[int]:
    try:
        return [p.wait(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
@pytest.mark.timeout(4 * RUN_TIMEOUT_S)
def test_a_lost_node_comes_back(tmp_path: Path, loopback_nodes: Any, start_daemon: Any) -> None:
    """Two nodes (two daemons) x 2 ranks; node1's daemon is SIGKILLed: node0's ranks shrink to
    two and wait at their next grow. node1 comes back: a new daemon (same node id, new peer
    address) and its launcher again, with --join: its two workers join as ranks 2 and 3 and are
    healed; the four train on. All four end bitwise equal, and equal to a two-node run of the
    same steps from the state the joiners were healed with."""
    from ports import free_port

    nodes = loopback_nodes(2)
    port = free_port()
    steps = 200
    dumps = tmp_path / "dumps"
    common = [f"--steps={steps}", "--replace", f"--dump-dir={dumps}"]
    # The survivors wait at their first grow for the node to come back: longer than the
    # restart below takes on a loaded machine, and the group's timeout longer still.
    waits = ["--join-timeout=180", "--pg-timeout=300"]
    outputs: list[list[str]] = [[], [], []]
    first = [_launcher(tmp_path, n.node_id, n.daemon.socket, port, *common, *waits) for n in nodes]
    stepping = _follow(first[0], outputs[0], "rank 0: step 20 loss")
    _follow(first[1], outputs[1], "\0")
    back: list[subprocess.Popen[str]] = []
    try:
        assert stepping.wait(RUN_TIMEOUT_S) and first[0].poll() is None, outputs
        nodes[1].daemon.proc.kill()
        nodes[1].daemon.proc.wait()
        assert first[1].wait(timeout=RUN_TIMEOUT_S) == 1, "".join(outputs[1])[-6000:]
        # node1 comes back: its daemon restarted (a new peer address), its launcher again.
        daemon = start_daemon(args=("--node-id", "node1"), name="node1-back")
        started = time.time()
        back.append(_launcher(tmp_path, "node1", daemon.socket, port, "--join", *common, *waits))
        _follow(back[0], outputs[2], "\0")
        try:
            codes = _wait_all([first[0], back[0]], RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"node0 or node1's second launcher did not finish:\n--- node0:\n{''.join(outputs[0])[-6000:]}\n--- node1 back:\n{''.join(outputs[2])[-6000:]}"  # noqa: E501
            )
    finally:
        for p in first + back:
            if p.poll() is None:
                p.kill()
                p.wait()
    time.sleep(0.5)  # the pumps' last lines
    out0, out1, out_back = ("".join(o) for o in outputs)
    assert codes == [0, 0], (
        f"{codes}\n--- node0:\n{out0[-6000:]}\n--- node1 back:\n{out_back[-6000:]}"
    )
    assert "SmddpDaemonLostError" in out1, out1[-6000:]
    assert "ranks [2, 3] failed; 2 ranks go on from step" in out0, out0[-6000:]
    assert "ranks [2, 3] joined; 4 ranks go on from step" in out0, out0[-6000:]
    for r, out in ((0, out0), (1, out0), (2, out_back), (3, out_back)):
        assert f"rank {r}: trained {steps} steps on 4 ranks" in out, out[-6000:]
    firsts = [
        float(t)
        for t in re.findall(
            r"^rank \d \(replacement\): first step done at ([\d.]+)", out_back, re.M
        )
    ]
    assert len(firsts) == 2, out_back
    print(f"node1's launcher started again -> its ranks' first step: {max(firsts) - started:.3f} s")

    grown = _load(dumps / "grow.pt")
    finals = [_load(dumps / f"final.rank{r}.pt") for r in range(4)]
    for r in range(1, 4):
        _assert_bitwise_equal(finals[r]["model"], finals[0]["model"], f"rank {r} model")
        _assert_bitwise_equal(finals[r]["optimizer"], finals[0]["optimizer"], f"rank {r} opt")
    assert steps - grown["step"] >= 20, grown["step"]

    # The reference: the same two daemons, two launchers, from grow.pt.
    ref = tmp_path / "reference"
    port = free_port()
    again = ["--resume=" + str(dumps / "grow.pt"), f"--steps={steps}", f"--dump-dir={ref}"]
    refs = [
        _launcher(tmp_path, "node0", nodes[0].daemon.socket, port, *again),
        _launcher(tmp_path, "node1", daemon.socket, port, *again),
    ]
    ref_out: list[list[str]] = [[], []]
    for p, o in zip(refs, ref_out):
        _follow(p, o, "\0")
    assert _wait_all(refs, RUN_TIMEOUT_S) == [0, 0], ref_out
    reference = _load(ref / "final.pt")
    assert reference["step"] == finals[0]["step"] == steps
    _assert_bitwise_equal(finals[0]["model"], reference["model"], "model")
    _assert_bitwise_equal(finals[0]["optimizer"], reference["optimizer"], "optimizer")
