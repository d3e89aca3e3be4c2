# Data-parallel training with the "smddp" torch.distributed backend.
#
# Shaped like Amazon SageMaker's distributed data parallel PyTorch example
# (import smdistributed.dataparallel.torch.torch_smddp, then
# dist.init_process_group(backend="smddp")), but trained on scikit-learn's
# bundled 8x8 handwritten digits, so it needs no download.
#
# Run:
#     torchrun --standalone --nproc-per-node 2 examples/train_digits.py
#
# It trains on the node's GPUs when torch sees any (ranks share them when there are
# fewer GPUs than ranks), else on the CPU.
#
# For development without the smddp backend, set SMDDP_EXAMPLE_BACKEND to
# another torch.distributed backend (e.g. "gloo"); the smddp import is then
# skipped.

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

BACKEND = os.environ.get("SMDDP_EXAMPLE_BACKEND") or "smddp"

if BACKEND == "smddp":
    # Registers the "smddp" backend with torch.distributed (SageMaker's import).
    import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401


class Net(nn.Module):
    """A small CNN for 1x8x8 digit images."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.dropout1 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(32 * 4 * 4, 128)
        self.dropout2 = nn.Dropout(0.5)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def pick_device(local_rank):
    """This rank's GPU where the node has GPUs, else the CPU.

    With fewer GPUs than ranks on the node the ranks share them, round robin (one GPU:
    every rank on GPU 0), which smddp and gloo allow (NCCL does not).
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    gpu = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(gpu)
    return torch.device("cuda", gpu)


def load_datasets(seed):
    """The digits data set, scaled to [0, 1], with a fixed stratified 80/20 split."""
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target, dtype=torch.long)
    idx_train, idx_test = train_test_split(
        range(len(y)), test_size=0.2, random_state=seed, stratify=digits.target
    )
    return (
        TensorDataset(x[idx_train], y[idx_train]),
        TensorDataset(x[idx_test], y[idx_test]),
    )


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    loss_sum = torch.zeros(1, device=device)
    count = torch.zeros(1, device=device)
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach() * len(data)
        count += len(data)
        if args.rank == 0 and batch_idx % args.log_interval == 0:
            seen = batch_idx * len(data) * args.world_size
            total = len(train_loader.dataset)
            pct = 100.0 * batch_idx / len(train_loader)
            print(
                f"Train Epoch: {epoch} [{seen}/{total} ({pct:.0f}%)]\tLoss: {loss.item():.6f}",
                flush=True,
            )
    # Average loss over every sample seen by every rank this epoch.
    totals = torch.cat([loss_sum, count])
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    avg_loss = (totals[0] / totals[1]).item()
    if args.rank == 0:
        print(f"Epoch {epoch}: average training loss {avg_loss:.4f}", flush=True)
    return avg_loss


def test(model, device, test_loader):
    model.eval()
    test_loss = 0.0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1)
            correct += pred.eq(target).sum().item()
    n = len(test_loader.dataset)
    test_loss /= n
    accuracy = correct / n
    print(
        f"Test set: Average loss: {test_loss:.4f}, "
        f"Accuracy: {correct}/{n} ({100.0 * accuracy:.2f}%)",
        flush=True,
    )
    print(f"final accuracy: {accuracy:.4f}", flush=True)
    return accuracy


def main():
    parser = argparse.ArgumentParser(description="smddp digits example")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=64,
        metavar="N",
        help="global training batch size, split across ranks (default: 64)",
    )
    parser.add_argument(
        "--test-batch-size",
        type=int,
        default=256,
        metavar="N",
        help="input batch size for testing (default: 256)",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=15,
        metavar="N",
        help="number of epochs to train (default: 15)",
    )
    parser.add_argument(
        "--lr", type=float, default=1.0, metavar="LR", help="learning rate (default: 1.0)"
    )
    parser.add_argument(
        "--gamma",
        type=float,
        default=0.85,
        metavar="M",
        help="learning rate step gamma (default: 0.85)",
    )
    parser.add_argument("--seed", type=int, default=1, metavar="S", help="random seed (default: 1)")
    parser.add_argument(
        "--log-interval",
        type=int,
        default=10,
        metavar="N",
        help="batches to wait before logging training status (default: 10)",
    )
    parser.add_argument(
        "--model-dir",
        type=str,
        default=os.environ.get("SM_MODEL_DIR", "./model"),
        help="where rank 0 saves model.pt (default: $SM_MODEL_DIR or ./model)",
    )
    args = parser.parse_args()

    start = time.time()
    dist.init_process_group(backend=BACKEND)

    args.world_size = dist.get_world_size()
    args.rank = rank = dist.get_rank()
    args.local_rank = local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # Keep the global batch size fixed: each rank takes its share.
    args.batch_size = max(args.batch_size // args.world_size, 1)

    device = pick_device(local_rank)

    if rank == 0:
        print(
            f"backend={BACKEND} world_size={args.world_size} device={device} "
            f"per-rank batch size={args.batch_size}",
            flush=True,
        )

    torch.manual_seed(args.seed)

    train_dataset, test_dataset = load_datasets(args.seed)
    train_sampler = DistributedSampler(
        train_dataset, num_replicas=args.world_size, rank=rank, shuffle=True, seed=args.seed
    )
    train_loader = DataLoader(
        train_dataset, batch_size=args.batch_size, shuffle=False, sampler=train_sampler
    )
    if rank == 0:
        test_loader = DataLoader(test_dataset, batch_size=args.test_batch_size, shuffle=False)

    model = Net().to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)

    for epoch in range(1, args.epochs + 1):
        train_sampler.set_epoch(epoch)
        train(args, model, device, train_loader, optimizer, epoch)
        scheduler.step()

    if rank == 0:
        test(model.module, device, test_loader)

    if rank == 0:
        os.makedirs(args.model_dir, exist_ok=True)
        path = os.path.join(args.model_dir, "model.pt")
        torch.save(model.module.state_dict(), path)
        print(f"rank {rank} saved checkpoint to {path}", flush=True)
        print(f"wall time: {time.time() - start:.1f}s", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
