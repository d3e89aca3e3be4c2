"""smddp against gloo, Open MPI and DeepSpeed's SHM op as a user times them: blocking calls,
every backend in the same processes, rotating rounds, the worst rank's median.

    python -m benchmarks.collectives.paired [--world-sizes 2,4] [--mpirun] [--out DIR]
    mpirun -n W python -m benchmarks.collectives.paired [--out DIR]

It writes paired.json, paired.md and (with matplotlib) paired.png into ``--out``, by default a
new temporary folder (printed): ``--out docs/benchmarks`` refreshes the figures kept in the
repository. ``--json``, ``--markdown`` and ``--plot`` send one file elsewhere.

Launch: by default the ranks are processes spawned here (torch.multiprocessing), and the Open
MPI column says "not under mpirun". ``--mpirun`` starts each world size's ranks with Open MPI's
mpirun instead (as root with ``--allow-run-as-root``, with ``--oversubscribe`` where there are
more ranks than cores); ``mpirun -n W python -m benchmarks.collectives.paired`` runs one world
size directly (the ranks read OMPI_COMM_WORLD_*; ``import smddp`` fills RANK, WORLD_SIZE and
MASTER_ADDR/PORT from them). Under mpirun, Open MPI is timed through mpi4py on numpy views of
the same tensors. DeepSpeed's SHM all_reduce is timed where DeepSpeed is installed (its op is
built on first use: minutes), on float32 SUM all_reduce only (peers.py says why).
``--peers`` chooses the peers, ``--quick`` makes a smoke run of a few calls per case.

Each row also shows smddp's time over the best peer's (gloo, Open MPI or DeepSpeed, named),
and under the table the floors measured in the same job (floors.py): a word handed between two
processes through a shared page (spinning, and through a futex wake), torch's dispatch into a
Python ProcessGroup that does nothing, and single-core memcpy of the cases' sizes.

Every rank joins a gloo default group and an smddp group (``new_group(backend="smddp")``);
for each op and size it runs rounds of calls on each backend in turn (the order rotating from
round to round, so that each leads in turn), timing each blocking call. A figure is the
median over a rank's calls; the row shows the worst rank's. Rotating rounds in one run makes
the ratios robust to a noisy machine (the absolute figures are not). The case
``solo_all_reduce`` times all_reduce on groups of one rank (``new_group([rank])``), which
smddp runs in place. Also: a DDP step (an MLP of 8.4M
parameters) against the same step under ``no_sync`` for both backends and for DDP with a comm
hook that communicates nothing (DDP's own work on a synchronised step, which both backends
pay), and single-core copy and add of the same sizes.
It also counts CPU time (``time.process_time``, every thread of a rank's process) per call
and per DDP step. A call's CPU over all ranks, spread over the machine's cores, is the least
time the call can take at its present cost, whatever its synchronisation: on a machine with
fewer cores than ranks, or with every core busy (DDP's backward), the figure that bounds
smddp from below, and the one to cut.
busbw follows nccl-tests: all_reduce 2(n-1)/n x bytes / time, all_gather (n-1)/n x output
bytes / time, all_to_all and reduce_scatter (n-1)/n x input bytes / time, gather and scatter
(n-1)/n x the root's bytes / time (what crosses between ranks), broadcast bytes / time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.collectives.floors import NOP_BACKEND, dispatch, native, register_nop_backend
from benchmarks.collectives.outdir import OUT_HELP, OutFolder, matplotlib_installed
from benchmarks.collectives.peers import (
    DEEPSPEED,
    MPI,
    NOT_ASKED,
    NOT_INSTALLED,
    NOT_UNDER_MPIRUN,
    PEER_FLAGS,
    PEERS,
    Peers,
    mpi_world,
    run_token,
    start_deepspeed,
    start_mpi,
)
from benchmarks.collectives.plot import require_matplotlib
from smddp.core.region import usable_cores

# (op, bytes): bytes are the tensor's, as in the table (all_gather and gather: the
# output's; all_to_all, reduce_scatter: each rank's input; scatter: the root's inputs).
CASES = (
    ("all_reduce", 4),
    ("all_reduce", 64 << 10),
    ("all_reduce", 1 << 20),
    ("all_reduce", 16 << 20),
    ("all_reduce", 64 << 20),
    ("barrier", 0),
    ("solo_all_reduce", 4),  # on groups of one rank: new_group([rank]) of each backend
    ("broadcast", 16 << 20),
    ("all_gather", 16 << 20),
    ("all_to_all", 1 << 20),
    ("all_to_all", 16 << 20),
    ("reduce_scatter", 16 << 20),
    ("gather", 16 << 20),
    ("scatter", 16 << 20),
)
# Sizes of the single-core copy and add reference.
REFERENCE_SIZES = (1 << 20, 16 << 20, 64 << 20)
# Each rank's share of a case's bytes.
_SHARED = ("all_gather", "gather", "scatter")


# --quick: rounds and calls per round of every case.
_QUICK = (4, 10)


def _rounds(nbytes: int) -> tuple[int, int]:
    """(rounds, calls per round) for a size: fewer calls for larger messages."""
    if nbytes <= 64 << 10:
        return 10, 100
    if nbytes <= 1 << 20:
        return 8, 30
    if nbytes <= 16 << 20:
        return 6, 6
    return 4, 3


@dataclass(frozen=True)
class Options:
    """What one run measures.

    Attributes:
        cases: the (op, bytes) cases.
        ddp_steps: timed DDP steps per backend at w=2 (0: none).
        peers: the peers asked for, of ``PEER_FLAGS``' names ("mpi", "deepspeed").
        quick: a few calls per case (a smoke run: the figures are rough).
    """

    cases: tuple = CASES
    ddp_steps: int = 10
    peers: tuple[str, ...] = ("mpi", "deepspeed")
    quick: bool = False


def _time_case(
    op: str,
    nbytes: int,
    groups: dict[str, Any],
    world: int,
    rank: int,
    peers: Peers | None = None,
    solo: bool = False,
    quick: bool = False,
) -> tuple[dict[str, float], dict[str, float]]:
    """This rank's median time per call of each backend, and its mean CPU time per call
    (every thread of the process: smddp's progress thread, gloo's own threads).

    The torch groups, Open MPI (``peers.comm``) and DeepSpeed's op (``peers.ds_op``, float32
    SUM all_reduce only) run on the same buffers, round after round, the order rotating."""
    import torch
    import torch.distributed as dist

    n = max(1, nbytes // 4)
    if op in _SHARED:
        n = max(1, n // world)
    t = torch.ones(n, dtype=torch.float32)
    out = torch.empty(n if op == "all_to_all" else n * world, dtype=torch.float32)
    part = torch.empty(n // world if op == "reduce_scatter" else n, dtype=torch.float32)
    blocks = list(out.chunk(world)) if rank == 0 else None  # the root's, gather and scatter

    def torch_call(group: Any) -> Callable[[], None]:
        def call() -> None:
            if op in ("all_reduce", "solo_all_reduce"):
                dist.all_reduce(t, group=group)
            elif op == "barrier":
                dist.barrier(group=group)
            elif op == "broadcast":
                dist.broadcast(t, src=0, group=group)
            elif op == "all_to_all":
                dist.all_to_all_single(out, t, group=group)
            elif op == "reduce_scatter":
                dist.reduce_scatter_tensor(part, t, group=group)
            elif op == "gather":
                dist.gather(t, blocks, dst=0, group=group)
            elif op == "scatter":
                dist.scatter(part, blocks, src=0, group=group)
            else:
                dist.all_gather_into_tensor(out, t, group=group)

        return call

    calls = {name: torch_call(g) for name, g in groups.items()}
    if peers is not None and peers.comm is not None:
        calls[MPI] = _mpi_call(op, peers.comm, t, out, part, rank, solo)
    if peers is not None and peers.ds_op is not None and op == "all_reduce" and not solo:
        ds_op = peers.ds_op
        calls[DEEPSPEED] = lambda: ds_op(t)

    rounds, per = _QUICK if quick else _rounds(nbytes)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    cpu = dict.fromkeys(calls, 0.0)
    names = list(calls)
    reduces = op in ("all_reduce", "solo_all_reduce")
    for name in names:  # warm up each; check the sums (a peer used wrongly shows here)
        for _ in range(3):
            if reduces:
                t.fill_(1.0)
            calls[name]()
        if reduces and not bool(torch.all(t == float(1 if solo else world))):
            raise AssertionError(
                f"{name} all_reduce of {nbytes} bytes on rank {rank} of {world}: ones summed "
                f"to {t[:4].tolist()}, not {1 if solo else world}"
            )
    for r in range(rounds):
        k = r % len(names)
        order = names[k:] + names[:k]  # rotating: each backend leads in turn
        for name in order:
            dist.barrier(group=groups["gloo"])
            call = calls[name]
            for _ in range(per):
                if reduces:
                    t.fill_(1.0)
                busy = time.process_time()
                start = time.perf_counter()
                call()
                samples[name].append(time.perf_counter() - start)
                cpu[name] += time.process_time() - busy
    count = rounds * per
    return (
        {name: statistics.median(v) for name, v in samples.items()},
        {name: c / count for name, c in cpu.items()},
    )


def _mpi_call(
    op: str, comm: Any, t: Any, out: Any, part: Any, rank: int, solo: bool
) -> Callable[[], None]:
    """The MPI call of ``op`` on numpy views of the torch buffers (the same memory)."""
    from mpi4py import MPI as mpi

    a, o, p = t.numpy(), out.numpy(), part.numpy()
    if solo:
        self_comm = mpi.COMM_SELF
        return lambda: self_comm.Allreduce(mpi.IN_PLACE, a, op=mpi.SUM)
    root = o if rank == 0 else None
    table: dict[str, Callable[[], None]] = {
        "all_reduce": lambda: comm.Allreduce(mpi.IN_PLACE, a, op=mpi.SUM),
        "barrier": comm.Barrier,
        "broadcast": lambda: comm.Bcast(a, root=0),
        "all_to_all": lambda: comm.Alltoall(a, o),
        "reduce_scatter": lambda: comm.Reduce_scatter_block(a, p, op=mpi.SUM),
        "gather": lambda: comm.Gather(a, root, root=0),
        "scatter": lambda: comm.Scatter(root, p, root=0),
        "all_gather": lambda: comm.Allgather(a, o),
    }
    return table[op]


NO_COMMUNICATION = "no communication"


def _handed_back(state: object, bucket: Any) -> Any:
    """A DDP comm hook that communicates nothing: the bucket's gradients, at once."""
    import torch

    fut: Any = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _ddp_step(groups: dict[str, Any], rank: int, steps: int) -> dict[str, dict[str, float]]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    dims = [1024, 2048, 2048, 1024, 64]  # 8.4M parameters, 33.6 MB of float32 gradients

    def model() -> torch.nn.Module:
        layers: list[torch.nn.Module] = []
        for a, b in zip(dims, dims[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers[:-1])

    x = torch.randn(32, dims[0])
    y = torch.randn(32, dims[-1])
    result: dict[str, dict[str, float]] = {}
    ddps = {name: DDP(model(), process_group=g) for name, g in groups.items()}
    # DDP's own work on a synchronised step (copying the gradients into its buckets and back,
    # its hooks) with no communication: a comm hook that hands each bucket back at once.
    ddps[NO_COMMUNICATION] = DDP(model(), process_group=groups["gloo"])
    # DDP checks the hook's annotations as objects; this module's are strings (PEP 563).
    _handed_back.__annotations__.update(
        {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    )
    ddps[NO_COMMUNICATION].register_comm_hook(None, _handed_back)
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in ddps.items()}

    def step(name: str, sync: bool) -> tuple[float, float]:
        """The step's time and this process's CPU time in it (every thread)."""
        m, opt = ddps[name], opts[name]
        busy = time.process_time()
        start = time.perf_counter()
        opt.zero_grad()
        if sync:
            torch.nn.functional.mse_loss(m(x), y).backward()
        else:
            with m.no_sync():
                torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        took = time.perf_counter() - start
        return took, time.process_time() - busy

    names = list(ddps)
    keys = [(n, s) for n in names for s in (True, False)]
    times: dict[tuple[str, bool], list[float]] = {k: [] for k in keys}
    cpu: dict[tuple[str, bool], list[float]] = {k: [] for k in keys}
    for name in names:
        for _ in range(2):
            step(name, True)
    for i in range(steps):
        for name in names if i % 2 == 0 else names[::-1]:
            for sync in (True, False):
                dist.barrier(group=groups["gloo"])
                took, busy = step(name, sync)
                times[(name, sync)].append(took)
                cpu[(name, sync)].append(busy)
    for name in names:
        s, ns = statistics.median(times[(name, True)]), statistics.median(times[(name, False)])
        cs, cns = statistics.median(cpu[(name, True)]), statistics.median(cpu[(name, False)])
        result[name] = {
            "step_s": s,
            "no_sync_s": ns,
            "overhead_s": s - ns,
            "step_cpu_s": cs,
            "no_sync_cpu_s": cns,
        }
    return result


def _rank_main(
    rank: int, world: int, init: str | None, queue_path: str | None, opts: Options
) -> list[Any] | None:
    """One rank: joins gloo (``file://init``, or ``env://`` under mpirun) and an smddp group,
    starts the peers, times every case, and on rank 0 measures the floors while the others
    wait. Rank 0 returns every rank's figures (and writes them to ``queue_path`` if given)."""
    import torch
    import torch.distributed as dist

    import smddp  # noqa: F401  (registers the backend; under mpirun fills RANK, MASTER_ADDR...)

    torch.set_num_threads(1)
    cases = opts.cases
    peers = Peers()
    if "mpi" in opts.peers:
        start_mpi(peers)  # MPI_Init before the torch groups, as an MPI program would
    else:
        peers.status[MPI] = NOT_ASKED
    method = f"file://{init}" if init is not None else "env://"
    dist.init_process_group("gloo", init_method=method, rank=rank, world_size=world)
    groups = {"smddp": dist.new_group(backend="smddp"), "gloo": dist.group.WORLD}
    gloo = groups["gloo"]
    token = [run_token() if rank == 0 else None]
    dist.broadcast_object_list(token, src=0, group=gloo)
    if "deepspeed" in opts.peers:
        start_deepspeed(peers, rank, world, str(token[0]), lambda: dist.barrier(group=gloo))
    else:
        peers.status[DEEPSPEED] = NOT_ASKED
    register_nop_backend()
    nop = dist.new_group([0], backend=NOP_BACKEND)  # every rank makes it; rank 0 is in it
    solo: dict[str, Any] = {}
    if any(op == "solo_all_reduce" for op, _ in cases):
        for b in ("smddp", "gloo"):
            # Every rank takes part in making every group, members or not.
            solo[b] = [dist.new_group([r], backend=b) for r in range(world)][rank]
    mine: dict[str, Any] = {"cases": {}, "cpu": {}, "peers": peers.status}
    try:
        for op, nbytes in cases:
            on = solo if op == "solo_all_reduce" else groups
            key = f"{op}:{nbytes}"
            mine["cases"][key], mine["cpu"][key] = _time_case(
                op, nbytes, on, world, rank, peers, op == "solo_all_reduce", opts.quick
            )
        if world == 2 and opts.ddp_steps:
            mine["ddp"] = _ddp_step(groups, rank, opts.ddp_steps)
        # The floors, on rank 0 alone: the others wait in gloo's barrier (asleep in a read).
        if rank == 0:
            sizes = sorted({n for _, n in cases if n} | {4})
            mine["floors"] = native(sizes)
            mine["floors"]["dispatch_s"] = dispatch(nop)
            if init is None:  # under mpirun this process is also the one that writes the table
                mine["reference"] = {n: _reference(n) for n in REFERENCE_SIZES}
        dist.barrier(group=gloo)
    finally:
        peers.close()
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=gloo)
    dist.destroy_process_group()
    if rank != 0:
        return None
    if queue_path is not None:
        with open(queue_path, "w") as f:
            json.dump(everyone, f)
    return everyone


