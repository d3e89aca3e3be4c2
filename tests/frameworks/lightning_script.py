"""Lightning's DDPStrategy on backend "smddp" (run under torchrun, 3 CPU processes).

Every rank checks that the trained weights are the same on all ranks; rank 0 prints them.
"""

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g))
model = Model()
trainer = L.Trainer(
    accelerator="cpu",
    devices=3,
    num_nodes=1,
    strategy=DDPStrategy(process_group_backend="smddp"),
    max_epochs=2,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(model, DataLoader(data, batch_size=4))
assert dist.get_backend() == "smddp", dist.get_backend()
w = model.net.weight.detach().clone()
everyone = [torch.empty_like(w) for _ in range(dist.get_world_size())]
dist.all_gather(everyone, w)
assert all(torch.equal(e, w) for e in everyone), "ranks diverged"
if trainer.global_rank == 0:
    print(f"lightning ok world={trainer.world_size} steps={trainer.global_step}", flush=True)
