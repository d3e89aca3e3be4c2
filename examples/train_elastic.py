"""A lost rank does not end the job: DDP training that shrinks past a dead rank and goes on.

N ranks train a small MLP on scikit-learn's 8x8 digits with DistributedDataParallel over the
"smddp" backend. When a rank dies (or a whole node: its daemon is killed), every survivor's
step fails with an error that names the failed ranks, the same set on every survivor. The
survivors then:

1. call ``smddp.shrink_group(failed)``: a new default group of the remaining ranks, at once;
2. agree on the last step that completed (a rank whose last all_reduce of a step finished
   before the failure struck may be one step ahead: the others take its state, so no step is
   half applied);
3. rebuild DDP on the new group and re-shard the data (DistributedSampler on the new world:
   the same global batch of each step, split in fewer parts);
4. redo the step that failed and go on. No checkpoint is read: the survivors are replicas,
   and a step that failed in backward left their parameters as they were (optimizer.step()
   never ran).

Launch it with its own launcher, not torchrun: torchrun ends every worker of its job when one
fails (and starts them all again under ``--max-restarts``), which is what this example avoids.

    python examples/train_elastic.py --nproc 4 --kill-rank 2 --kill-at-step 20

starts 4 workers on this node (and an embedded smddpd when none answers); rank 2 SIGKILLs
itself at step 20, and the launcher prints the time from that kill to the survivors' first
step on the shrunk group. On several nodes, run one launcher per node with a node daemon
(smddpd) on each:

    python examples/train_elastic.py --nnodes 2 --node-rank 0 --nproc 2 \
        --master-addr HOST0 --master-port 29400      # on HOST0 (it holds the store)
    python examples/train_elastic.py --nnodes 2 --node-rank 1 --nproc 2 \
        --master-addr HOST0 --master-port 29400      # on the other node

The store (a TCPStore held by node 0's launcher) is only used to start the job. Run under
torchrun (``torchrun --nproc-per-node 4 examples/train_elastic.py ...``) it trains the same way,
and a kill restarts the whole job, from step 0: the comparison this example is measured against.

``--dump-dir`` writes the state (model, optimizer, step) at the shrink and at the end;
``--resume FILE`` starts from such a state: with ``--nproc 3`` it trains the shrunk world from
the same state, which must end bitwise equal (``tests/failures/test_elastic_example.py``).

A replacement (``--replace``): the launcher starts a new worker for each killed one, as a
supervisor would. It calls ``smddp.join`` and waits; the survivors call ``smddp.grow`` at each
step boundary (every ``--grow-every`` steps), which admits it as the last rank, then
``smddp.heal`` sends it rank 0's model and optimizer state and the step to go on from, and the
world is whole again:

    python examples/train_elastic.py --nproc 4 --kill-rank 2 --kill-at-step 20 --replace

On several nodes (each launcher with ``--replace``), a node whose daemon died comes back with
its daemon restarted and a launcher started again with ``--join``: its workers join the
survivors at their next grow (``test_a_lost_node_comes_back``).

The launcher prints the time from the replacement's start to its first step. The steps here
take milliseconds, so the survivors' first grow after a shrink waits (up to
``--join-timeout``) for as many joiners as ranks were lost; a job whose steps take longer would
just call ``grow()`` every few steps and let the replacement in whenever it is ready.
``--dump-dir`` then also writes grow.pt (the state the replacement was healed with) and each
rank's final state (final.rank{R}.pt), for the bitwise comparison (``tests/failures/test_grow.py``).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler

import smddp  # registers the "smddp" backend; shrink_group, failed_ranks

GLOBAL_BATCH = 96  # divisible by 1, 2, 3, 4, 6, 8: the same global batch on any of these worlds
FIRST_SHRUNK = re.compile(r"^rank \d+ -> \d+: first step on the shrunk group done at ([\d.]+)")
FIRST_JOINED = re.compile(r"^rank (\d+) \(replacement\): first step done at ([\d.]+)")
KILLED = re.compile(r"^rank (\d+): SIGKILL to itself at step \d+, at ([\d.]+)")


def say(line: str) -> None:
    """One line to stdout in one write: the workers share the launcher's terminal."""
    os.write(1, (line + "\n").encode())


# -- the model and the data ----------------------------------------------------------------


def make_model(seed: int) -> nn.Module:
    """64 -> 32 -> 10 MLP (2,410 parameters), the same initial weights on every rank."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def load_data() -> TensorDataset:
    """scikit-learn's bundled digits (no download), 1,797 images flattened and scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.long)
    return TensorDataset(x, y)


