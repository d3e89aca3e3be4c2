"""Hugging Face Trainer with DDP on CPU on backend "smddp" (run under torchrun, 3 processes).

On CPU, Accelerate (under the Trainer) picks gloo or mpi itself and refuses
``ddp_backend="smddp"`` ("Your assigned backend smddp is not available, please use gloo"); it
uses a default process group that already exists, so the script makes it first. Every rank
checks that the trained weights agree across ranks; rank 0 prints the result.
"""

import atexit
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8, 1)

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


dist.init_process_group(backend="smddp")
g = torch.Generator().manual_seed(1)
xs, ys = torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g)
data = [{"x": xs[i], "labels": ys[i]} for i in range(48)]
output_dir = tempfile.mkdtemp(prefix="smddp-hf-")
atexit.register(shutil.rmtree, output_dir, True)
args = TrainingArguments(
    output_dir=output_dir,
    per_device_train_batch_size=4,
    max_steps=4,
    learning_rate=0.1,
    use_cpu=True,
    report_to=[],
    save_strategy="no",
    logging_strategy="no",
    dataloader_num_workers=0,
    disable_tqdm=True,
)
trainer = Trainer(model=Model(), args=args, train_dataset=data)
trainer.train()
assert dist.is_initialized() and dist.get_backend() == "smddp", (
    dist.get_backend() if dist.is_initialized() else None
)
assert args.world_size == 3, args.world_size
w = (
    trainer.model.net.weight.detach().clone()
    if hasattr(trainer.model, "net")
    else trainer.model.module.net.weight.detach().clone()
)
everyone = [torch.empty_like(w) for _ in range(dist.get_world_size())]
dist.all_gather(everyone, w)
assert all(torch.equal(e, w) for e in everyone), "ranks diverged"
if dist.get_rank() == 0:
    print(f"hf trainer ok world={args.world_size} steps={trainer.state.global_step}", flush=True)
sys.exit(0)
