"""DeepSpeed ZeRO stages 1, 2 and 3 on backend "smddp" (run under torchrun, DS_ACCELERATOR=cpu).

Each stage trains the same model on the same global batch (each rank its share); every rank
checks that all ranks hold the same parameters, and rank 0 prints the all-reduced mean loss of
every step, which the test compares with the same run on gloo (DS_TEST_BACKEND=gloo).
"""

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.distributed as dist

STEPS, BATCH = 3, 2

BACKEND = os.environ.get("DS_TEST_BACKEND", "smddp")
deepspeed.init_distributed(dist_backend=BACKEND)
rank, world = dist.get_rank(), dist.get_world_size()
assert dist.get_backend() == BACKEND, dist.get_backend()


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(world * BATCH, 8, generator=g), torch.randn(world * BATCH, 1, generator=g)


results = {}
for stage in (1, 2, 3):
    m = model()
    config = {
        "train_batch_size": world * BATCH,
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    engine, _, _, _ = deepspeed.initialize(model=m, optimizer=opt, config=config)
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        rows = slice(rank * BATCH, (rank + 1) * BATCH)
        loss = torch.nn.functional.mse_loss(engine(x[rows]), y[rows])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        flat = torch.cat([p.detach().reshape(-1).clone() for p in engine.module.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(e, flat) for e in everyone), (
        f"stage {stage}: ranks hold different parameters"
    )
    results[stage] = losses
    engine.destroy()

if rank == 0:
    print("deepspeed ok " + json.dumps({f"zero{k}": v for k, v in results.items()}), flush=True)
dist.destroy_process_group()
sys.exit(0)
