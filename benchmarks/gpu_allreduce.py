"""GPU all_reduce over smddp: several ranks sharing one GPU, CUDA IPC to the daemon.

``python -m benchmarks.gpu_allreduce [--worlds 2,4] [--sizes-mib 1,4,16,64,256,1024]``

For each world size, ranks (processes, all on GPU ``--device``) join an "smddp" group whose
embedded daemon reduces with its CUDA kernels, and time float32 all_reduce of each size:

- ``time``: per op, with ``--iters`` ops issued back to back (async) and timed by CUDA
  events on the rank's stream, so it is the GPU's time, host round trips overlapped;
- ``latency``: per op, one blocking op at a time, timed on the host (what a loop of
  synchronous calls sees);
- ``busbw``: ``size x 2 (W-1) / W / time``, NCCL's bus bandwidth of all_reduce;
- ``kernel_bw``: the memory traffic of the daemon's reduction, ``2 x W x size / time`` (it
  reads every rank's buffer once and writes every rank's output once), against ``copy_bw``,
  a device-to-device copy (``2 x size`` moved) of the same size timed in the same run.

The daemon is the job's embedded one (started by rank 0); it needs CuPy. Results go to
stdout as a table and to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from typing import Any

MIB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def iterations(nbytes: int, budget: int) -> int:
    """Timed ops per size: about ``budget`` bytes' worth, between 5 and 100."""
    return max(5, min(100, budget // max(1, nbytes)))


def _rank(
    rank: int, world: int, port: int, device: int, sizes: list[int], budget: int, queue: Any
) -> None:
    try:
        import torch
        import torch.distributed as dist

        import smddp  # noqa: F401  (registers the backend)

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(device)
        dist.init_process_group("smddp", rank=rank, world_size=world)
        rows = []
        for nbytes in sizes:
            n = nbytes // 4
            x = torch.ones(n, dtype=torch.float32, device=f"cuda:{device}")
            iters = iterations(nbytes, budget)
            for _ in range(2):
                dist.all_reduce(x)  # warm-up: the daemon compiles its kernel, opens handles
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            works = [dist.all_reduce(x, async_op=True) for _ in range(iters)]
            for w in works:
                w.wait()
            end.record()
            end.synchronize()
            gpu_s = start.elapsed_time(end) / 1e3 / iters
            dist.barrier()
            lat = []
            for _ in range(min(iters, 20)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                dist.all_reduce(x)
                torch.cuda.synchronize()
                lat.append(time.perf_counter() - t0)
            lat.sort()
            # The slowest rank's time is the op's time.
            times = torch.tensor([gpu_s, lat[len(lat) // 2]], dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            copy_s = None
            if rank == 0:
                y = torch.empty_like(x)
                y.copy_(x)
                torch.cuda.synchronize()
                start.record()
                for _ in range(iters):
                    y.copy_(x)
                end.record()
                end.synchronize()
                copy_s = start.elapsed_time(end) / 1e3 / iters
                del y
            dist.barrier()
            rows.append(
                {
                    "bytes": nbytes,
                    "iters": iters,
                    "time_s": times[0].item(),
                    "latency_s": times[1].item(),
                    "copy_s": copy_s,
                }
            )
            del x, works
            torch.cuda.empty_cache()
        dist.destroy_process_group()
        queue.put((rank, rows, None))
    except BaseException as exc:  # report, do not hang the parent
        import traceback

        queue.put((rank, None, f"{exc!r}\n{traceback.format_exc()}"))


def run_world(
    world: int, device: int, sizes: list[int], budget: int, timeout_s: float
) -> list[dict[str, Any]]:
    """Runs one world; returns rank 0's rows with the derived bandwidths."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, device, sizes, budget, queue))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SystemExit(
                    f"world {world}: ranks {sorted(set(range(world)) - set(results))} did not "
                    f"finish in {timeout_s:.0f} s"
                )
            try:
                rank, rows, error = queue.get(timeout=min(remaining, 5.0))
            except Exception:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise SystemExit(
                        f"world {world}: a rank died with exit code {dead[0].exitcode}"
                    ) from None
                continue
            if error:
                raise SystemExit(f"world {world}: rank {rank} failed: {error}")
            results[rank] = rows
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    rows = results[0]
    for row in rows:
        b, t = row["bytes"], row["time_s"]
        row["world"] = world
        row["busbw_GBps"] = b * 2 * (world - 1) / world / t / 1e9
        row["kernel_bw_GBps"] = 2 * world * b / t / 1e9
        row["copy_bw_GBps"] = 2 * b / row["copy_s"] / 1e9 if row["copy_s"] else None
        row["kernel_vs_copy"] = (
            row["kernel_bw_GBps"] / row["copy_bw_GBps"] if row["copy_bw_GBps"] else None
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--worlds", default="2,4", help="world sizes, comma-separated (default 2,4)"
    )
    parser.add_argument("--sizes-mib", default="1,4,16,64,256,1024", help="message sizes in MiB")
    parser.add_argument("--device", type=int, default=0, help="the GPU every rank uses")
    parser.add_argument(
        "--budget-mib", type=int, default=4096, help="bytes of timed ops per size (sets iterations)"
    )
    parser.add_argument("--timeout-s", type=float, default=240.0, help="limit per world size")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    sizes = [int(float(s) * MIB) for s in args.sizes_mib.split(",")]
    # A private CuPy kernel cache and no system daemon: the job's embedded daemon is measured.
    os.environ.setdefault("CUPY_CACHE_DIR", os.path.join(tempfile.gettempdir(), "smddp-cupy-cache"))
    os.environ.pop("SMDDP_SOCKET", None)
    os.environ["SMDDP_EMBEDDED"] = "1"
    all_rows = []
    header = f"{'world':>5} {'size':>9} {'iters':>5} {'time':>10} {'latency':>10} {'busbw':>9} {'kernel bw':>10} {'copy bw':>9} {'kernel/copy':>11}"
    print(header)
    for world in worlds:
        for row in run_world(world, args.device, sizes, args.budget_mib * MIB, args.timeout_s):
            all_rows.append(row)
            print(
                f"{world:>5} {row['bytes'] // MIB:>6} MiB {row['iters']:>5} "
                f"{row['time_s'] * 1e6:>8.1f}us "
                f"{row['latency_s'] * 1e6:>8.1f}us {row['busbw_GBps']:>7.1f}GB/s "
                f"{row['kernel_bw_GBps']:>8.1f}GB/s "
                f"{(row['copy_bw_GBps'] or 0):>7.1f}GB/s {(row['kernel_vs_copy'] or 0):>10.2f}x",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": all_rows, "argv": sys.argv}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