def _reference(nbytes: int) -> dict[str, float]:
    """Single-core copy and add of ``nbytes`` (median of several), the machine's reference."""
    import numpy as np

    a = np.ones(nbytes // 4, np.float32)
    b = np.ones_like(a)
    c = np.empty_like(a)
    out = {}
    for name, fn in (("copy", lambda: np.copyto(c, a)), ("add", lambda: np.add(a, b, out=c))):
        fn()
        ts = []
        for _ in range(15):
            s = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - s)
        out[name] = statistics.median(ts)
    return out


def run(world: int, opts: Options) -> dict[str, Any]:
    """Runs one world size in processes spawned here; returns the worst rank's medians per
    case and backend."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        init, path = os.path.join(d, "init"), os.path.join(d, "out.json")
        mp.spawn(_rank_main, args=(world, init, path, opts), nprocs=world, join=True)
        with open(path) as f:
            ranks = json.load(f)
    return _combine(world, ranks)


def _combine(world: int, ranks: list[Any]) -> dict[str, Any]:
    """One world size's figures from every rank's: the worst rank's medians, CPU summed."""
    cases = {}
    for key in ranks[0]["cases"]:
        cases[key] = {b: max(r["cases"][key][b] for r in ranks) for b in ranks[0]["cases"][key]}
    # CPU time per call, all ranks together: what the machine's cores must supply per call.
    cpu = {
        key: {b: sum(r["cpu"][key][b] for r in ranks) for b in ranks[0]["cpu"][key]}
        for key in ranks[0]["cpu"]
    }
    out: dict[str, Any] = {"world": world, "cores": usable_cores(), "cases": cases, "cpu": cpu}
    # Why a peer has no figures: the same on every rank, except where one rank's build failed.
    out["peers"] = {
        p: next((r["peers"].get(p) for r in ranks if r["peers"].get(p)), None) for p in PEERS
    }
    out["floors"] = ranks[0]["floors"]
    if "ddp" in ranks[0]:
        out["ddp"] = {
            b: {k: max(r["ddp"][b][k] for r in ranks) for k in ranks[0]["ddp"][b]}
            for b in ranks[0]["ddp"]
        }
    return out


