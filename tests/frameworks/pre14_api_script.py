"""A training script written for SageMaker's pre-1.4 smdistributed.dataparallel API.

Run under a launcher (mpirun -np N, srun, torchrun); prints "pre14 ok" on every rank.
"""

import sys

import torch

import smdistributed.dataparallel.torch.distributed as dist
from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel as DDP

dist.init_process_group()
assert dist.is_available() and dist.is_initialized()
rank, world = dist.get_rank(), dist.get_world_size()
local_rank, local_size = dist.get_local_rank(), dist.get_local_size()
assert 0 <= local_rank < local_size <= world, (local_rank, local_size, world)

t = torch.ones(3) * (rank + 1)
dist.all_reduce(t, op=dist.ReduceOp.SUM)
assert torch.equal(t, torch.full((3,), world * (world + 1) / 2)), t
b = torch.arange(4.0) if rank == 0 else torch.zeros(4)
dist.broadcast(b, src=0)
assert torch.equal(b, torch.arange(4.0)), b
parts = [torch.zeros(2) for _ in range(world)]
dist.all_gather(parts, torch.full((2,), float(rank)))
assert all(torch.equal(p, torch.full((2,), float(r))) for r, p in enumerate(parts)), parts
out = torch.empty(world)
dist.all_to_all_single(out, torch.full((world,), float(rank)))
assert torch.equal(out, torch.arange(float(world))), out
dist.barrier()

torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1), broadcast_buffers=True, bucket_cap_mb=25)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))
loss = model(x).pow(2).mean()
loss.backward()
opt.step()
weights = [torch.zeros_like(model.module.weight) for _ in range(world)]
dist.all_gather(weights, model.module.weight.detach().clone())
assert all(torch.equal(w, weights[0]) for w in weights), "DDP ranks diverged"
dist.destroy_process_group()
# One write, newline included: a launcher that forwards output may split a print in two.
sys.stdout.write(
    f"pre14 ok rank={rank} world={world} local_rank={local_rank} local_size={local_size}\n"
)
sys.stdout.flush()
