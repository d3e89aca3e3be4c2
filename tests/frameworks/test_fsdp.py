"""FSDP1 and FSDP2 training on backend "smddp": ranks end identical, and equal to one process
training the same model on the same global batch."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from smddp_world import run_world  # noqa: E402

WORLD = 3
STEPS = 4
BATCH = 2  # per rank; the global batch is WORLD * BATCH rows


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 1),
    )


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD * BATCH, 8, generator=g), torch.randn(WORLD * BATCH, 1, generator=g)


def _train(model: torch.nn.Module, rows: slice) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _reference() -> dict[str, torch.Tensor]:
    model = _model()
    _train(model, slice(None))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fsdp2_rank(rank: int, world: int) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    _train(model, slice(rank * BATCH, (rank + 1) * BATCH))
    full = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
    via_dcp = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    for k, v in via_dcp.items():
        assert torch.equal(v, full[k]), k
    return _plain(full)


def fsdp1_rank(rank: int, world: int) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FullStateDictConfig, ShardingStrategy, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(
        _model(), sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=torch.device("cpu")
    )
    _train(model, slice(rank * BATCH, (rank + 1) * BATCH))
    with FSDP.state_dict_type(
        model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)
    ):
        return _plain(model.state_dict())


def _plain(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """By value: tensors on the result queue would travel as shared-memory handles, which
    die with the rank's process."""
    return {k: v.detach().numpy().copy() for k, v in state.items()}


def _check(results: list[dict[str, np.ndarray]]) -> None:
    ref = _reference()
    for rank, arrays in enumerate(results):
        got = {k: torch.from_numpy(v) for k, v in arrays.items()}
        assert got.keys() == ref.keys()
        for k in ref:
            assert np.array_equal(arrays[k], results[0][k]), (
                f"rank {rank} differs from rank 0 in {k}"
            )
            # Sums over ranks and over the global batch round differently; nothing more.
            torch.testing.assert_close(
                got[k], ref[k], rtol=1e-5, atol=1e-6, msg=f"{k} vs one process"
            )


@pytest.mark.timeout(300)
def test_fsdp2_training_matches_one_process() -> None:
    _check(run_world(WORLD, fsdp2_rank, timeout_s=280))


@pytest.mark.timeout(300)
def test_fsdp1_full_shard_training_matches_one_process() -> None:
    _check(run_world(WORLD, fsdp1_rank, timeout_s=280))