def run_under_mpirun(world: int, opts: Options) -> dict[str, Any] | None:
    """Runs this process as one rank of the world mpirun started; rank 0 returns the results
    (with the single-core reference under ``"reference"``), the others None."""
    launched = mpi_world()
    assert launched is not None
    rank, size, local = launched
    if local != size:
        raise SystemExit(
            f"paired: mpirun started {size} ranks over several nodes ({local} on this one); "
            "the benchmark runs on one node"
        )
    ranks = _rank_main(rank, size, None, None, opts)
    if ranks is None:
        return None
    out = _combine(world, ranks)
    out["reference"] = ranks[0]["reference"]
    return out


def mpirun_command(world: int, args: list[str]) -> list[str]:
    """The mpirun command that runs ``world`` ranks of this benchmark with ``args``: as root
    (``--allow-run-as-root``), with more ranks than cores (``--oversubscribe``), unbound
    (``--bind-to none``: the scheduler places ranks, as it does the spawned ones)."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("paired: --mpirun needs Open MPI's mpirun (Debian: openmpi-bin)")
    cmd = [mpirun, "-n", str(world), "--bind-to", "none"]
    if os.getuid() == 0:
        cmd.append("--allow-run-as-root")
    if world > usable_cores():
        cmd.append("--oversubscribe")
    return [*cmd, sys.executable, "-m", "benchmarks.collectives.paired", *args]


def run_mpirun(world: int, opts: Options) -> dict[str, Any]:
    """Runs one world size under mpirun (this benchmark in each rank, run_under_mpirun) and
    returns rank 0's results."""
    with tempfile.TemporaryDirectory(prefix="smddp-bench-paired-mpirun-") as d:
        path = os.path.join(d, "paired.json")
        spec = ",".join(f"{op}:{n}" for op, n in opts.cases)
        cmd = mpirun_command(
            world,
            [
                *("--ddp-steps", str(opts.ddp_steps), "--cases", spec),
                *("--peers", ",".join(opts.peers) or "none"),
                *(["--quick"] if opts.quick else []),
                *("--json", path, "--markdown", os.path.join(d, "paired.md"), "--no-plot"),
            ],
        )
        # mpirun's own failure or a rank's shows on this terminal (its output is not captured).
        proc = subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise SystemExit(f"paired: mpirun with {world} ranks exited with {proc.returncode}")
        with open(path) as f:
            saved = json.load(f)
    result: dict[str, Any] = saved["results"][0]
    result["reference"] = saved["reference"]
    return result