class Shards:
    """This rank's part of each step's global batch, for the current world.

    Step ``s`` is batch ``s % steps_per_epoch`` of epoch ``s // steps_per_epoch``. A
    DistributedSampler gives rank ``r`` of ``W`` the positions ``r, r + W, ...`` of the
    epoch's shuffled order, so its ``b``-th slice of ``GLOBAL_BATCH / W`` samples covers the
    global positions ``[b * GLOBAL_BATCH, (b + 1) * GLOBAL_BATCH)`` together with the other
    ranks' slices, whatever ``W`` is: after a shrink the survivors train on the same
    samples at each step, split in fewer, larger parts.
    """

    def __init__(self, data: TensorDataset, seed: int) -> None:
        self.data = data
        self.seed = seed
        self.steps_per_epoch = len(data) // GLOBAL_BATCH
        self.reshard()

    def reshard(self) -> None:
        """A sampler for the current default group (after init, and after each shrink)."""
        world = dist.get_world_size()
        if GLOBAL_BATCH % world:
            raise ValueError(
                f"the global batch of {GLOBAL_BATCH} does not split over {world} ranks"
            )
        self.per_rank = GLOBAL_BATCH // world
        self.sampler = DistributedSampler(
            self.data, num_replicas=world, rank=dist.get_rank(), shuffle=True, seed=self.seed
        )
        self._epoch = -1
        self._order: list[int] = []

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, b = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._order = list(self.sampler)
            self._epoch = epoch
        idx = self._order[b * self.per_rank : (b + 1) * self.per_rank]
        x, y = self.data[idx]
        return x, y


# -- one worker ----------------------------------------------------------------------------


