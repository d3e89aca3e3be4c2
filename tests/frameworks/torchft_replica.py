"""One torchft replica group (one process) training a small model, for test_torchft.py.

    python torchft_replica.py BACKEND LIGHTHOUSE REPLICA

BACKEND is ``smddp`` (smddp.torchft.ProcessGroupSmddp) or ``gloo`` (torchft's
ProcessGroupGloo); LIGHTHOUSE the lighthouse's address; REPLICA this replica group's number.
Trains as torchft's train_ddp.py does (Manager, torchft's DistributedDataParallel and
Optimizer wrapper, healing through PGTransport on the same process group) and prints, for the
test to read:

- ``pid N`` first;
- ``manager TIME`` once torch and torchft are imported, as it makes its Manager;
- ``commit STEP PARTICIPANTS TIME DIGEST`` after every committed step: the step reached, the
  replicas that took part, ``time.time()`` and a digest of the parameters' bytes;
- ``done`` when it stops.

It stops after committing step S once a line ``stop S`` arrives on stdin.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from datetime import timedelta

import torch
from torch import nn
from torch.distributed import TCPStore
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.checkpointing.pg_transport import PGTransport

# Every op's timeout, and the Manager's: long enough for a loaded 2-core machine.
TIMEOUT = timedelta(seconds=20)
# Between steps: a step then takes long enough that a kill lands in the middle of training.
STEP_PAUSE_S = 0.02

stop_at: list[int] = []


def read_stop() -> None:
    for line in sys.stdin:
        word, _, value = line.strip().partition(" ")
        if word == "stop":
            stop_at.append(int(value))


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    backend, lighthouse, replica = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print(f"pid {os.getpid()}", flush=True)
    threading.Thread(target=read_stop, daemon=True).start()

    if backend == "smddp":
        from smddp.torchft import ProcessGroupSmddp

        pg: ProcessGroupGloo | ProcessGroupSmddp = ProcessGroupSmddp(timeout=TIMEOUT)
    else:
        pg = ProcessGroupGloo(timeout=TIMEOUT)

    # Every replica starts from different weights: step 0's healing (init_sync) makes them one.
    torch.manual_seed(1000 + replica)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    # The replica group's own store (torchft's Manager reaches it as a client), one process.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def load_state_dict(state: dict[str, object]) -> None:
        model.load_state_dict(state["model"])  # type: ignore[arg-type]
        optimizer.load_state_dict(state["optim"])  # type: ignore[arg-type]

    def state_dict() -> dict[str, object]:
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    print(f"manager {time.time():.6f}", flush=True)
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"replica_{replica}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        timeout=TIMEOUT,
        quorum_timeout=timedelta(seconds=60),
        checkpoint_transport=PGTransport(pg, timeout=TIMEOUT, device=torch.device("cpu")),
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, torch.optim.Adam(model.parameters(), lr=1e-3))
    loss_fn = nn.MSELoss()

    while not stop_at or manager.current_step() < stop_at[0]:
        # This replica's batch for the step it is about to train (its data differ from the
        # other's, so that a replica left out of the average would show in the digests).
        g = torch.Generator().manual_seed(replica * 100_003 + manager.current_step())
        x = torch.randn(16, 32, generator=g)
        y = torch.randn(16, 8, generator=g)
        before = manager.current_step()
        optimizer.zero_grad()
        loss = loss_fn(ddp(x), y)
        loss.backward()
        optimizer.step()
        if manager.current_step() > before:
            print(
                f"commit {manager.current_step()} {manager.num_participants()} "
                f"{time.time():.6f} {digest(model)}",
                flush=True,
            )
        time.sleep(STEP_PAUSE_S)
    manager.shutdown(wait=False)
    pg.shutdown()
    print("done", flush=True)


if __name__ == "__main__":
    main()