def _fmt_t(s: float) -> str:
    if s < 10e-6:
        return f"{s * 1e6:.2f} µs"
    if s < 100e-6:
        return f"{s * 1e6:.1f} µs"
    return f"{s * 1e6:.0f} µs" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def _busbw(op: str, nbytes: int, world: int, s: float) -> float:
    factor = {
        "all_reduce": 2 * (world - 1) / world,
        "all_gather": (world - 1) / world,
        "all_to_all": (world - 1) / world,
        "reduce_scatter": (world - 1) / world,
        "gather": (world - 1) / world,
        "scatter": (world - 1) / world,
    }.get(op, 1.0)
    return factor * nbytes / s / 1e9


def markdown(
    results: list[dict[str, Any]], ref: dict[int, dict[str, float]], cases: tuple = CASES
) -> str:
    """The README's table: per case and world size, smddp, gloo, Open MPI and DeepSpeed's
    SHM op, gloo/smddp and smddp's time over the best peer's; then CPU, the single-core
    reference, the floors and the DDP step."""
    worlds = [r["world"] for r in results]
    cols = ("smddp", "gloo", *PEERS)
    head = (
        "| op | "
        + " | ".join(
            " | ".join(f"w={w} {b}" for b in cols) + " | gloo/smddp | smddp/best peer"
            for w in worlds
        )
        + " |"
    )
    lines = [head, "| --- |" + " --- |" * ((len(cols) + 2) * len(worlds))]
    for op, nbytes in cases:
        key = f"{op}:{nbytes}"
        label = _label(op, nbytes)
        cells = []
        for r in results:
            c = r["cases"][key]
            sm, gl = c["smddp"], c["gloo"]
            bw = f" ({_busbw(op, nbytes, r['world'], sm):.2f} GB/s)" if nbytes >= 1 << 20 else ""
            # A peer's cell without a figure: why it did not run, or "–" (not this op).
            peers = [r.get("peers", {}).get(p) or "–" for p in PEERS]
            timed = {b: c[b] for b in ("gloo", *PEERS) if b in c}
            best = min(timed, key=lambda b: timed[b])
            cells.append(
                f"{_fmt_t(sm)}{bw} | {_fmt_t(gl)} | "
                + " | ".join(_fmt_t(c[p]) if p in c else cell for p, cell in zip(PEERS, peers))
                + f" | {gl / sm:.2f} | {_ratio(sm, timed[best])} ({best})"
            )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        "gloo/smddp: gloo's time over smddp's (above 1: smddp faster). smddp/best peer: "
        "smddp's time over the fastest other backend's in the row, named (below 1: smddp "
        f"faster than every peer). {DEEPSPEED} is timed on float32 SUM all_reduce only (it "
        "returns wrong results for other dtypes and ops): a speed anchor."
    )
    for r in results:
        for p in PEERS:
            why = r.get("peers", {}).get(p)
            if why:
                lines.append(f"{p} at w={r['world']}: {why}{_PEER_HINT.get(why, '')}.")
    lines += _cpu_table(results, cases)
    lines.append("")
    lines.append(
        "Single-core reference: "
        + ", ".join(
            f"{_size(n)} copy {_fmt_t(v['copy'])} ({n / v['copy'] / 1e9:.1f} GB/s), add "
            f"{_fmt_t(v['add'])}"
            for n, v in ref.items()
        )
    )
    lines += _floors(results)
    for r in results:
        if "ddp" in r:
            d = r["ddp"]
            lines.append("")
            lines.append(f"DDP step, w={r['world']}, 8.4M-parameter MLP (33.6 MB of gradients):")
            lines.append("")
            lines.append("| backend | step | no_sync step | communication overhead |")
            lines.append("| --- | --- | --- | --- |")
            for b in ("smddp", "gloo", NO_COMMUNICATION):
                if b in d:
                    lines.append(
                        f"| {b} | {_fmt_t(d[b]['step_s'])} | {_fmt_t(d[b]['no_sync_s'])} | "
                        f"{_fmt_t(d[b]['overhead_s'])} |"
                    )
            lines.append("")
            lines.append(
                f"smddp's overhead is {_ratio(d['smddp']['overhead_s'], d['gloo']['overhead_s'])}"
                " of gloo's."
            )
            if "step_cpu_s" in d["smddp"]:
                lines.append(_ddp_cpu_line(d))
            if NO_COMMUNICATION in d:
                own = max(0.0, d[NO_COMMUNICATION]["overhead_s"])
                sm, gl = d["smddp"]["overhead_s"] - own, d["gloo"]["overhead_s"] - own
                lines.append(
                    f"DDP's own work on a synchronised step (its bucket copies and hooks, the "
                    f'row "{NO_COMMUNICATION}": a comm hook that hands each bucket back) is '
                    f"{_fmt_t(own)} of both; beyond it smddp's communication takes "
                    f"{_fmt_t(sm)} and gloo's {_fmt_t(gl)}: {_ratio(sm, gl)} of gloo's."
                )
    return "\n".join(lines) + "\n"


