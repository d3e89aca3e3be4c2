"""The GPU check's speed table: smddp against gloo on the same CUDA tensors, in the same
processes, in alternating rounds; the worst rank's median of each.

``gpu_check_stages.py speed`` calls ``drive``: one smddpd (its /metrics read for the time
breakdown), then for each world size W (2 and 4, every rank on GPU 0) W rank processes of
``python -m benchmarks.gpu_speed`` that join "smddp" and a gloo group of the same ranks, and
measure:

- all_reduce (float32 and bfloat16), broadcast, all_gather (into one tensor) and
  reduce_scatter (from one tensor) of 4 B, 64 KiB, 1 MiB, 16 MiB and 256 MiB per rank: a
  blocking op and a device synchronisation per iteration, smddp and gloo taking turns round by
  round, each rank's median, the worst rank's median reported; smddp's result checked first;
- ``kernel``: the daemon's reduction kernel (``gpu_runtime.CupyRuntime``, the daemon's code)
  launched by rank 0 on W buffers of its own, timed by CUDA events: its bytes per second
  (it reads W buffers and writes W) against a device-to-device copy timed in the same run;
- ``ddp``: a step of DDP on a ~60M-parameter MLP, smddp against gloo, and the step without
  DDP: the communication overhead of each (W = 2);
- ``breakdown``: where an all_reduce's time goes at 4 B and 16 MiB (W = 2): the rank's whole
  blocking op, the daemon's part (its op-duration histogram: first arrival to work queued, of
  which the arrival skew), the kernel and one launch's host time (as above); the rest is the
  rank's own code, the socket and the event waits.

Rows that would not fit in the stage's time are reported as skipped. Results: ``speed.md``
(tables) and ``speed.json``.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu_check_common import (
    Gpu,
    deadline,
    fake_gpu,
    free_port,
    quick,
    rank_env,
    run_ranks,
    start_daemon,
    write_verdict,
)

KIB, MIB = 1 << 10, 1 << 20
SIZES = [4, 64 * KIB, MIB, 16 * MIB, 256 * MIB]
OPS = [
    ("all_reduce", "float32"),
    ("all_reduce", "bfloat16"),
    ("broadcast", "float32"),
    ("all_gather", "float32"),
    ("reduce_scatter", "float32"),
]
MARK = "SPEED_RESULT "
SPEC_ENV = "SMDDP_SPEED_SPEC"


def plan() -> tuple[list[int], list[int]]:
    """World sizes and message sizes of this run (full, --quick, or the fake GPU's)."""
    if fake_gpu():
        return [2], [4, 64 * KIB]
    if quick():
        return [2], [4, MIB, 16 * MIB]
    return [2, 4], SIZES


def iterations(nbytes: int) -> tuple[int, int]:
    """(rounds, iterations per round and backend) for a message of ``nbytes``."""
    if fake_gpu():
        return 2, 3
    if nbytes >= 256 * MIB:
        return 3, 1
    if nbytes >= 16 * MIB:
        return 3, 3
    return 4, 10


# -- in the rank -----------------------------------------------------------------------------


class Rank:
    """One rank's measurements (every rank runs every op; rank 0 reports)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        import smddp  # noqa: F401  (registers the backend)

        self.torch, self.dist, self.spec = torch, dist, spec
        dist.init_process_group("smddp")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.gloo = dist.new_group(backend="gloo")
        self.gpu = Gpu(int(os.environ.get("LOCAL_RANK", "0")))
        self.end = float(spec["deadline"])

    def agree(self, go: bool) -> bool:
        """Rank 0's decision, for every rank."""
        t = self.torch.tensor([1.0 if go else 0.0])
        self.dist.broadcast(t, 0, group=self.gloo)
        return bool(t.item())

    def worst(self, values: list[float]) -> list[float]:
        """The largest of each value over the ranks (NaN for none)."""
        t = self.torch.tensor(values, dtype=self.torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.gloo)
        return [float(v) for v in t.tolist()]

    def buffers(self, op: str, dtype: Any, nbytes: int) -> tuple[Any, Any, int]:
        itemsize = self.torch.empty(0, dtype=dtype).element_size()
        n = max(1, nbytes // itemsize)
        if op == "reduce_scatter":
            n = max(n, self.world) // self.world * self.world
        x = self.gpu.empty(n, dtype)
        if op == "all_gather":
            out = self.gpu.empty(n * self.world, dtype)
        elif op == "reduce_scatter":
            out = self.gpu.empty(n // self.world, dtype)
        else:
            out = x
        return x, out, n

    def run_op(self, op: str, x: Any, out: Any, group: Any) -> None:
        d = self.dist
        if op == "all_reduce":
            d.all_reduce(x, group=group)
        elif op == "broadcast":
            d.broadcast(x, 0, group=group)
        elif op == "all_gather":
            d.all_gather_into_tensor(out, x, group=group)
        else:
            d.reduce_scatter_tensor(out, x, group=group)

    def check(self, op: str, x: Any, out: Any) -> bool:
        """smddp's result of the op on inputs ``rank + 1`` is what it must be."""
        w = self.world
        x.fill_(self.rank + 1)
        self.run_op(op, x, out, None)
        self.gpu.sync()
        got = out.float().cpu()
        if op in ("all_reduce", "reduce_scatter"):
            want = self.torch.full_like(got, w * (w + 1) / 2)
        elif op == "broadcast":
            want = self.torch.ones_like(got)
        else:
            want = self.torch.arange(1, w + 1, dtype=got.dtype).repeat_interleave(got.numel() // w)
        return bool(self.torch.equal(got, want))

    def row(self, op: str, dtype_name: str, nbytes: int) -> dict[str, Any]:
        dtype = getattr(self.torch, dtype_name)
        x, out, n = self.buffers(op, dtype, nbytes)
        row: dict[str, Any] = {"op": op, "dtype": dtype_name, "bytes": nbytes, "world": self.world}
        row["ok"] = self.check(op, x, out)
        x.zero_()
        gloo_error = ""
        try:
            self.run_op(op, x, out, self.gloo)  # warm-up, and does gloo take it?
            self.gpu.sync()
        except Exception as exc:
            gloo_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        self.run_op(op, x, out, None)
        self.gpu.sync()
        rounds, iters = iterations(nbytes)
        times: dict[str, list[float]] = {"smddp": [], "gloo": []}
        for r in range(rounds):
            order = ["smddp", "gloo"] if r % 2 == 0 else ["gloo", "smddp"]
            for backend in order:
                if backend == "gloo" and gloo_error:
                    continue
                group = None if backend == "smddp" else self.gloo
                self.dist.barrier(group=self.gloo)
                for _ in range(iters):
                    t0 = time.perf_counter()
                    self.run_op(op, x, out, group)
                    self.gpu.sync()
                    times[backend].append(time.perf_counter() - t0)
        nan = float("nan")
        med = [statistics.median(times[b]) if times[b] else nan for b in ("smddp", "gloo")]
        worst = self.worst([*med, 0.0 if row["ok"] else 1.0])
        row.update(smddp_s=worst[0], gloo_s=worst[1], ok=worst[2] == 0.0, n=n)
        row["gloo_error"] = gloo_error
        row["samples"] = rounds * iters
        del x, out
        return row

    # -- the kernel alone, against a copy ------------------------------------------------------

    def kernel_vs_copy(self, nbytes: int) -> dict[str, Any]:
        """Rank 0: the daemon's all_reduce kernel for W ranks on its own buffers, and a copy."""
        torch = self.torch
        from smddp.server import gpu_kernels
        from smddp.server.gpu_runtime import CupyRuntime
        from smddp.v1 import smddp_pb2 as pb

        w, n = self.world, nbytes // 4
        rt = CupyRuntime()
        key = (pb.FLOAT32, pb.SUM, w, w)
        t0 = time.perf_counter()
        rt.prepare(self.gpu.index, key)
        prepare_s = time.perf_counter() - t0
        bufs_in = [torch.ones(n, device=self.gpu.device) for _ in range(w)]
        bufs_out = [torch.empty(n, device=self.gpu.device) for _ in range(w)]
        ins = [b.data_ptr() for b in bufs_in]
        outs = [b.data_ptr() for b in bufs_out]
        stream = torch.cuda.current_stream().cuda_stream
        grid = rt.max_grid(self.gpu.index)

        def launch_all(count: int) -> int:
            launches = 0
            for a, b in gpu_kernels.chunks(count, 4, 1 << 30):
                for launch in gpu_kernels.plan_launches(a, b, 4, ins + outs, grid):
                    rt.reduce(stream, self.gpu.index, pb.FLOAT32, pb.SUM, ins, outs, launch)
                    launches += 1
            return launches

        def timed(fn: Any, reps: int) -> float:
            fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3 / reps

        reps = 10 if nbytes >= 64 * MIB else 50
        kernel_s = timed(lambda: launch_all(n), reps)
        copy_s = timed(lambda: bufs_out[0].copy_(bufs_in[0]), reps)
        ok = bool(torch.all(bufs_out[-1] == float(w)).item())
        # One launch's host time: the smallest op (1 element), launches issued back to back.
        host = []
        for _ in range(200):
            t0 = time.perf_counter()
            launch_all(1)
            host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        small_kernel_s = timed(lambda: launch_all(1), 200)
        bufs_in.clear()  # the GPU memory back before the next world
        bufs_out.clear()
        torch.cuda.empty_cache()
        return {
            "bytes": nbytes,
            "world": w,
            "kernel_s": kernel_s,
            "kernel_GBps": 2 * w * nbytes / kernel_s / 1e9,
            "copy_s": copy_s,
            "copy_GBps": 2 * nbytes / copy_s / 1e9,
            "kernel_vs_copy": (2 * w * nbytes / kernel_s) / (2 * nbytes / copy_s),
            "kernel_ok": ok,
            "launch_host_s": statistics.median(host),
            "kernel_4B_s": small_kernel_s,
            "prepare_s": prepare_s,
            "cubins": dict(rt.sources),
        }

    # -- the op on the rank's stream, back to back ----------------------------------------------

    def stream_bw(self, nbytes: int) -> dict[str, Any]:
        """smddp all_reduce float32 ops issued back to back (async), the rank's stream timed
        by CUDA events: the GPU's time per op with host round trips overlapped."""
        torch = self.torch
        n = nbytes // 4
        x = torch.zeros(n, device=self.gpu.device)
        iters = 5 if nbytes >= 64 * MIB else 20
        self.dist.all_reduce(x)
        torch.cuda.synchronize()
        self.dist.barrier(group=self.gloo)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        works = [self.dist.all_reduce(x, async_op=True) for _ in range(iters)]
        for work in works:
            work.wait()
        end.record()
        end.synchronize()
        per_op = self.worst([float(start.elapsed_time(end)) / 1e3 / iters])[0]
        w = self.world
        return {"bytes": nbytes, "op_s": per_op, "op_traffic_GBps": 2 * w * nbytes / per_op / 1e9}

    # -- DDP -------------------------------------------------------------------------------------

    def ddp(self) -> dict[str, Any]:
        torch, dist = self.torch, self.dist
        from torch import nn
        from torch.nn.parallel import DistributedDataParallel as DDP

        hidden, width, batch, steps = (7168, 2048, 32, 5) if not fake_gpu() else (64, 32, 4, 2)

        def model() -> Any:
            torch.manual_seed(0)
            m = nn.Sequential(
                nn.Linear(width, hidden),
                nn.GELU(),
                nn.Linear(hidden, width),
                nn.GELU(),
                nn.Linear(width, hidden),
                nn.GELU(),
                nn.Linear(hidden, width),
            )
            return self.gpu.module(m)

        g = torch.Generator().manual_seed(self.rank)
        x = self.gpu.tensor(torch.randn(batch, width, generator=g))

        def step_time(m: Any) -> float:
            opt = torch.optim.SGD(m.parameters(), lr=1e-4)
            times = []
            for i in range(steps + 2):
                self.gpu.sync()
                t0 = time.perf_counter()
                opt.zero_grad()
                m(x).square().mean().backward()
                opt.step()
                self.gpu.sync()
                if i >= 2:  # the first steps build buckets and warm up
                    times.append(time.perf_counter() - t0)
            return statistics.median(times)

        params = sum(p.numel() for p in model().parameters())
        local = step_time(model())
        device_ids = None if fake_gpu() else [self.gpu.index]
        timings: dict[str, float] = {}
        for backend in ("smddp", "gloo", "smddp"):  # smddp twice: before and after gloo
            group = None if backend == "smddp" else self.gloo
            m = DDP(model(), device_ids=device_ids, process_group=group)
            dist.barrier(group=self.gloo)
            t = step_time(m)
            timings[backend] = min(t, timings.get(backend, t))
            del m
        worst = self.worst([local, timings["smddp"], timings["gloo"]])
        over = [max(0.0, worst[1] - worst[0]), max(0.0, worst[2] - worst[0])]
        return {
            "params": params,
            "local_step_s": worst[0],
            "smddp_step_s": worst[1],
            "gloo_step_s": worst[2],
            "smddp_overhead_s": over[0],
            "gloo_overhead_s": over[1],
            "overhead_ratio": over[0] / over[1] if over[1] > 0 else None,
        }

    # -- where the time goes ---------------------------------------------------------------------

    def breakdown(self, nbytes: int, metrics_url: str) -> dict[str, Any]:
        torch = self.torch
        x = self.gpu.empty(max(1, nbytes // 4), torch.float32)
        x.zero_()
        reps = 50 if nbytes <= MIB else 10
        self.dist.all_reduce(x)
        self.gpu.sync()
        self.dist.barrier(group=self.gloo)
        before = _scrape(metrics_url) if self.rank == 0 else {}
        self.dist.barrier(group=self.gloo)
        lat = []
        for _ in range(reps):
            t0 = time.perf_counter()
            self.dist.all_reduce(x)
            self.gpu.sync()
            lat.append(time.perf_counter() - t0)
        self.dist.barrier(group=self.gloo)
        after = _scrape(metrics_url) if self.rank == 0 else {}
        total = self.worst([statistics.median(lat)])[0]
        out: dict[str, Any] = {"bytes": nbytes, "total_s": total, "ops": reps}
        if self.rank == 0:
            count = after.get("count", 0) - before.get("count", 0)
            if count > 0:
                out["daemon_s"] = (after["sum"] - before["sum"]) / count
                out["skew_s"] = (after["skew_sum"] - before["skew_sum"]) / count
        return out


def _scrape(url: str) -> dict[str, float]:
    """The daemon's all_reduce float32 op-duration and arrival-skew sums and count."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"(\w+)\{([^}]*)\} (\S+)", line)
        if not m:
            continue
        name, labels, value = m.groups()
        if 'op="all_reduce"' not in labels:
            continue
        if name == "smddp_op_duration_seconds_sum" and 'dtype="float32"' in labels:
            out["sum"] = float(value)
        elif name == "smddp_op_duration_seconds_count" and 'dtype="float32"' in labels:
            out["count"] = float(value)
        elif name == "smddp_arrival_skew_seconds_sum":
            out["skew_sum"] = float(value)
    return out


def rank_main() -> None:
    """One rank: every row of the spec while time is left; rank 0 prints the results."""
    spec = json.loads(os.environ[SPEC_ENV])
    r = Rank(spec)
    rows = []
    for op, dtype, nbytes in spec["rows"]:
        # Rank 0 decides for all, from the time left and a guess of the row's cost.
        guess = 2.0 + nbytes / (64 * MIB) * (4 if r.world > 2 else 2)
        if not r.agree(time.time() + guess < r.end):
            rows.append({"op": op, "dtype": dtype, "bytes": nbytes, "world": r.world, "skipped": 1})
            continue
        rows.append(r.row(op, dtype, nbytes))
        print(f"row {json.dumps(rows[-1])}", flush=True)
    result: dict[str, Any] = {"world": r.world, "rows": rows}
    real = not fake_gpu()
    if real and r.agree(time.time() + 15 < r.end):
        result["stream"] = r.stream_bw(max(s for _, _, s in spec["rows"]))
    if spec.get("ddp") and r.agree(time.time() + 40 < r.end):
        result["ddp"] = r.ddp()
    if spec.get("metrics"):
        result["breakdown"] = []
        for nbytes in (4, 16 * MIB if real else 64 * KIB):
            if r.agree(time.time() + 10 < r.end):
                result["breakdown"].append(r.breakdown(nbytes, spec["metrics"]))
    if real and r.rank == 0 and time.time() + 20 < r.end:
        try:
            result["kernel"] = r.kernel_vs_copy(max(s for _, _, s in spec["rows"]))
        except Exception as exc:  # reported, the rest stands
            result["kernel_error"] = f"{type(exc).__name__}: {exc}"
    r.dist.barrier(group=r.gloo)
    r.dist.destroy_process_group()
    if r.rank == 0:
        print(MARK + json.dumps(result), flush=True)


# -- the driver ------------------------------------------------------------------------------


def _us(s: float | None) -> str:
    if s is None or s != s:
        return "-"
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def _size(b: int) -> str:
    return f"{b >> 20} MiB" if b >= MIB else (f"{b >> 10} KiB" if b >= KIB else f"{b} B")


def render(results: list[dict[str, Any]]) -> tuple[str, list[str], bool]:
    """speed.md's text, the target lines, and whether every measured smddp result was right."""
    md = ["# smddp against gloo on the same CUDA tensors (worst rank's median)", ""]
    md.append("| W | op | dtype | size | smddp | gloo | gloo / smddp | checked |")
    md.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    right = True
    measured = 0
    for res in results:
        for row in res["rows"]:
            head = f"| {row['world']} | {row['op']} | {row['dtype']} | {_size(row['bytes'])} |"
            if row.get("skipped"):
                md.append(f"{head} skipped (time) | | | |")
                continue
            measured += 1
            right &= bool(row["ok"])
            g = row["gloo_s"]
            ratio = f"{g / row['smddp_s']:.1f}x" if g == g and row["smddp_s"] > 0 else "-"
            gloo = _us(g) if not row["gloo_error"] else f"n/a ({row['gloo_error']})"
            md.append(
                f"{head} {_us(row['smddp_s'])} | {gloo} | {ratio} | "
                f"{'ok' if row['ok'] else 'WRONG'} |"
            )
    targets: list[str] = []

    def find(world: int, op: str, dtype: str, nbytes: int) -> dict[str, Any] | None:
        for res in results:
            for row in res["rows"]:
                if (row["world"], row["op"], row["dtype"], row["bytes"]) == (
                    world,
                    op,
                    dtype,
                    nbytes,
                ) and not row.get("skipped"):
                    return dict(row)
        return None

    for op in ("all_reduce", "broadcast"):
        row = find(2, op, "float32", 16 * MIB)
        if row and row["gloo_s"] == row["gloo_s"]:
            x = row["gloo_s"] / row["smddp_s"]
            targets.append(
                f"{op} 16 MiB W2: {x:.1f}x gloo (target >= 10x: {'met' if x >= 10 else 'NOT met'})"
            )
    row = find(2, "all_reduce", "float32", 4)
    if row:
        targets.append(f"all_reduce 4 B W2: {_us(row['smddp_s'])} (goal beyond: <= 30 us)")
    for res in results:
        k = res.get("kernel")
        if k:
            md += [
                "",
                f"## The reduction kernel alone, W = {k['world']}, {_size(k['bytes'])} float32 SUM",
                "",
                f"kernel {_us(k['kernel_s'])}: {k['kernel_GBps']:.0f} GB/s of traffic "
                f"(reads W, writes W); device-to-device copy {_us(k['copy_s'])}: "
                f"{k['copy_GBps']:.0f} GB/s; kernel / copy {k['kernel_vs_copy']:.2f} "
                f"(result {'ok' if k['kernel_ok'] else 'WRONG'}); "
                f"one launch's host time {_us(k['launch_host_s'])}, a 1-element kernel "
                f"{_us(k['kernel_4B_s'])}; module ready in {k['prepare_s'] * 1e3:.0f} ms "
                f"(cubins: {k['cubins']})",
            ]
            right &= bool(k["kernel_ok"])
            if k["bytes"] >= 64 * MIB:
                v = k["kernel_vs_copy"]
                targets.append(
                    f"all_reduce kernel {_size(k['bytes'])} W{k['world']}: {v:.2f} of the d2d copy "
                    f"(target >= 0.70: {'met' if v >= 0.7 else 'NOT met'})"
                )
        if res.get("kernel_error"):
            md += ["", f"kernel measurement failed: {res['kernel_error']}"]
        s = res.get("stream")
        if s:
            md += [
                "",
                f"all_reduce {_size(s['bytes'])} W{res['world']} back to back on the rank's "
                f"stream: {_us(s['op_s'])} per op, {s['op_traffic_GBps']:.0f} GB/s of kernel "
                "traffic",
            ]
        d = res.get("ddp")
        if d:
            ratio = d["overhead_ratio"]
            md += [
                "",
                f"## DDP step, W = {res['world']}, {d['params'] / 1e6:.1f}M parameters",
                "",
                f"without DDP {_us(d['local_step_s'])}; smddp {_us(d['smddp_step_s'])} "
                f"(overhead {_us(d['smddp_overhead_s'])}); gloo {_us(d['gloo_step_s'])} "
                f"(overhead {_us(d['gloo_overhead_s'])})",
            ]
            if ratio is not None:
                targets.append(
                    f"DDP step comm overhead: smddp {ratio:.2f} of gloo's "
                    f"(target <= 0.33: {'met' if ratio <= 1 / 3 else 'NOT met'})"
                )
        for b in res.get("breakdown", []):
            k = res.get("kernel") or {}
            kern = k.get("kernel_4B_s") if b["bytes"] <= 4 else None
            if kern is None and k and b["bytes"] == k.get("bytes"):
                kern = k.get("kernel_s")
            daemon = b.get("daemon_s")
            skew = b.get("skew_s")
            # Means (the daemon's histogram) against a median: the rest may come out below 0.
            rest = max(0.0, b["total_s"] - (daemon or 0) - (kern or 0))
            md += [
                "",
                f"## Where an all_reduce of {_size(b['bytes'])} (W = {res['world']}) spends "
                "its time",
                "",
                f"- rank, whole blocking op (call to synchronised): {_us(b['total_s'])}",
                f"- daemon, first arrival to work queued: {_us(daemon)} (arrival skew {_us(skew)})",
                f"- kernel: {_us(kern)}; one launch on the host: {_us(k.get('launch_host_s'))}",
                f"- rest (rank's code, socket, event waits): {_us(rest)}",
            ]
    if measured == 0:
        right = False
    md += ["", "## Targets", "", *[f"- {t}" for t in targets]]
    return "\n".join(md) + "\n", targets, right


def drive(md_path: Path, json_path: Path) -> int:
    """Runs every world of the plan within the stage's cap; writes the results; the verdict."""
    worlds, sizes = plan()
    d = start_daemon("speed", http=True)
    results: list[dict[str, Any]] = []
    problems: list[str] = []
    try:
        metrics = f"http://127.0.0.1:{d.http_port}/metrics" if d.http_port else ""
        for i, w in enumerate(worlds):
            left = deadline() - time.time() - 5
            share = left * (0.6 if i == 0 and len(worlds) > 1 else 1.0)
            rows = [(op, dt, s) for op, dt in OPS for s in sizes]
            spec = {
                "rows": rows,
                "deadline": time.time() + share - 15,  # ranks' start and exit
                "ddp": w == 2,
                "metrics": metrics if w == 2 else "",
            }
            port = free_port()
            cmd = [sys.executable, "-m", "benchmarks.gpu_speed"]
            envs = [
                rank_env(r, w, port, d, **{SPEC_ENV: json.dumps(spec), "OMP_NUM_THREADS": "2"})
                for r in range(w)
            ]
            run = run_ranks([cmd] * w, envs, share)
            got = run.results(MARK)[0]
            if got:
                results.append(got)
            else:
                problems.append(f"W={w}: {run.why(800)}")
                print(run.why(3000), flush=True)
            text, targets, right = render(results)
            md_path.write_text(text + "".join(f"\nW={p}\n" for p in problems))
            json_path.write_text(json.dumps({"results": results, "problems": problems}, indent=1))
            print(text, flush=True)
    finally:
        d.stop()
    if not results:
        write_verdict("speed", "FAIL", problems[0].splitlines()[0] if problems else "no results")
        return 1
    text, targets, right = render(results)
    detail = "; ".join(targets) or "no target figures measured"
    if problems:
        detail += f"; {len(problems)} world(s) failed"
    verdict = "PASS" if right and not problems else "FAIL"
    if not right:
        detail = "a result was WRONG or nothing was measured; " + detail
    write_verdict("speed", verdict, detail)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    rank_main()
