"""DistributedDataParallel on backend "smddp": same training as gloo, and DDP's comm hooks.

Every rank is its own process (a segfault in DDP's C++ reducer fails the test through the
rank's exit status) and reaches the fixture's daemon through SMDDP_SOCKET.
"""

from __future__ import annotations

import os
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

WORLD = 2
STEPS = 6
HOOKS = ["allreduce_hook", "fp16_compress_hook", "builtin FP16_COMPRESS", "float16 reference"]
FP16_HOOKS = ("fp16_compress_hook", "builtin FP16_COMPRESS")


def train(rank: int, world: int, backend: str, init_file: str, hooks: list[str]) -> dict:
    """Trains a small MLP with DDP, once without a comm hook and once per hook in ``hooks``.

    Returns:
        {hook or "none": {"params": final parameters, "losses": per-step losses}}.
    """
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import smddp  # noqa: F401  (registers the backend)

    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    assert dist.get_backend() == backend
    results = {}
    calls = {"fp16_compress_hook": 0, "float16 reference": 0}

    def counted_fp16_compress_hook(state, bucket):
        calls["fp16_compress_hook"] += 1
        return default_hooks.fp16_compress_hook(state, bucket)

    def float16_reference_hook(state, bucket):
        # What FP16 compression must give, computed here with float16 rounding at each step:
        # every rank's gradients rounded to float16 and divided by the world size (as both
        # compress hooks do), gathered unchanged (all_gather only copies), summed in rank order
        # in float16 (as the daemon reduces), widened back to float32.
        calls["float16 reference"] += 1
        buffer = bucket.buffer()
        compressed = buffer.to(torch.float16).div_(world)
        parts = [torch.empty_like(compressed) for _ in range(world)]
        dist.all_gather(parts, compressed)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        assert total.dtype == torch.float16
        buffer.copy_(total)
        fut = torch.futures.Future()
        fut.set_result(buffer)
        return fut

    for hook in ["none", *hooks]:
        torch.manual_seed(1000 + rank)  # ranks start apart; DDP must broadcast rank 0's weights
        model = nn.Sequential(
            nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
        )
        ddp = DDP(model, bucket_cap_mb=0.002)  # several buckets (about 500 floats each)
        if hook == "allreduce_hook":
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        elif hook == "fp16_compress_hook":
            ddp.register_comm_hook(None, counted_fp16_compress_hook)
        elif hook == "builtin FP16_COMPRESS":
            ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
        elif hook == "float16 reference":
            ddp.register_comm_hook(None, float16_reference_hook)
        initial = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        data = torch.Generator().manual_seed(7 + rank)  # each rank its own shard
        losses = []
        for _ in range(STEPS):
            x = torch.randn(16, 8, generator=data)
            y = x.sum(dim=1, keepdim=True).sin()
            opt.zero_grad()
            loss = F.mse_loss(ddp(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        params = [p.detach().clone() for p in model.parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(initial, params)), (
            f"{hook}: nothing was trained"
        )
        results[hook] = {"params": params, "losses": losses}
    dist.destroy_process_group()
    results["calls"] = calls
    return results


def rank_env(daemon) -> dict[str, str]:
    """The ranks' environment: the fixture's daemon and no embedded fallback."""
    env = dict(os.environ, SMDDP_SOCKET=daemon.socket, SMDDP_EMBEDDED="0")
    return env


@pytest.mark.timeout(180)
def test_ddp_trains_like_gloo(daemon, spawn_ranks, tmp_path):
    env = rank_env(daemon)
    runs = {
        backend: spawn_ranks(
            train, WORLD, WORLD, backend, str(tmp_path / f"{backend}.init"), [], env=env
        )
        for backend in ("smddp", "gloo")
    }
    results = {backend: [r["none"] for r in ranks.join()] for backend, ranks in runs.items()}

    smddp_ranks, gloo_ranks = results["smddp"], results["gloo"]
    for r in range(1, WORLD):
        # smddp reduces in rank order: every rank holds the same bits.
        for a, b in zip(smddp_ranks[0]["params"], smddp_ranks[r]["params"]):
            assert torch.equal(a, b)
    for r in range(WORLD):
        torch.testing.assert_close(
            smddp_ranks[r]["params"], gloo_ranks[r]["params"], rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(
            smddp_ranks[r]["losses"], gloo_ranks[r]["losses"], rtol=1e-5, atol=1e-6
        )


def _ops_by_dtype(port: int, op: str) -> dict[str, float]:
    """The daemon's smddp_ops_total for ``op``, by dtype."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        s.labels["dtype"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "smddp_ops_total" and s.labels["op"] == op
    }


@pytest.mark.timeout(300)  # five trainings in two fresh processes; slow on a loaded machine
def test_ddp_comm_hooks(start_daemon, spawn_ranks, tmp_path):
    """Python hooks and the built-in C++ FP16_COMPRESS hook run and train; the FP16 hooks send
    float16 to the daemon and give exactly what float16 rounding gives."""
    daemon = start_daemon(args=("--http-bind", "127.0.0.1:0"))
    port = daemon.http_port()
    results = spawn_ranks(
        train, WORLD, WORLD, "smddp", str(tmp_path / "init"), HOOKS, env=rank_env(daemon)
    ).join()

    for rank_results in results:
        plain = rank_results["none"]["params"]
        torch.testing.assert_close(
            rank_results["allreduce_hook"]["params"], plain, rtol=1e-6, atol=1e-7
        )
        reference = rank_results["float16 reference"]["params"]
        # float16 rounding changed the training: the reference is not the float32 run.
        assert not all(torch.equal(a, b) for a, b in zip(reference, plain))
        for hook in FP16_HOOKS:
            # Bit for bit what float16 rounding gives: the gradients were compressed.
            for a, b in zip(rank_results[hook]["params"], reference):
                assert torch.equal(a, b), f"{hook} differs from the float16 reference"
            assert rank_results[hook]["losses"] == rank_results["float16 reference"]["losses"]
    for hook in ["none", *HOOKS]:
        for a, b in zip(results[0][hook]["params"], results[1][hook]["params"]):
            assert torch.equal(a, b), f"{hook}: ranks disagree"

    # The daemon saw each compressed bucket as a float16 all_reduce: one per call of the Python
    # hook and as many for the built-in hook (the same buckets and steps); nothing else of the
    # run sends float16 all_reduces (the reference gathers).
    calls = results[0]["calls"]
    assert calls["fp16_compress_hook"] == calls["float16 reference"] >= STEPS, calls
    all_reduces = _ops_by_dtype(port, "all_reduce")
    assert all_reduces["float16"] == 2 * calls["fp16_compress_hook"], (all_reduces, calls)
    assert _ops_by_dtype(port, "all_gather")["float16"] == calls["float16 reference"]
    assert daemon.stop() == 0, daemon.log()


def futures(rank: int, world: int, init_file: str) -> dict:
    """``Work.get_future()`` before the op can complete (rank 1 starts its op only once rank 0
    holds the Future): small ops (the region's inline path) and large ones (the progress
    thread), a non-contiguous output (its copy-back runs before the Future completes), a
    ``then`` callback; then failed ops (mismatched dtypes) seen through ``fut.wait()``, a
    ``then`` callback and a backward pass that never waits for its Future."""
    import torch.distributed as dist

    from smddp.backend.errors import SmddpMismatchError

    dist.init_process_group("smddp", init_method=f"file://{init_file}", rank=rank, world_size=world)
    store = dist.distributed_c10d._get_default_store()
    out: dict = {}
    for name, n in (("small", 16), ("large", 1 << 20)):
        base = torch.full((n, 2), float(rank + 1))
        t = base[:, 0]  # not contiguous: reduced in a staging copy, copied back at the end
        if rank == 1:
            store.wait([f"go-{name}"])
        fut = dist.all_reduce(t, async_op=True).get_future()
        pending = not fut.done()
        if rank == 0:
            store.set(f"go-{name}", "1")
        total = fut.then(lambda f: f.value()[0].sum().item())
        got = fut.wait()[0]
        out[name] = {
            "pending": pending,
            "value": torch.equal(got, torch.full((n,), 3.0)) and got is t,
            "copied_back": torch.equal(base[:, 0], torch.full((n,), 3.0))
            and bool((base[:, 1] == rank + 1).all()),
            "then": total.wait(),
        }

    def mismatched(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.float32 if rank == 0 else torch.float64)

    errors = {}
    group = dist.new_group(backend="smddp")
    if rank == 1:
        store.wait(["go-fail"])
    fut = dist.all_reduce(mismatched(1 << 20), group=group, async_op=True).get_future()
    if rank == 0:
        store.set("go-fail", "1")
    seen = fut.then(lambda f: f.value())
    for what, call in (("wait", fut.wait), ("then", seen.wait)):
        try:
            call()
            errors[what] = None
        except Exception as exc:  # the test reports what came
            errors[what] = (type(exc).__name__, str(exc))

    class Reduced(torch.autograd.Function):
        """Identity forward; its backward launches an all_reduce of the gradient and hands
        out its Future without waiting, as DDP does with a bucket."""

        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            return x.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            if rank == 1:
                store.wait(["go-backward"])
            ctx.fut = dist.all_reduce(
                mismatched(1 << 20), group=backward_group, async_op=True
            ).get_future()
            if rank == 0:
                store.set("go-backward", "1")
            return g

    backward_group = dist.new_group(backend="smddp")
    x = torch.ones(4, requires_grad=True)
    try:
        Reduced.apply(x).sum().backward()
        errors["backward"] = None
    except SmddpMismatchError as exc:
        errors["backward"] = (type(exc).__name__, str(exc))
    out["errors"] = errors
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(180)
def test_futures_complete_later(daemon, spawn_ranks, tmp_path):
    results = spawn_ranks(
        futures, WORLD, WORLD, str(tmp_path / "init"), env=rank_env(daemon)
    ).join()
    for rank, got in enumerate(results):
        for name in ("small", "large"):
            r = got[name]
            if rank == 0:
                assert r["pending"], (
                    f"{name}: rank 0's Future was done before rank 1 started the op"
                )
            assert r["value"] and r["copied_back"], (rank, name, r)
            assert r["then"] == 3.0 * (16 if name == "small" else 1 << 20), (rank, name, r)
        errors = got["errors"]
        assert errors["wait"][0] == "SmddpMismatchError", errors
        # A then callback's fut.value() raises it too, and its Future fails with the message.
        assert errors["then"] is not None and errors["wait"][1] in errors["then"][1], errors
        # Raised from backward() with its type, though nothing in backward waited for it.
        assert errors["backward"] is not None and errors["backward"][0] == "SmddpMismatchError", (
            errors
        )