_PEER_HINT = {
    NOT_UNDER_MPIRUN: " (python -m benchmarks.collectives.paired --mpirun, or mpirun -n W "
    "python -m benchmarks.collectives.paired, times it)",
    NOT_INSTALLED: "",
    NOT_ASKED: " (--peers)",
}


def _floors(results: list[dict[str, Any]]) -> list[str]:
    """The floors measured in each world size's job (floors.py), one line each."""
    lines = []
    for r in results:
        f = r.get("floors")
        if not f:
            continue
        parts = []
        if "error" in f:
            parts.append(f"handoff and memcpy not measured: {f['error']}")
        else:
            parts.append(
                "a word handed between two processes through a shared page, one way, "
                f"{_fmt_t(f['handoff_spin_s'])} spinning and {_fmt_t(f['handoff_futex_s'])} "
                "through a futex wake"
            )
        parts.append(
            "torch's dispatch of a 4-byte dist.all_reduce into a Python ProcessGroup that does "
            f"nothing {_fmt_t(f['dispatch_s'])}"
        )
        if "memcpy_s" in f:
            parts.append(
                "single-core memcpy "
                + ", ".join(f"{_size(int(n))} {_fmt_t(v)}" for n, v in f["memcpy_s"].items())
            )
        lines += ["", f"Floors at w={r['world']}, measured in the same job: " + "; ".join(parts)]
    return lines


