"""smddp against gloo as a user times them: blocking ``dist.*`` calls, both groups in the same
processes, alternating rounds, the worst rank's median.

    python -m benchmarks.collectives.paired [--world-sizes 2,4] [--out DIR]

It writes paired.json, paired.md and (with matplotlib) paired.png into ``--out``, by default a
new temporary folder (printed): ``--out docs/benchmarks`` refreshes the figures kept in the
repository. ``--json``, ``--markdown`` and ``--plot`` send one file elsewhere.

Every rank joins a gloo default group and an smddp group (``new_group(backend="smddp")``);
for each op and size it runs rounds of ``--per-round`` calls on one backend then the other,
timing each blocking call. A figure is the median over a rank's calls; the row shows the
worst rank's. Alternating rounds in one run makes the ratio robust to a noisy machine (the
absolute figures are not). The case ``solo_all_reduce`` times all_reduce on groups of one
rank (``new_group([rank])``), which smddp runs in place. Also: a DDP step (an MLP of 8.4M
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
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks.collectives.outdir import OUT_HELP, OutFolder, matplotlib_installed
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
# Each rank's share of a case's bytes.
_SHARED = ("all_gather", "gather", "scatter")


def _rounds(nbytes: int) -> tuple[int, int]:
    """(rounds, calls per round) for a size: fewer calls for larger messages."""
    if nbytes <= 64 << 10:
        return 10, 100
    if nbytes <= 1 << 20:
        return 8, 30
    if nbytes <= 16 << 20:
        return 6, 6
    return 4, 3


def _time_case(
    op: str, nbytes: int, groups: dict[str, Any], world: int, rank: int
) -> tuple[dict[str, float], dict[str, float]]:
    """This rank's median time per call of each backend, and its mean CPU time per call
    (every thread of the process: smddp's progress thread, gloo's own threads)."""
    import torch
    import torch.distributed as dist

    n = max(1, nbytes // 4)
    if op in _SHARED:
        n = max(1, n // world)
    t = torch.ones(n, dtype=torch.float32)
    out = torch.empty(n if op == "all_to_all" else n * world, dtype=torch.float32)
    part = torch.empty(n // world if op == "reduce_scatter" else n, dtype=torch.float32)
    blocks = list(out.chunk(world)) if rank == 0 else None  # the root's, gather and scatter

    def call(group: Any) -> None:
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

    rounds, per = _rounds(nbytes)
    samples: dict[str, list[float]] = {name: [] for name in groups}
    cpu = dict.fromkeys(groups, 0.0)
    for g in groups.values():  # warm up both
        for _ in range(3):
            call(g)
    for r in range(rounds):
        order = list(groups.items()) if r % 2 == 0 else list(groups.items())[::-1]
        for name, g in order:
            dist.barrier(group=groups["gloo"])
            for _ in range(per):
                if op in ("all_reduce", "solo_all_reduce"):
                    t.fill_(1.0)
                busy = time.process_time()
                start = time.perf_counter()
                call(g)
                samples[name].append(time.perf_counter() - start)
                cpu[name] += time.process_time() - busy
    calls = rounds * per
    return (
        {name: statistics.median(v) for name, v in samples.items()},
        {name: c / calls for name, c in cpu.items()},
    )


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
    rank: int, world: int, init: str, ddp_steps: int, queue_path: str, cases: tuple = CASES
) -> None:
    import torch
    import torch.distributed as dist

    import smddp  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    groups = {"smddp": dist.new_group(backend="smddp"), "gloo": dist.group.WORLD}
    solo: dict[str, Any] = {}
    if any(op == "solo_all_reduce" for op, _ in cases):
        for b in ("smddp", "gloo"):
            # Every rank takes part in making every group, members or not.
            solo[b] = [dist.new_group([r], backend=b) for r in range(world)][rank]
    mine: dict[str, Any] = {"cases": {}, "cpu": {}}
    for op, nbytes in cases:
        on = solo if op == "solo_all_reduce" else groups
        key = f"{op}:{nbytes}"
        mine["cases"][key], mine["cpu"][key] = _time_case(op, nbytes, on, world, rank)
    if world == 2 and ddp_steps:
        mine["ddp"] = _ddp_step(groups, rank, ddp_steps)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=groups["gloo"])
    if rank == 0:
        with open(queue_path, "w") as f:
            json.dump(everyone, f)
    dist.destroy_process_group()


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


def run(world: int, ddp_steps: int, cases: tuple = CASES) -> dict[str, Any]:
    """Runs one world size; returns the worst rank's medians per case and backend."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        init, path = os.path.join(d, "init"), os.path.join(d, "out.json")
        mp.spawn(_rank_main, args=(world, init, ddp_steps, path, cases), nprocs=world, join=True)
        with open(path) as f:
            ranks = json.load(f)
    cases = {}
    for key in ranks[0]["cases"]:
        cases[key] = {b: max(r["cases"][key][b] for r in ranks) for b in ranks[0]["cases"][key]}
    # CPU time per call, all ranks together: what the machine's cores must supply per call.
    cpu = {
        key: {b: sum(r["cpu"][key][b] for r in ranks) for b in ranks[0]["cpu"][key]}
        for key in ranks[0]["cpu"]
    }
    out: dict[str, Any] = {"world": world, "cores": usable_cores(), "cases": cases, "cpu": cpu}
    if "ddp" in ranks[0]:
        out["ddp"] = {
            b: {k: max(r["ddp"][b][k] for r in ranks) for k in ranks[0]["ddp"][b]}
            for b in ranks[0]["ddp"]
        }
    return out


def _fmt_t(s: float) -> str:
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
    """The README's table: per case and world size, smddp, gloo and gloo/smddp."""
    worlds = [r["world"] for r in results]
    head = "| op | " + " | ".join(f"w={w} smddp | w={w} gloo | gloo/smddp" for w in worlds) + " |"
    lines = [head, "| --- |" + " --- | --- | --- |" * len(worlds)]
    for op, nbytes in cases:
        key = f"{op}:{nbytes}"
        label = _label(op, nbytes)
        cells = []
        for r in results:
            c = r["cases"][key]
            sm, gl = c["smddp"], c["gloo"]
            bw = f" ({_busbw(op, nbytes, r['world'], sm):.2f} GB/s)" if nbytes >= 1 << 20 else ""
            cells.append(f"{_fmt_t(sm)}{bw} | {_fmt_t(gl)} | {gl / sm:.2f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
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
    p.add_argument("--world-sizes", default="2,4")
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
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        results = saved["results"]
        ref = {int(k): v for k, v in saved["reference"].items()}
        cases = tuple(c for c in cases if all(f"{c[0]}:{c[1]}" in r["cases"] for r in results))
    else:
        results = [run(int(w), args.ddp_steps, cases) for w in args.world_sizes.split(",")]
        ref = {n: _reference(n) for n in (1 << 20, 16 << 20, 64 << 20)}
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
    if args.plot or matplotlib_installed():
        plot(out.path("paired.png", args.plot), results, cases)
    else:
        print("no paired.png: matplotlib is not installed", file=sys.stderr)
    out.announce()
    return 0


if __name__ == "__main__":
    sys.exit(main())