def train_step(
    ddp: DDP, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    """One step. DDP all_reduces the gradients during backward(); when that fails,
    optimizer.step() does not run and the parameters stay as they were."""
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(ddp(x), y)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """What a rank holds that the others need to continue as it would: the replica's state."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}


def dump(path: Path, state: dict[str, Any]) -> None:
    """Writes ``state`` whole or not at all (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def failed_ranks_of(exc: dist.DistBackendError) -> list[int]:
    """The ranks the daemons agreed have failed: from the error where it carries them
    (SmddpRankFailedError), else from the default group (DDP's reducer may hand the error on
    as a plain DistBackendError). Empty when the failure is not a lost rank (a mismatch, a
    timeout, this node's daemon gone): then this rank cannot go on."""
    failed = getattr(exc, "failed_ranks", None)
    if not failed:
        failed = smddp.failed_ranks()
    return sorted(failed)


def agree_on_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int
) -> tuple[int, int]:
    """Makes every survivor hold the same state, of the most advanced survivor's step.

    A step's last all_reduce can complete on some ranks (everyone's data was in) while the
    failure reaches the others first: those are one step ahead. Their state is a whole step
    of the full world, so the others take it (one broadcast, only then). Returns the step to
    go on from and the rank whose state was taken (-1: all held the same step).
    """
    steps = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(steps, torch.tensor([step], dtype=torch.int64))
    held = [int(s) for s in steps]
    if min(held) == max(held):
        return step, -1
    src = held.index(max(held))
    box = [state_of(model, optimizer, step) if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    state = box[0]
    assert state is not None
    if dist.get_rank() != src:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    return int(state["step"]), src


def heal_from_rank_0(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> int:
    """After a grow: every rank takes rank 0's model and optimizer state (``smddp.heal``) and
    its step, which is also where the data goes on (Shards.batch(step)). Returns the step."""
    smddp.heal(model, optimizer, src=0)
    box = torch.tensor([step], dtype=torch.int64)
    dist.broadcast(box, src=0)
    return int(box[0])


def work(args: argparse.Namespace) -> int:
    """One rank: trains ``args.steps`` steps, shrinking past every rank that dies."""
    torch.set_num_threads(1)
    timeout = timedelta(seconds=args.pg_timeout)
    if args.join:
        return work_as_replacement(args, timeout)
    if args.store:
        # Started by this file's launcher, which holds the store: any rank may die, rank 0 too.
        host, port = args.store.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        dist.init_process_group(
            "smddp", store=store, rank=args.rank, world_size=args.world_size, timeout=timeout
        )
    else:
        dist.init_process_group("smddp", timeout=timeout)  # torchrun's env://
    first_rank = dist.get_rank()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    say(f"rank {first_rank} pid {os.getpid()}")

    model = make_model(args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    step = 0
    if args.resume:
        state = torch.load(args.resume, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
    shards = Shards(load_data(), args.seed)
    ddp = DDP(model)
    dump_dir = Path(args.dump_dir) if args.dump_dir else None
    shrunk_at: float | None = None
    first_step_done = False

    while step < args.steps:
        rank = dist.get_rank()
        if (
            first_rank == args.kill_rank
            and step == args.kill_at_step
            and not args.resume
            and attempt == 0
        ):
            say(f"rank {rank}: SIGKILL to itself at step {step}, at {time.time():.3f}")
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = shards.batch(step)
        try:
            loss = train_step(ddp, optimizer, x, y)
        except dist.DistBackendError as exc:
            seen_at = time.time()
            say(
                f"rank {rank}: step {step} failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
            )
            failed = failed_ranks_of(exc)
            # torch's C++ side keeps the error (the reducer's failed work), and its traceback
            # keeps train_step's frame, which holds the DDP: a cycle gc cannot see through.
            traceback.clear_frames(exc.__traceback__)
            if not failed:
                raise  # not a lost rank: nothing to shrink past
        else:
            step_done_at = time.time()
            step += 1
            if not first_step_done:
                say(f"rank {rank}: first step done at {step_done_at:.3f} (attempt {attempt})")
                first_step_done = True
            if shrunk_at is not None:
                say(
                    f"rank {first_rank} -> {rank}: first step on the shrunk group done at {step_done_at:.3f} ({step_done_at - shrunk_at:.3f} s after the failure reached it)"  # noqa: E501
                )
                shrunk_at = None
            if rank == 0 and step % args.log_every == 0:
                say(f"rank 0: step {step} loss {loss:.4f} on {dist.get_world_size()} ranks")
            if not (args.replace and step < args.steps and step % args.grow_every == 0):
                continue
            try:
                healed = grow_at_boundary(args, model, optimizer, shards, step)
            except dist.DistBackendError as exc:
                # A rank lost since the step can reach this rank first in grow's broadcast on
                # the old group: the step is done, so the survivors shrink and take the next.
                seen_at = time.time()
                say(f"rank {rank}: grow after step {step} failed: {type(exc).__name__}")
                failed = failed_ranks_of(exc)
                traceback.clear_frames(exc.__traceback__)
                if not failed:
                    raise
            else:
                if healed is not None:
                    step = healed
                    old = weakref.ref(ddp)
                    del ddp  # here: a reference held by a callee's argument would outlive it
                    ensure_gone(old, "the DDP of the group before the grow")
                    ddp = DDP(model)
                continue

        # The old DDP's reducer holds autograd hooks on the parameters and the old group: it
        # must be gone before a new DDP wraps the model, or both reducers' hooks fire.
        old = weakref.ref(ddp)
        del ddp
        ensure_gone(old, "the failed step's DDP")
        shrunk_at = seen_at
        smddp.shrink_group(failed)
        say(
            f"rank {rank} -> {dist.get_rank()}: ranks {failed} failed; {dist.get_world_size()} ranks go on from step {step} ({time.time() - seen_at:.3f} s to shrink)"  # noqa: E501
        )
        step, src = agree_on_state(model, optimizer, step)
        if src >= 0:
            say(f"rank {dist.get_rank()}: took the state of rank {src}, at step {step}")
        shards.reshard()
        ddp = DDP(model)
        if dump_dir is not None and dist.get_rank() == 0:
            dump(dump_dir / "shrink.pt", state_of(model, optimizer, step))

    finish(args, model, optimizer, step)
    return 0


def finish(
    args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer, step: int
) -> None:
    say(f"rank {dist.get_rank()}: trained {step} steps on {dist.get_world_size()} ranks")
    if args.dump_dir:
        if dist.get_rank() == 0:
            dump(Path(args.dump_dir) / "final.pt", state_of(model, optimizer, step))
        if args.replace:
            rank_file = Path(args.dump_dir) / f"final.rank{dist.get_rank()}.pt"
            dump(rank_file, state_of(model, optimizer, step))
    dist.destroy_process_group()


def ensure_gone(old: weakref.ref[DDP], what: str) -> None:
    """Checks that a dropped DDP is gone: its reducer holds autograd hooks on the parameters
    and the old group, and a new DDP beside it would see both reducers' hooks fire."""
    gc.collect()
    if old() is not None:
        raise RuntimeError(
            f"rank {dist.get_rank()}: {what} is still referenced; a new DDP beside it would see its autograd hooks fire too"  # noqa: E501
        )


def grow_at_boundary(
    args: argparse.Namespace,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    shards: Shards,
    step: int,
) -> int | None:
    """At a step boundary: admits the replacements waiting (``smddp.grow``) and heals them.
    Returns the step to go on from when the group grew (the caller then wraps the model in a
    DDP of the new group), None when nobody joined."""
    rank, world = dist.get_rank(), dist.get_world_size()
    missing = max(0, args.world_size - world)
    # The first grow after a loss waits for the replacements (see the module's docstring).
    started = time.time()
    group = smddp.grow(wait_for=missing, timeout=args.join_timeout)
    if group.size() == world:
        return None
    step = heal_from_rank_0(model, optimizer, step)
    shards.reshard()
    say(
        f"rank {rank} -> {dist.get_rank()}: ranks {list(range(world, group.size()))} joined; {group.size()} ranks go on from step {step} ({time.time() - started:.3f} s to grow and heal)"  # noqa: E501
    )
    if args.dump_dir and dist.get_rank() == 0:
        dump(Path(args.dump_dir) / "grow.pt", state_of(model, optimizer, step))
    return step


def work_as_replacement(args: argparse.Namespace, timeout: timedelta) -> int:
    """A replacement worker: joins at the survivors' next grow, is healed from rank 0, and
    trains the remaining steps (it is not killed again, and grows no further)."""
    host, port = args.store.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    # Everything that takes time before joining: once admitted, the survivors wait for it.
    model = make_model(args.seed)  # its weights are replaced by rank 0's
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    data = load_data()
    waiting_at = time.time()
    say(f"replacement pid {os.getpid()}: waiting to join at {waiting_at:.3f}")
    smddp.join(store, timeout=args.join_timeout)
    rank = dist.get_rank()
    joined_at = time.time()
    step = heal_from_rank_0(model, optimizer, 0)
    shards = Shards(data, args.seed)
    ddp = DDP(model)
    say(
        f"rank {rank} (replacement): admitted {joined_at - waiting_at:.3f} s after it queued, healed at step {step} in {time.time() - joined_at:.3f} s"  # noqa: E501
    )
    first = True
    while step < args.steps:
        x, y = shards.batch(step)
        loss = train_step(ddp, optimizer, x, y)
        step += 1
        if first:
            say(f"rank {rank} (replacement): first step done at {time.time():.3f}")
            first = False
        if rank == 0 and step % args.log_every == 0:
            say(f"rank 0: step {step} loss {loss:.4f} on {dist.get_world_size()} ranks")
        if step < args.steps and step % args.grow_every == 0:
            healed = grow_at_boundary(args, model, optimizer, shards, step)
            if healed is not None:
                step = healed
                old = weakref.ref(ddp)
                del ddp
                ensure_gone(old, "the DDP of the group before the grow")
                ddp = DDP(model)
    finish(args, model, optimizer, step)
    return 0


# -- the launcher ----------------------------------------------------------------------------


def _pump(proc: subprocess.Popen[str], lines: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        sys.stdout.write(line)
        sys.stdout.flush()


def launch(args: argparse.Namespace) -> int:
    """Starts this node's workers as independent processes: one that dies ends no other."""
    from smddp.client.embedded import find_or_start_daemon

    world = args.nnodes * args.nproc
    env = dict(os.environ, MASTER_ADDR=args.master_addr)
    if args.nnodes == 1:
        # The job's daemon, started here when none answers: it outlives any worker (the one
        # that would have started it may die first), and ends with this launcher.
        env["SMDDP_SOCKET"] = find_or_start_daemon()
    # On several nodes, each node's smddpd (docs/failures.md); where none answers, the
    # workers' rendezvous starts one that other nodes can reach.
    store = dist.TCPStore(
        args.master_addr,
        args.master_port,
        is_master=args.node_rank == 0,
        wait_for_workers=False,
        timeout=timedelta(seconds=args.pg_timeout),
    )
    address = f"{args.master_addr}:{store.port}"
    passed = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k in ("steps", "seed", "lr", "kill_rank", "kill_at_step", "log_every", "pg_timeout")
    ]
    passed += [f"--dump-dir={args.dump_dir}"] if args.dump_dir else []
    passed += [f"--resume={args.resume}"] if args.resume else []
    if args.replace:
        passed += ["--replace", f"--grow-every={args.grow_every}"]
        passed += [f"--join-timeout={args.join_timeout}"]
    outputs: list[list[str]] = []

    def start(local: int, *role: str) -> subprocess.Popen[str]:
        cmd = [sys.executable, __file__, f"--store={address}", f"--world-size={world}"]
        proc = subprocess.Popen(
            [*cmd, *role, *passed],
            env=dict(env, LOCAL_RANK=str(local)),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines: list[str] = []
        threading.Thread(target=_pump, args=(proc, lines), daemon=True).start()
        outputs.append(lines)
        return proc

    first_rank = args.node_rank * args.nproc
    # --join: a node that comes back (its daemon restarted) starts workers that join the job.
    roles = [("--join",) if args.join else (f"--rank={first_rank + i}",) for i in range(args.nproc)]
    running = {first_rank + i: start(i, *roles[i]) for i in range(args.nproc)}
    codes: dict[int, int] = {}
    # The replacements, by the rank each replaces: process, when it was started.
    replacing: dict[int, tuple[subprocess.Popen[str], float]] = {}
    replaced: dict[int, int] = {}  # their exit codes
    while running or len(replaced) < len(replacing):
        for rank, proc in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            del running[rank]
            codes[rank] = code
            if code == -signal.SIGKILL and args.replace:
                # As a supervisor would: a new worker in the dead one's place, which joins
                # the survivors at their next grow.
                started = time.time()
                replacing[rank] = (start(rank - first_rank, "--join"), started)
                say(f"launcher: rank {rank} was killed; its replacement started at {started:.3f}")
        for rank, (proc, _) in replacing.items():
            if rank not in replaced and proc.poll() is not None:
                replaced[rank] = proc.returncode
        time.sleep(0.05)
    time.sleep(0.2)  # the pumps' last lines
    text = [line for lines in outputs for line in lines]
    killed = [m for m in map(KILLED.match, text) if m]
    firsts = [float(m[1]) for m in map(FIRST_SHRUNK.match, text) if m]
    lost = sorted(r for r, c in codes.items() if c == -signal.SIGKILL)
    failed = sorted(r for r, c in codes.items() if c not in (0, -signal.SIGKILL))
    say(f"launcher: ranks {lost} were killed; ranks {failed} failed; the others finished")
    if killed and firsts:
        kill_to_first = max(firsts) - float(killed[0][2])
        say(
            f"launcher: kill -> first step on the shrunk group: {kill_to_first:.3f} s (slowest of {len(firsts)} survivors)"  # noqa: E501
        )
    joined = sorted((float(m[2]), int(m[1])) for m in map(FIRST_JOINED.match, text) if m)
    for (rank, (_, started)), (first_step, new_rank) in zip(sorted(replacing.items()), joined):
        say(
            f"launcher: the replacement of rank {rank} (now rank {new_rank}): start -> first step {first_step - started:.3f} s"  # noqa: E501
        )
    bad = sorted(r for r, c in replaced.items() if c != 0)
    if replacing:
        say(f"launcher: replacements of ranks {sorted(replacing)}; those of ranks {bad} failed")
    return 1 if failed or bad or len(lost) == world and not replacing else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=0, help="workers to start on this node (launcher)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes of the job (one launcher each)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1")
    p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (the store)")
    p.add_argument("--master-port", type=int, default=0, help="the store's port (0: any, one node)")
    p.add_argument("--steps", type=int, default=60, help="steps to train (default 60)")
    p.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate (default 0.01)")
    p.add_argument("--seed", type=int, default=1, help="initial weights and data order")
    p.add_argument("--kill-rank", type=int, default=-1, help="rank that SIGKILLs itself (demo)")
    p.add_argument("--kill-at-step", type=int, default=-1, help="the step at which it does")
    p.add_argument("--log-every", type=int, default=10, help="rank 0 prints the loss this often")
    p.add_argument("--pg-timeout", type=float, default=120.0, help="the group's timeout, seconds")
    p.add_argument("--dump-dir", default="", help="write shrink.pt and final.pt here (rank 0)")
    p.add_argument("--resume", default="", help="start from a shrink.pt / final.pt state")
    p.add_argument(
        "--replace",
        action="store_true",
        help="start a replacement for each killed worker; it joins at the survivors' next grow",
    )
    p.add_argument("--grow-every", type=int, default=1, help="with --replace: steps per grow()")
    p.add_argument(
        "--join-timeout", type=float, default=60.0, help="seconds to wait for a replacement"
    )
    p.add_argument(
        "--join",
        action="store_true",
        help="with --nproc: workers that join a running job at its next grow (a node back)",
    )
    # Set by the launcher for its workers.
    p.add_argument("--store", default="", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.nnodes > 1 and not args.master_port:
        p.error("--master-port is required with --nnodes > 1: every launcher must name the store")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return launch(args) if args.nproc else work(args)


if __name__ == "__main__":
    sys.exit(main())