def _cpu_table(results: list[dict[str, Any]], cases: tuple) -> list[str]:
    """The CPU time per call of all ranks together, and the least time that much CPU takes
    on the machine's cores: smddp's floor as long as its ops cost that much CPU, whatever
    their synchronisation (empty for a JSON written before the benchmark measured CPU)."""
    if not all("cpu" in r for r in results):
        return []
    cores = {r["world"]: r["cores"] for r in results}
    lines = [
        "",
        "CPU time per call, all ranks together, and the least time it takes on the "
        "machine's cores (CPU / min(ranks, cores)), with gloo's time over that least time "
        "(the ratio smddp would reach losing no time but its CPU work); cores: "
        + ", ".join(f"{c} at w={w}" for w, c in cores.items())
        + ":",
        "",
        "| op | "
        + " | ".join(f"w={w} smddp CPU | least time | gloo / least | w={w} gloo CPU" for w in cores)
        + " |",
        "| --- |" + " --- | --- | --- | --- |" * len(cores),
    ]
    for op, nbytes in cases:
        key = f"{op}:{nbytes}"
        cells = []
        for r in results:
            cpu, w = r["cpu"][key], r["world"]
            least = cpu["smddp"] / max(1, min(w, r["cores"]))
            gloo = r["cases"][key]["gloo"]
            cells.append(
                f"{_fmt_t(cpu['smddp'])} | {_fmt_t(least)} | {_ratio(gloo, least)} | "
                f"{_fmt_t(cpu['gloo'])}"
            )
        lines.append(f"| {_label(op, nbytes)} | " + " | ".join(cells) + " |")
    return lines


