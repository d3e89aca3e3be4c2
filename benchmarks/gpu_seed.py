"""A SageMaker-style data-parallel training script, as users bring it, for the GPU check.

    torchrun --nproc-per-node 2 benchmarks/gpu_seed.py [--epochs 3] [--model-dir DIR]

What such a script does, in its order: ``init_process_group("smddp")``,
``torch.cuda.set_device(local_rank % device_count)`` (ranks share a GPU where a node has
fewer GPUs than ranks: the lent machine has one), ``model.cuda()``, ``DDP(model)``, a
``DistributedSampler``, ``set_epoch`` each epoch, and a checkpoint written by rank 0. At the
end every rank checks, with collectives on GPU tensors, that all ranks hold the same
parameters (all_reduce MAX and MIN of the flat parameters agree), and prints one line
``SEED_RESULT {json}`` that ``gpu_check_stages.py seed`` reads.

The data: a fixed synthetic 10-class problem (64 features, as sklearn's digits), so the
script needs nothing beyond torch. Under the dry run's fake GPU (SMDDP_CHECK_FAKE_GPU) the
model's parameters and the checksums live in fake GPU memory (``gpu_check_common.Gpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.*, run as a file

from benchmarks.gpu_check_common import Gpu, fake_gpu

MARK = "SEED_RESULT "


class Net(nn.Module):
    """A small classifier of 64 features into 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 128)
        self.fc3 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def dataset(n: int = 2048) -> TensorDataset:
    """The same 10-class data on every rank: labels of a fixed random linear teacher."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 64, generator=g)
    teacher = torch.randn(64, 10, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def main() -> None:
    """Trains, checks the ranks agree, rank 0 saves model.pt; prints SEED_RESULT."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--samples", type=int, default=2048, help="size of the data set")
    parser.add_argument("--model-dir", default=os.environ.get("SM_MODEL_DIR", "./model"))
    args = parser.parse_args()

    import smddp  # noqa: F401  (registers the backend, as SageMaker's import does)

    dist.init_process_group(backend="smddp")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    gpu = Gpu(local_rank)  # torch.cuda.set_device(local_rank % torch.cuda.device_count())

    torch.manual_seed(0)
    model = gpu.module(Net())  # model.cuda()
    model = DDP(model, device_ids=None if fake_gpu() else [gpu.index])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    data = dataset(args.samples)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=max(1, args.batch_size // world), sampler=sampler)

    losses: list[float] = []
    steps = 0
    start = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for x, y in loader:
            x, y = gpu.tensor(x), gpu.tensor(y)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total += float(loss.item())
            batches += 1
            steps += 1
        losses.append(total / max(1, batches))
    gpu.sync()
    step_s = (time.perf_counter() - start) / max(1, steps)

    # Every rank holds the same parameters: the MAX and the MIN over ranks agree, bit for bit.
    flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    hi, lo = gpu.tensor(flat), gpu.tensor(flat)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    gpu.sync()
    identical = bool(torch.equal(hi.cpu(), lo.cpu()))

    if rank == 0:
        os.makedirs(args.model_dir, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(args.model_dir, "model.pt"))
    dist.barrier()
    dist.destroy_process_group()
    result = {
        "rank": rank,
        "world": world,
        "device": str(gpu.device) if gpu.fake is None else "fake GPU 0",
        "steps": steps,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "identical": identical,
        "step_s": step_s,
    }
    print(MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
