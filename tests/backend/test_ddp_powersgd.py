"""DDP with torch's PowerSGD comm hooks on backend "smddp": trains as gloo does, fails as it must.

PowerSGD is the hardest case for a Python backend's Futures: ``powerSGD_hook`` and
``batched_powerSGD_hook`` chain ``then`` callbacks that start further all_reduces
(``async_op=True``) and wait on their Futures from torch's inter-op pool (``get_future`` on a
foreign thread, backend/work.py). The model has a 1-D bias and a [1, H] weight that
PowerSGD all_reduces uncompressed, small compressed weights, and two large ones (> 1 MiB, the
region's buffer at these worlds: larger ops run on the progress thread) whose P and Q
all_reduces are also larger than 1 MiB, so the callbacks' ops take both the region's inline
path and the progress thread.

Each rank trains two DDP models with the same seed in the same process, one on the smddp
default group and one on a gloo group, and compares their parameters after every step: bitwise
at world 2 (a + b commutes bitwise), within rounding at world 3 (gloo's order of the sum is
its own), bitwise across smddp's ranks always. Then a rank is SIGKILLed in PowerSGD's
compressed phase: every survivor must raise SmddpRankFailedError from ``backward()`` and exit 1.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

# Bigger than 262,144 so that the [H, 8] and [16, H] weights' P (H x rank) and Q (H x rank)
# are over 1 MiB at rank 1 (the region's buffer: the op runs on the progress thread).
HIDDEN = 270_000
STEPS = 6
START_POWERSGD_ITER = 2  # steps 0-1: PowerSGD's vanilla all_reduce warm-up; then compressed
# One bucket (the model's gradients are 27 MB). With several, PowerSGD races with itself on
# any backend whose Futures complete on another thread: the inter-op pool starts one bucket's
# P all_reduce while the autograd thread starts the next bucket's first one, in an order that
# differs between ranks (measured: gloo aborts the process, "Received data size doesn't match
# expected size"; smddp raises SmddpMismatchError). NCCL's Futures complete at launch, so
# there the callbacks run in the autograd thread, in order.
BUCKET_CAP_MB = 64.0
REGION_BYTES = 256 << 10
BOUND_S = 5.0  # as tests/failures/ddp_launch.py: a survivor raises this soon after the kill
VICTIM = 2
NODE = "node-a"


def _model(rank: int) -> torch.nn.Module:
    from torch import nn

    torch.manual_seed(1000 + rank)  # ranks start apart; DDP broadcasts rank 0's weights
    return nn.Sequential(
        nn.Linear(8, HIDDEN),  # weight [H, 8]: compressed, P = H x rank
        nn.Tanh(),
        nn.Linear(HIDDEN, 16),  # weight [16, H]: compressed, Q = H x rank
        nn.Tanh(),
        nn.Linear(16, 16),  # small, compressed
        nn.Tanh(),
        nn.Linear(16, 1),  # weight [1, 16]: too thin to compress, all_reduced as it is
    )


def _hook(config: str, group: Any) -> tuple[Any, Any]:
    """The comm hook and its state for ``config``: "powerSGD rank 1", "powerSGD rank 2",
    "batched rank 1" or "fp16 powerSGD rank 1" (fp16_compress_wrapper(powerSGD_hook))."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    state = powersgd.PowerSGDState(
        process_group=group,
        matrix_approximation_rank=int(config.rsplit(" ", 1)[1]),
        start_powerSGD_iter=START_POWERSGD_ITER,
        use_error_feedback=True,
        warm_start=True,
        random_seed=0,  # the same initial Qs on every rank and for both backends
    )
    if config.startswith("batched"):
        return state, powersgd.batched_powerSGD_hook
    if config.startswith("fp16"):
        return state, default_hooks.fp16_compress_wrapper(powersgd.powerSGD_hook)
    return state, powersgd.powerSGD_hook