def _ddp_cpu_line(d: dict[str, dict[str, float]]) -> str:
    """What a synchronised step costs each rank in CPU beyond its no_sync step, per backend:
    with a core per rank and every core busy, nothing runs beside backward for free, so a
    backend's communication overhead cannot fall below its extra CPU."""
    extra = {b: d[b]["step_cpu_s"] - d[b]["no_sync_cpu_s"] for b in d}
    gloo = d["gloo"]["overhead_s"]
    return (
        "CPU per rank that a synchronised step adds to its no_sync step: "
        + ", ".join(f"{b} {_fmt_t(v)}" for b, v in extra.items())
        + f"; smddp's overhead cannot fall below its {_fmt_t(extra['smddp'])} while each rank "
        f"has one core ({_ratio(extra['smddp'], gloo)} of gloo's overhead)."
    )


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "n/a"


def _label(op: str, nbytes: int) -> str:
    if op == "barrier":
        return "barrier"
    if op == "solo_all_reduce":
        return f"all_reduce {_size(nbytes)}, group of one rank"
    suffix = {"all_gather": " out", "gather": " out", "reduce_scatter": " in", "scatter": " in"}
    return f"{op} {_size(nbytes)}" + suffix.get(op, "")


def plot(path: str, results: list[dict[str, Any]], cases: tuple = CASES) -> None:
    """A PNG of the table's ratios: gloo time / smddp time per case, a bar per world size (log
    scale, parity marked), and DDP's communication overhead as gloo's / smddp's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [_label(op, n) for op, n in cases]
    rows: list[tuple[str, dict[int, float]]] = [
        (
            label,
            {
                r["world"]: r["cases"][f"{op}:{n}"]["gloo"] / r["cases"][f"{op}:{n}"]["smddp"]
                for r in results
            },
        )
        for label, (op, n) in zip(labels, cases)
    ]
    ddp = {
        r["world"]: r["ddp"]["gloo"]["overhead_s"] / r["ddp"]["smddp"]["overhead_s"]
        for r in results
        if "ddp" in r and r["ddp"]["smddp"]["overhead_s"] > 0
    }
    if ddp:
        rows.append(("DDP step: communication overhead", ddp))
    worlds = [r["world"] for r in results]
    height = 0.8 / max(1, len(worlds))
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2))
    for k, w in enumerate(worlds):
        ys = [i + k * height for i in range(len(rows))]
        ax.barh(ys, [vals.get(w, 0.0) for _, vals in rows], height, label=f"w={w}")
    ax.set_yticks([i + height * (len(worlds) - 1) / 2 for i in range(len(rows))])
    ax.set_yticklabels([label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("gloo time / smddp time (right of the line: smddp faster)")
    ax.legend(loc="lower right")
    ax.set_title("smddp against gloo: blocking dist.* calls, worst rank's median")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def main(argv: list[str] | None = None) -> int:
    """Runs the paired benchmark and prints the table."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.collectives.paired", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--world-sizes",
        help="world sizes to run (default 2,4; under mpirun the one mpirun started)",
    )
    p.add_argument(
        "--mpirun",
        action="store_true",
        help="start each world size's ranks with Open MPI's mpirun, so that the Open MPI "
        "column is measured (needs mpirun and mpi4py)",
    )
    p.add_argument(
        "--ddp-steps", type=int, default=10, help="timed DDP steps per backend (w=2; 0: skip)"
    )
    p.add_argument(
        "--cases", help="only these cases, e.g. all_reduce:4,broadcast:16777216 (default: all)"
    )
    p.add_argument("--out", help=OUT_HELP)
    p.add_argument("--json", help="write the results here (default: paired.json in --out)")
    p.add_argument("--markdown", help="write the table here (default: paired.md in --out)")
    p.add_argument(
        "--plot",
        help="draw the ratios into this PNG (needs matplotlib; default: paired.png in --out "
        "where matplotlib is installed)",
    )
    p.add_argument("--no-plot", action="store_true", help="draw no PNG")
    p.add_argument(
        "--peers",
        default=",".join(PEER_FLAGS),
        help="the peers to time beside smddp and gloo: mpi (Open MPI, under mpirun), "
        "deepspeed (its SHM all_reduce; built on first use, minutes), or none "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"{_QUICK[0]} rounds of {_QUICK[1]} calls per case: a smoke run, rough figures",
    )
    p.add_argument(
        "--from-json",
        help="draw the plot and write the table from this earlier --json, not a run",
    )
    args = p.parse_args(argv)
    if args.plot:
        require_matplotlib()
    cases = CASES
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = tuple(c for c in CASES if f"{c[0]}:{c[1]}" in wanted)
        if not cases:
            p.error(
                f"--cases: none of {args.cases} is a case "
                f"({', '.join(f'{o}:{n}' for o, n in CASES)})"
            )
    peers = tuple(x for x in args.peers.split(",") if x and x != "none")
    unknown = sorted(set(peers) - set(PEER_FLAGS))
    if unknown:
        p.error(f"--peers: {', '.join(unknown)} is not one of {', '.join(PEER_FLAGS)} (or none)")
    opts = Options(cases, args.ddp_steps, peers, args.quick)
    launched = mpi_world()
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        results = saved["results"]
        ref = {int(k): v for k, v in saved["reference"].items()}
        cases = tuple(c for c in cases if all(f"{c[0]}:{c[1]}" in r["cases"] for r in results))
    elif launched is not None:
        # One rank of the world mpirun started: every rank runs, rank 0 writes.
        if args.world_sizes and args.world_sizes.split(",") != [str(launched[1])]:
            p.error(
                f"--world-sizes {args.world_sizes}: under mpirun the world is the {launched[1]} "
                "ranks it started (mpirun -n W), or run without mpirun and with --mpirun"
            )
        mine = run_under_mpirun(launched[1], opts)
        if mine is None:
            return 0
        ref = {int(k): v for k, v in mine.pop("reference").items()}
        results = [mine]
    else:
        worlds = [int(w) for w in (args.world_sizes or "2,4").split(",")]
        if args.mpirun:
            results = [run_mpirun(w, opts) for w in worlds]
            ref = {int(k): v for k, v in results[-1]["reference"].items()}
            for r in results:
                del r["reference"]
        else:
            results = [run(w, opts) for w in worlds]
            ref = {n: _reference(n) for n in REFERENCE_SIZES}
    table = markdown(results, ref, cases)
    print(table)
    out = OutFolder(args.out, "smddp-bench-paired-")
    if not args.from_json:
        with open(out.path("paired.json", args.json), "w") as f:
            json.dump(
                {"results": results, "reference": {str(k): v for k, v in ref.items()}}, f, indent=1
            )
    with open(out.path("paired.md", args.markdown), "w") as f:
        f.write(table)
    if args.no_plot:
        pass
    elif args.plot or matplotlib_installed():
        plot(out.path("paired.png", args.plot), results, cases)
    else:
        print("no paired.png: matplotlib is not installed", file=sys.stderr)
    out.announce()
    return 0


if __name__ == "__main__":
    sys.exit(main())
