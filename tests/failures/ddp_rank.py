"""One rank of the DDP failure tests: ``python ddp_rank.py SPEC_JSON``.

Started directly (the test sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or by torchrun
(which sets them). Trains a small MLP with DistributedDataParallel until its process group
fails, writes what it saw to ``<out>/rank<R>.json``, tries a plain all_reduce (its message goes
in the record as ``after``), destroys the process group and lets the error end the process, so that
a survivor exits with status 1 of its own accord.

SPEC fields:
- ``out``: folder for the result files.
- ``victim``, ``fail``: rank ``victim`` raises RuntimeError at step ``fail_step`` when
  ``fail`` is "raise" (on torchrun's first attempt only, when ``first_attempt_only``);
  "none" leaves the failure to the parent (it SIGKILLs a rank or the daemon).
- ``hook``: "none", "allreduce_hook", "fp16_compress_hook" or "builtin" (the C++ FP16_COMPRESS).
- ``mismatch``: "" or "model" (the victim's last layer is a Conv1d whose weight has one more
  dimension: the same parameter count, so DDP's own check lets it through, and its shape
  check's all_gather differs in size) or "hook" (the victim alone compresses its gradients
  to float16 with ``fp16_compress_hook``, so its bucket all_reduces in ``backward()`` differ
  in dtype from the others').
- ``program``: "ddp" (the default), or "funcol": instead of DDP, functional collectives
  (``torch.distributed._functional_collectives.all_reduce``, whose result torch waits for
  in C++ through ``wait_tensor``), checked, in a loop; or "fsdp1" / "fsdp2": FSDP training
  (FullyShardedDataParallel, fully_shard), whose collectives run in forward and backward.
- ``steps``: train this many steps and finish cleanly (0: until the group fails).
- ``backend``: "smddp" (the default), or "gloo" to compare.
- ``run_s``: give up after this long (the result then says no error came).

Prints ``pid RANK PID`` at the start, ``ready RANK ATTEMPT TIME`` after the first step,
``step N`` after every later one, and ``failing RANK TIME`` just before raising on purpose
(TIME: seconds since the epoch).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import smddp  # noqa: F401  (registers the backend)


def say(line: str) -> None:
    """One line to stdout in one write: the ranks share torchrun's pipe, and print() writes
    the text and its newline separately, so lines of different ranks would interleave."""
    os.write(1, (line + "\n").encode())


def _model(rank: int, spec: dict[str, Any]) -> nn.Module:
    torch.manual_seed(1000 + rank)
    if spec.get("mismatch") == "model" and rank == spec["victim"]:
        last: nn.Module = nn.Conv1d(32, 1, 1)  # weight [1, 32, 1] where the others have [1, 32]

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
                self.last = last

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.last(self.body(x).unsqueeze(-1)).squeeze(-1)

        return Net()
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )


def _ddp(model: nn.Module, rank: int, spec: dict[str, Any]) -> DDP:
    ddp = DDP(model, bucket_cap_mb=0.002)  # several buckets of a few hundred floats
    hook = spec.get("hook", "none")
    if spec.get("mismatch") == "hook" and rank == spec["victim"]:
        hook = "fp16_compress_hook"
    if hook == "allreduce_hook":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif hook == "fp16_compress_hook":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "builtin":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    return ddp


def _fails_now(rank: int, step: int, spec: dict[str, Any]) -> bool:
    if spec.get("fail") != "raise" or rank != spec["victim"] or step != spec.get("fail_step", 3):
        return False
    return (
        not spec.get("first_attempt_only")
        or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    )


def train(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Trains until the group fails (or for ``steps`` steps); returns what happened."""
    ddp = _ddp(_model(rank, spec), rank, spec)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(7 + rank)
    deadline = time.monotonic() + spec.get("run_s", 60)
    step = 0
    while time.monotonic() < deadline and (not spec.get("steps") or step < spec["steps"]):
        if _fails_now(rank, step, spec):
            say(f"failing {rank} {time.time():.3f}")
            raise RuntimeError(f"rank {rank} fails on purpose at step {step}")
        x = torch.randn(16, 8, generator=data)
        opt.zero_grad()
        F.mse_loss(ddp(x), x.sum(dim=1, keepdim=True).sin()).backward()
        opt.step()
        if step == 0:
            say(
                f"ready {rank} {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} "
                f"{time.time():.3f}"
            )
        else:
            say(f"step {step}")
        step += 1
    return {"steps": step, "params": [p.detach().sum().item() for p in ddp.parameters()]}


def funcol_loop(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Functional all_reduces, each result checked, until the group fails."""
    import torch.distributed._functional_collectives as funcol

    deadline = time.monotonic() + spec.get("run_s", 60)
    step = 0
    while time.monotonic() < deadline:
        got = funcol.all_reduce(torch.full((4096,), float(rank + step)), "sum", dist.group.WORLD)
        want = float(sum(range(dist.get_world_size())) + dist.get_world_size() * step)
        if not torch.equal(got + 0, torch.full((4096,), want)):  # + 0: torch waits for the op here
            raise AssertionError(f"step {step}: wrong result")
        say(f"ready {rank} 0 {time.time():.3f}" if step == 0 else f"step {step}")
        step += 1
    return {"steps": step}


def fsdp_loop(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """FSDP training (``program`` "fsdp1": FullyShardedDataParallel; "fsdp2": fully_shard)
    until the group fails: its all_gathers and reduce_scatters run in forward and backward."""
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )
    if spec["program"] == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model, device_id=torch.device("cpu"))
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(7 + rank)
    deadline = time.monotonic() + spec.get("run_s", 60)
    step = 0
    while time.monotonic() < deadline:
        x = torch.randn(16, 8, generator=data)
        opt.zero_grad()
        F.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin()).backward()
        opt.step()
        say(f"ready {rank} 0 {time.time():.3f}" if step == 0 else f"step {step}")
        step += 1
    return {"steps": step}


PROGRAMS = {"ddp": train, "funcol": funcol_loop, "fsdp1": fsdp_loop, "fsdp2": fsdp_loop}


def main() -> None:
    spec = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    out = Path(spec["out"])
    record: dict[str, Any] = {
        "rank": rank,
        "pid": os.getpid(),
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    }
    say(f"pid {rank} {os.getpid()}")
    torch.set_num_threads(1)
    dist.init_process_group(
        spec.get("backend", "smddp"), timeout=timedelta(seconds=spec.get("pg_timeout_s", 60))
    )
    try:
        record.update(PROGRAMS[spec.get("program", "ddp")](rank, spec))
    except dist.DistBackendError as exc:
        record.update(
            type=type(exc).__name__,
            module=type(exc).__module__,
            message=str(exc),
            failed_at=time.time(),
        )
        try:
            dist.all_reduce(torch.ones(4))
        except dist.DistBackendError as later:
            record["after"] = str(later)
        started = time.monotonic()
        dist.destroy_process_group()
        record["destroy_s"] = time.monotonic() - started
        (out / f"rank{rank}-a{record['attempt']}.json").write_text(json.dumps(record))
        raise  # a survivor exits 1 because of the error, as a user's script would
    dist.destroy_process_group()
    (out / f"rank{rank}-a{record['attempt']}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