def _digest(params: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _train(rank: int, group: Any, config: str) -> tuple[list[list[torch.Tensor]], str | None, Any]:
    """Up to STEPS steps of DDP with ``config``'s hook on ``group``: the parameters after each
    step, the error that ended the training early (its type, step and the function of torch
    that raised it; None when every step ran) and the hook's state."""
    import traceback

    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model(rank)
    ddp = DDP(model, process_group=group, bucket_cap_mb=BUCKET_CAP_MB)
    state, hook = _hook(config, group)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(7 + rank)  # each rank its own shard
    after = []
    for step in range(STEPS):
        x = torch.randn(16, 8, generator=data)
        opt.zero_grad()
        try:
            F.mse_loss(ddp(x), x.sum(dim=1, keepdim=True).sin()).backward()
        except (AssertionError, RuntimeError) as exc:
            # torch 2.13's batched_powerSGD_hook fails its first compressed step on every
            # backend (it hands _orthogonalize a 2-D Q, which asserts a batch of 3-D ones):
            # smddp must fail it exactly as gloo does.
            where = traceback.extract_tb(exc.__traceback__)[-1].name
            return after, f"{type(exc).__name__} at step {step} in {where}", state
        opt.step()
        after.append([p.detach().clone() for p in model.parameters()])
    return after, None, state


def train_both(rank: int, world: int, init_file: str, configs: list[str]) -> dict[str, Any]:
    """Trains ``configs`` on smddp and on gloo, in this process; per config and step: the
    digest of smddp's parameters, whether gloo's are bitwise equal, and whether they are close.
    """
    import torch.distributed as dist

    import smddp  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)  # the ranks share two cores
    dist.init_process_group("smddp", init_method=f"file://{init_file}", rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    out: dict[str, Any] = {}
    for config in configs:
        ours, our_error, state = _train(rank, dist.group.WORLD, config)
        theirs, their_error, _ = _train(rank, gloo, config)
        # PowerSGD's own count of iterations: the compressed phase ran, and (rank 1) its P
        # or Q all_reduces were larger than the region's buffer.
        largest = max(
            (
                t.numel() * t.element_size()
                for t in [*state.p_memory_dict.values(), *state.q_memory_dict.values()]
            ),
            default=0,
        )
        out[config] = {
            "digests": [_digest(ps) for ps in ours],
            "bitwise": [all(torch.equal(a, b) for a, b in zip(o, t)) for o, t in zip(ours, theirs)],
            "close": [
                all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(o, t))
                for o, t in zip(ours, theirs)
            ],
            "errors": (our_error, their_error),
            "steps": (len(ours), len(theirs)),
            "trained": len(ours) > 1
            and not all(torch.equal(a, b) for a, b in zip(ours[0], ours[-1])),
            "iter": state.iter,
            "largest_pq_bytes": largest,
        }
    dist.destroy_process_group()
    return out


CONFIGS = ["powerSGD rank 1", "powerSGD rank 2", "batched rank 1"]


def rank_env(daemon: Any) -> dict[str, str]:
    """The ranks' environment: the fixture's daemon and no embedded fallback."""
    return dict(os.environ, SMDDP_SOCKET=daemon.socket, SMDDP_EMBEDDED="0", SMDDP_NODE_ID=NODE)


def _check_runs(results: list[dict[str, Any]], configs: list[str], bitwise: bool) -> None:
    for config in configs:
        for rank, got in enumerate(results):
            r = got[config]
            our_error, their_error = r["errors"]
            assert our_error == their_error, (config, rank, r["errors"])
            assert r["steps"][0] == r["steps"][1], (config, rank, r["steps"])
            if config.startswith("batched"):
                # The upstream bug (see _train) ends it at the first compressed step, if at all.
                assert r["steps"][0] >= START_POWERSGD_ITER, (config, rank, r)
            else:
                assert our_error is None, (config, rank, our_error)
                assert r["trained"], (config, rank)
                # PowerSGD's iter counts steps from 0: the compressed phase ran.
                assert r["iter"] >= STEPS - 1 > START_POWERSGD_ITER, (config, rank, r["iter"])
            if bitwise:
                assert all(r["bitwise"]), f"{config}: rank {rank}: smddp != gloo {r['bitwise']}"
            else:
                assert all(r["close"]), f"{config}: rank {rank}: smddp far from gloo {r['close']}"
            # smddp reduces in rank order: every rank holds the same bits after every step.
            assert r["digests"] == results[0][config]["digests"], (config, rank)
        if config.startswith("powerSGD"):
            # powerSGD_hook's P and Q of the [H, 8] and [16, H] weights: larger than the
            # region's buffer, so the callbacks' all_reduces ran on the progress thread (in
            # float16 they are half as large and stay in the region).
            assert results[0][config]["largest_pq_bytes"] > REGION_BYTES, results[0][config]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_powersgd_trains_like_gloo(
    world: int, daemon: Any, spawn_ranks: Any, tmp_path: Path
) -> None:
    configs = CONFIGS + (["fp16 powerSGD rank 1"] if world == 2 else [])
    results = spawn_ranks(
        train_both, world, world, str(tmp_path / "init"), configs, env=rank_env(daemon)
    ).join()
    _check_runs(results, configs, bitwise=world == 2)


