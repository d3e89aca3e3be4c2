"""DistributedDataParallel on backend "smddp": same training as gloo, and DDP's comm hooks.

Every rank is its own process (a segfault in DDP's C++ reducer fails the test through the
rank's exit status) and reaches the fixture's daemon through SMDDP_SOCKET.
"""

from __future__ import annotations

import os

import pytest
import torch

WORLD = 2
STEPS = 6
HOOKS = ["allreduce_hook", "fp16_compress_hook", "builtin FP16_COMPRESS"]


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
    for hook in ["none", *hooks]:
        torch.manual_seed(1000 + rank)  # ranks start apart; DDP must broadcast rank 0's weights
        model = nn.Sequential(
            nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
        )
        ddp = DDP(model, bucket_cap_mb=0.002)  # several buckets (about 500 floats each)
        if hook == "allreduce_hook":
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        elif hook == "fp16_compress_hook":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif hook == "builtin FP16_COMPRESS":
            ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
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


@pytest.mark.timeout(180)
def test_ddp_comm_hooks(daemon, spawn_ranks, tmp_path):
    """Python hooks and the built-in C++ FP16_COMPRESS hook run, train and agree with no hook."""
    results = spawn_ranks(
        train, WORLD, WORLD, "smddp", str(tmp_path / "init"), HOOKS, env=rank_env(daemon)
    ).join()

    for rank_results in results:
        plain = rank_results["none"]["params"]
        torch.testing.assert_close(
            rank_results["allreduce_hook"]["params"], plain, rtol=1e-6, atol=1e-7
        )
        for hook in ("fp16_compress_hook", "builtin FP16_COMPRESS"):
            # Gradients travel as float16: close to the float32 run, not equal.
            torch.testing.assert_close(rank_results[hook]["params"], plain, rtol=1e-2, atol=1e-2)
    for hook in ["none", *HOOKS]:
        for a, b in zip(results[0][hook]["params"], results[1][hook]["params"]):
            assert torch.equal(a, b), f"{hook}: ranks disagree"