def train_until_failure(
    rank: int, world: int, init_file: str, record_file: str, dies_in: str
) -> None:
    """powerSGD_hook training on smddp until the group fails; prints "compressed" once past
    START_POWERSGD_ITER, writes the error's type, message and time to ``record_file`` and
    raises it again (the process exits 1 because of it).

    ``dies_in`` "P" or "Q": once it has printed "compressed", rank VICTIM SIGKILLs itself
    instead of starting that all_reduce, which a ``then`` callback starts and waits for on
    torch's inter-op pool, so the others wait for it there ("anywhere": the test kills it).
    """
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import smddp  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    dist.init_process_group("smddp", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model = _model(rank)
    ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
    state, hook = _hook("powerSGD rank 1", None)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(7 + rank)
    armed = threading.Event()
    if rank == VICTIM and dies_in in ("P", "Q"):
        all_reduce = dist.all_reduce
        memory = state.p_memory_dict if dies_in == "P" else state.q_memory_dict

        def dying_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if armed.is_set() and 0 in memory and tensor.data_ptr() == memory[0].data_ptr():
                Path("dying").write_text(repr(time.time()))  # in its folder: when it died
                os.kill(os.getpid(), signal.SIGKILL)
            return all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = dying_all_reduce  # powerSGD_hook calls dist.all_reduce
    deadline = time.monotonic() + 90
    try:
        step = 0
        while time.monotonic() < deadline:
            x = torch.randn(16, 8, generator=data)
            opt.zero_grad()
            F.mse_loss(ddp(x), x.sum(dim=1, keepdim=True).sin()).backward()
            opt.step()
            step += 1
            if step == START_POWERSGD_ITER + 2:
                print("compressed", flush=True)
                armed.set()
    except RuntimeError as exc:  # DistBackendError, or torch's wrap of a callback's error
        record: dict[str, Any] = {
            "type": type(exc).__name__,
            "module": type(exc).__module__,
            "message": str(exc),
            "failed_at": time.time(),
            "compressed": state.iter > START_POWERSGD_ITER,
        }
        started = time.monotonic()
        dist.destroy_process_group()
        record["destroy_s"] = time.monotonic() - started
        Path(record_file).write_text(json.dumps(record))
        raise
    raise AssertionError(f"rank {rank}: trained {step} steps and nothing failed")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dies_in", ["anywhere", "P", "Q"])
def test_killed_rank_in_powersgd(
    dies_in: str, daemon: Any, spawn_ranks: Any, tmp_path: Path
) -> None:
    """SIGKILL of rank VICTIM in the compressed phase (by the test at no particular point, or
    by itself where the others wait in a callback's P or Q all_reduce): rank 0 and 1 raise
    SmddpRankFailedError naming it within BOUND_S, destroy their group and exit 1 (not a
    signal)."""
    world = 3
    # Each rank runs in a folder of its own (spawn_ranks), where it leaves "record.json".
    ranks = spawn_ranks(
        train_until_failure,
        world,
        world,
        str(tmp_path / "init"),
        "record.json",
        dies_in,
        env=rank_env(daemon),
    )
    try:
        ranks.wait_for("compressed")
        victim = ranks.ranks[VICTIM].proc
        killed_at = time.time()
        if dies_in == "anywhere":
            victim.kill()
        assert victim.wait(timeout=30) == -signal.SIGKILL, ranks.ranks[VICTIM].failure()
        if dies_in != "anywhere":
            killed_at = float((ranks.ranks[VICTIM].folder / "dying").read_text())
        got = []
        for r in range(world):
            if r == VICTIM:
                continue
            proc = ranks.ranks[r].proc
            try:
                rc = proc.wait(timeout=30)
            except Exception:
                pytest.fail(f"rank {r} still runs 30 s after the kill:\n{ranks.ranks[r].stderr()}")
            assert rc == 1, (
                f"rank {r} exited with {rc} (negative: a signal):\n{ranks.ranks[r].failure()}"
            )
            got.append(json.loads((ranks.ranks[r].folder / "record.json").read_text()))
    finally:
        ranks.kill()
    dead = (
        rf"job j[0-9a-f]{{16}} comm 0: rank {VICTIM} \(pid {victim.pid}, node {NODE}\) "
        r"disconnected without leaving the communicator .+"
    )
    for g in got:
        if g["type"] != "RuntimeError":
            assert g["module"] == "smddp.backend.errors", g
            assert g["type"] == "SmddpRankFailedError", g
            assert re.fullmatch(dead, g["message"]), g["message"]
        else:
            # Left open in backend/work.py (_backward_done): when the pass ends while a
            # chain's callback has not yet begun to wait for its op (P's, or Q's after P),
            # and that op then fails, backward() raises torch's RuntimeError "Got the
            # following error when running the callback: ..." around the error; it still
            # names the dead rank, and nothing crashes or hangs. Seen for P once in CI, on a
            # loaded machine (the survivors' pass ended before their P all_reduce failed).
            assert re.fullmatch(
                rf"(Got the following error when running the callback: (RuntimeError: )?)+"
                rf"SmddpRankFailedError: {dead}",
                g["message"],
                re.S,
            ), g["message"]
        assert g["compressed"], g
        assert g["failed_at"] - killed_at < BOUND_S, g["failed_at"] - killed_at
        assert g["destroy_s"] < 5.0, g
    print(
        dies_in,
        [g["type"] for g in got],
        got[0]["message"],
        [round(g["failed_at"] - killed_at, 2) for g in got],
    )
