"""What the ranks of the GPU tests run (each in its own process, started by ``spawn_ranks``).

Every rank can rebuild every other rank's inputs (seeded by rank), so each checks its own
results bitwise against the host path (``smddp.core.reduce``, numpy) without exchanging them.
Functions return a list of failures (empty when all is well) or a dict of measurements.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist

from smddp.core.reduce import reduce_into
from smddp.core.wire import reduce_op_check
from smddp.v1 import smddp_pb2 as pb

DTYPES = {
    torch.float16: pb.FLOAT16,
    torch.bfloat16: pb.BFLOAT16,
    torch.float32: pb.FLOAT32,
    torch.float64: pb.FLOAT64,
    torch.int8: pb.INT8,
    torch.uint8: pb.UINT8,
    torch.int16: pb.INT16,
    torch.int32: pb.INT32,
    torch.int64: pb.INT64,
    torch.bool: pb.BOOL,
}
OPS = {
    dist.ReduceOp.SUM: pb.SUM,
    dist.ReduceOp.AVG: pb.AVG,
    dist.ReduceOp.MIN: pb.MIN,
    dist.ReduceOp.MAX: pb.MAX,
    dist.ReduceOp.PRODUCT: pb.PRODUCT,
    dist.ReduceOp.BAND: pb.BAND,
    dist.ReduceOp.BOR: pb.BOR,
    dist.ReduceOp.BXOR: pb.BXOR,
}
_NP = {
    torch.float16: np.float16,
    torch.bfloat16: ml_dtypes.bfloat16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.bool: np.bool_,
}


# Where a rank's tensors live: a GPU ordinal, CPU (the host path: checks these programs
# themselves without a GPU), or the fake GPU of tests/gpu/fake_device.py (the GPU path of the
# backend, client and a real daemon on its fake runtime; ``init`` gives it to the backend).
CPU = -1
FAKE = -2
_fake: Any = None


def init(rank: int, world: int, init_file: str, device: int) -> torch.device:
    """Joins the "smddp" world with tensors on ``device`` (a GPU, CPU or FAKE)."""
    global _fake
    import smddp  # noqa: F401  (registers the backend)

    if device >= 0:
        torch.cuda.set_device(device)
    elif device == FAKE:
        import fake_device

        from smddp.backend.cuda import device_api, use_device

        use_device(fake_device.get())  # before the process's first device call
        _fake = device_api()
        assert hasattr(_fake, "allocations"), "the backend did not take the fake device"
    dist.init_process_group("smddp", init_method=f"file://{init_file}", rank=rank, world_size=world)
    return torch.device("cuda", device) if device >= 0 else torch.device("cpu")


def empty(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor of ``n`` elements on the rank's device."""
    if _fake is not None:
        return _fake.empty(n, dtype)
    return torch.empty(n, dtype=dtype, device=device)


def host_values(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s input, the same in every process."""
    rng = np.random.default_rng([rank, n, salt, list(DTYPES).index(dtype)])
    np_dtype = np.dtype(_NP[dtype])
    if dtype == torch.bool:
        return rng.integers(0, 2, n).astype(np.bool_)
    if np_dtype.kind in "iu":
        info = np.iinfo(np_dtype)
        return rng.integers(info.min, info.max, n, endpoint=True, dtype=np_dtype)
    return (rng.standard_normal(n) * 10).astype(np.float32).astype(np_dtype)


def to_torch(x: np.ndarray, device: torch.device) -> torch.Tensor:
    if x.dtype == ml_dtypes.bfloat16:
        t = torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(x.copy())
    return _fake.tensor(t) if _fake is not None else t.to(device)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def host_reduce(inputs: list[np.ndarray], op: int) -> np.ndarray:
    out = np.empty_like(inputs[0])
    reduce_into([out], inputs, op)
    return out


class Checker:
    """Collects mismatches instead of stopping at the first."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failures: list[str] = []

    def same(self, what: str, got: torch.Tensor, want: np.ndarray) -> None:
        g = to_numpy(got).reshape(-1)
        w = np.asarray(want).reshape(-1)
        if g.dtype != w.dtype or g.tobytes() != w.tobytes():
            bad = (
                np.flatnonzero(g.view(np.uint8) != w.view(np.uint8)) if g.nbytes == w.nbytes else []
            )
            self.failures.append(
                f"rank {self.rank}: {what}: {g.size} x {g.dtype} differ from the host path "
                f"(first differing byte {bad[0] if len(bad) else '?'}): got {g[:4]} want {w[:4]}"
            )


def collectives_rank(
    rank: int, world: int, init_file: str, devices: list[int], sizes: list[int]
) -> list[str]:
    """Every collective x dtype (x reduce op) on CUDA tensors, checked bitwise."""
    dev = init(rank, world, init_file, devices[rank])
    check = Checker(rank)
    root = world - 1
    for dtype, wire in DTYPES.items():
        for n in sizes:
            ins = [host_values(r, n, dtype) for r in range(world)]
            # all_reduce, every reduce op the dtype takes, in place
            for torch_op, op in OPS.items():
                if reduce_op_check(wire, op) is not None:
                    continue
                x = to_torch(ins[rank], dev)
                dist.all_reduce(x, op=torch_op)
                check.same(f"all_reduce({torch_op}, {n} x {dtype})", x, host_reduce(ins, op))
            # broadcast
            x = to_torch(ins[rank], dev)
            dist.broadcast(x, root)
            check.same(f"broadcast({n} x {dtype})", x, ins[root])
            # reduce (SUM or OR): only the root's tensor is the result
            op = pb.SUM
            x = to_torch(ins[rank], dev)
            dist.reduce(x, 0, op=dist.ReduceOp.SUM)
            check.same(
                f"reduce({n} x {dtype})", x, host_reduce(ins, op) if rank == 0 else ins[rank]
            )
            # all_gather (list) and all_gather_into_tensor
            outs = [empty(n, dtype, dev) for _ in range(world)]
            dist.all_gather(outs, to_torch(ins[rank], dev))
            for s in range(world):
                check.same(f"all_gather[{s}]({n} x {dtype})", outs[s], ins[s])
            big = empty(world * n, dtype, dev)
            dist.all_gather_into_tensor(big, to_torch(ins[rank], dev))
            check.same(f"all_gather_into_tensor({n} x {dtype})", big, np.concatenate(ins))
            # reduce_scatter (list) and reduce_scatter_tensor: block d of every rank
            blocks = [
                [host_values(r, n, dtype, salt=1 + d) for d in range(world)] for r in range(world)
            ]
            out = empty(n, dtype, dev)
            dist.reduce_scatter(out, [to_torch(b, dev) for b in blocks[rank]], op=dist.ReduceOp.SUM)
            want = host_reduce([blocks[r][rank] for r in range(world)], pb.SUM)
            check.same(f"reduce_scatter({n} x {dtype})", out, want)
            out = empty(n, dtype, dev)
            dist.reduce_scatter_tensor(
                out, to_torch(np.concatenate(blocks[rank]), dev), op=dist.ReduceOp.SUM
            )
            check.same(f"reduce_scatter_tensor({n} x {dtype})", out, want)
            # all_to_all_single with uneven splits: rank s sends s + d + 1 elements to rank d
            send_sizes = [rank + d + 1 for d in range(world)]
            recv_sizes = [s + rank + 1 for s in range(world)]
            sent = [host_values(rank, send_sizes[d], dtype, salt=100 + d) for d in range(world)]
            out = empty(sum(recv_sizes), dtype, dev)
            dist.all_to_all_single(out, to_torch(np.concatenate(sent), dev), recv_sizes, send_sizes)
            want = np.concatenate(
                [host_values(s, s + rank + 1, dtype, salt=100 + rank) for s in range(world)]
            )
            check.same(f"all_to_all_single({dtype})", out, want)
            # all_to_all (list)
            outs = [empty(recv_sizes[s], dtype, dev) for s in range(world)]
            dist.all_to_all(outs, [to_torch(x, dev) for x in sent])
            for s in range(world):
                check.same(
                    f"all_to_all[{s}]({dtype})",
                    outs[s],
                    host_values(s, s + rank + 1, dtype, salt=100 + rank),
                )
            # gather and scatter
            outs = [empty(n, dtype, dev) for _ in range(world)] if rank == root else None
            dist.gather(to_torch(ins[rank], dev), outs, dst=root)
            if outs is not None:
                for s in range(world):
                    check.same(f"gather[{s}]({n} x {dtype})", outs[s], ins[s])
            out = empty(n, dtype, dev)
            pieces = (
                [to_torch(blocks[root][d], dev) for d in range(world)] if rank == root else None
            )
            dist.scatter(out, pieces, src=root)
            check.same(f"scatter({n} x {dtype})", out, blocks[root][rank])
            # send/recv around the ring
            if world > 1:
                x = to_torch(ins[rank], dev)
                y = empty(n, dtype, dev)
                reqs = [dist.isend(x, (rank + 1) % world), dist.irecv(y, (rank - 1) % world)]
                for req in reqs:
                    req.wait()
                check.same(f"send/recv({n} x {dtype})", y, ins[(rank - 1) % world])
    # Empty tensors: nothing to move, but the op still completes in order.
    e = empty(0, torch.float32, dev)
    dist.all_reduce(e)
    dist.broadcast(e, root)
    check.same("all_reduce(0 x float32)", e, np.empty(0, dtype=np.float32))
    # A non-contiguous output (a transposed view) is staged and copied back.
    m = to_torch(host_values(rank, 64 * 48, torch.float32).reshape(64, 48), dev).t()
    dist.all_reduce(m)
    want = (
        host_reduce([host_values(r, 64 * 48, torch.float32) for r in range(world)], pb.SUM)
        .reshape(64, 48)
        .T
    )
    check.same("all_reduce(transposed view)", m, np.ascontiguousarray(want))
    dist.destroy_process_group()
    return check.failures


def large_rank(rank: int, world: int, init_file: str, device: int, n: int) -> list[str]:
    """One large float32 and bfloat16 all_reduce (several kernel launches per op)."""
    dev = init(rank, world, init_file, device)
    check = Checker(rank)
    for dtype, op in ((torch.float32, pb.SUM), (torch.bfloat16, pb.MAX)):
        ins = [host_values(r, n, dtype, salt=7) for r in range(world)]
        x = to_torch(ins[rank], dev)
        dist.all_reduce(x, op=dist.ReduceOp.SUM if op == pb.SUM else dist.ReduceOp.MAX)
        check.same(f"all_reduce({n} x {dtype})", x, host_reduce(ins, op))
    dist.destroy_process_group()
    return check.failures


# -- stream and event ordering ------------------------------------------------------------------

SLEEP_CYCLES = 200_000_000  # about 0.1 s of torch.cuda._sleep on current GPUs


def ordering_rank(rank: int, world: int, init_file: str, device: int) -> dict[str, Any]:
    """Checks that the daemon waits for the rank's stream and the rank's stream for the daemon."""
    dev = init(rank, world, init_file, device)
    out: dict[str, Any] = {"failures": []}
    total = float(sum(range(1, world + 1)))
    n = 32 << 20  # 128 MiB of float32: the daemon's reduction takes a while

    def expect(what: str, t: torch.Tensor, value: float) -> None:
        got = t.float()
        if not bool((got == value).all()):
            bad = int((got != value).sum())
            out["failures"].append(
                f"rank {rank}: {what}: {bad} of {t.numel()} elements are not {value} (e.g. "
                f"{got[got != value][:3].tolist()})"
            )

    # 1. Inputs written by a slow kernel: the daemon must wait for the ready event; the call
    #    returns while the GPU is still busy (the host does not wait for the GPU); a kernel
    #    queued right after sees the result (the stream waits on the done event).
    warm = torch.ones(n, device=dev)
    dist.all_reduce(warm)  # the daemon compiles this kernel on first use: not in the timing
    x = torch.zeros(n, device=dev)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES * (1 + rank))  # ranks finish their inputs at different times
    x.fill_(rank + 1)
    start = time.monotonic()
    dist.all_reduce(x)
    out["host_wait_s"] = time.monotonic() - start
    out["gpu_busy_after_wait"] = not torch.cuda.current_stream().query()
    y = x * 2
    expect("kernel after all_reduce", y, 2 * total)
    expect("all_reduce after a slow producer", x, total)

    # 2. async_op on a side stream; wait() orders the current (default) stream after it.
    side = torch.cuda.Stream()
    z = torch.zeros(n, device=dev)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        z.fill_(rank + 1)
        work = dist.all_reduce(z, async_op=True)
    work.wait()
    expect("default stream after a side stream's async all_reduce", z + 0, total)

    # 3. Many ops in flight, then one wait each (events are reused from a pool).
    xs = [torch.full((4096 + i,), float(rank + 1), device=dev) for i in range(32)]
    works = [dist.all_reduce(t, async_op=True) for t in xs]
    for w in works:
        w.wait()
    for i, t in enumerate(xs):
        expect(f"async all_reduce #{i}", t, total)

    # 4. A long chain: each op's input is the previous op's output.
    c = torch.ones(1 << 16, device=dev)
    for _ in range(200):
        dist.all_reduce(c)
        c.div_(world)
    expect("200 chained all_reduces", c, 1.0)
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return out


# -- DDP ------------------------------------------------------------------------------------------


def _model() -> torch.nn.Module:
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )


def _batch(rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 16, generator=g)
    return x.to(device), x.sum(dim=1, keepdim=True).sin().to(device)


def ddp_rank(
    rank: int, world: int, init_file: str, devices: list[int], steps: int
) -> dict[str, Any]:
    """DDP(device_ids=[gpu]) training; returns its parameters and a reference computed by
    averaging every rank's gradients locally."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = init(rank, world, init_file, devices[rank])
    model = _model().to(dev)
    # Ranks start apart: DDP must broadcast rank 0's weights.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rank)
    ddp = DDP(model, device_ids=[devices[rank]] if devices[rank] >= 0 else None, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = _batch(rank, step, dev)
        opt.zero_grad()
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = [p.detach().cpu() for p in model.parameters()]

    ref = _model().to(dev)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        grads = None
        for r in range(world):
            ref.zero_grad()
            x, y = _batch(r, step, dev)
            F.mse_loss(ref(x), y).backward()
            g = [p.grad.detach().clone() for p in ref.parameters()]
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        for p, g in zip(ref.parameters(), grads):
            p.grad = g / world
        ref_opt.step()
    dist.destroy_process_group()
    return {
        "params": params,
        "reference": [p.detach().cpu() for p in ref.parameters()],
        "losses": losses,
    }


# -- a rank that dies ------------------------------------------------------------------------------


def dying_world_rank(
    rank: int, world: int, init_file: str, device: int, victim: int
) -> dict[str, Any]:
    """All_reduces (checked) in a loop; prints ``ready`` after the first. The test kills the
    victim; the others must see SmddpRankFailedError within seconds."""
    from smddp.backend.errors import SmddpBackendError

    dev = init(rank, world, init_file, device)
    print(f"pid {os.getpid()}", flush=True)
    total = float(sum(range(1, world + 1)))
    x = empty(8 << 20, torch.float32, dev)
    ops = 0
    try:
        while True:
            x.fill_(rank + 1)
            dist.all_reduce(x)
            if ops == 0:
                if not bool((x == total).all()):
                    raise AssertionError("wrong all_reduce result before the failure")
                print("ready", flush=True)
            ops += 1
            if rank == victim and ops > 5:
                time.sleep(0.001)
    except SmddpBackendError as exc:
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "failed_at": time.time(),
            "ops": ops,
        }


def after_death_rank(rank: int, world: int, init_file: str, device: int) -> list[str]:
    """A fresh job on the same daemon after another job's rank died: GPU ops still work."""
    dev = init(rank, world, init_file, device)
    check = Checker(rank)
    ins = [host_values(r, 1 << 20, torch.float32, salt=3) for r in range(world)]
    x = to_torch(ins[rank], dev)
    dist.all_reduce(x)
    check.same("all_reduce after another job's rank died", x, host_reduce(ins, pb.SUM))
    dist.destroy_process_group()
    return check.failures


# -- the fake GPU (tests/gpu/fake_device.py): no GPU needed -------------------------------------


def fake_gpu_rank(rank: int, world: int, init_file: str, sizes: list[int]) -> dict[str, Any]:
    """collectives_rank on the fake GPU, then what only the GPU path does: a Work's future
    before the reply, capture refused, a fence that cannot be queued failing the Work."""
    from smddp.backend.cuda import GpuWork, device_api

    failures = collectives_rank(rank, world, init_file, [FAKE] * world, sizes)
    fake = device_api()
    out: dict[str, Any] = {"failures": failures, "exports": fake.exports}
    out["done_waits"] = (fake.streams[0].recorded_waits, fake.streams[0].unrecorded_waits)
    # A second world on the same fake device and daemon, for the rest.
    init(rank, world, init_file + ".2", FAKE)
    check = Checker(rank)
    ins = [host_values(r, 4099, torch.float32, salt=9) for r in range(world)]
    x = to_torch(ins[rank], torch.device("cpu"))
    work = dist.all_reduce(x, async_op=True)
    out["work_type"] = type(work).__name__
    start = time.monotonic()
    fut = work.get_future()
    out["future_returned_s"] = time.monotonic() - start
    got = fut.wait()
    out["future_value_is_x"] = len(got) == 1 and got[0].data_ptr() == x.data_ptr()
    check.same("all_reduce through get_future()", x, host_reduce(ins, pb.SUM))
    # all_reduce_coalesced: several ops, one Work.
    ys = [
        to_torch(host_values(rank, 33 + k, torch.float32, salt=k), torch.device("cpu"))
        for k in range(3)
    ]
    dist.group.WORLD.allreduce_coalesced(ys).wait()
    for k, y in enumerate(ys):
        want = host_reduce(
            [host_values(r, 33 + k, torch.float32, salt=k) for r in range(world)], pb.SUM
        )
        check.same(f"all_reduce_coalesced[{k}]", y, want)
    # CUDA graph capture: refused, nothing sent.
    fake.capture = True
    try:
        dist.all_reduce(x)
        out["capture"] = "no error"
    except Exception as exc:
        out["capture"] = f"{type(exc).__name__}: {exc}"
    fake.capture = False
    # A done event the stream cannot wait on: the Work fails (host waited on done instead).
    fake.streams[0].fail_waits = True
    try:
        dist.all_reduce(x, async_op=True).wait()
        out["fence"] = "no error"
    except Exception as exc:
        out["fence"] = f"{type(exc).__name__}: {exc}"
    fake.streams[0].fail_waits = False
    out["is_gpu_work"] = isinstance(work, GpuWork)
    out["failures"] += check.failures
    dist.destroy_process_group()
    return out


def free_rank(rank: int, world: int, init_file: str) -> dict[str, Any]:
    """Close before free on the fake GPU: a tensor's allocation is freed (as empty_cache()
    does), and by the time the rank's next op has completed the daemon has unmapped it;
    the next op's own memory is still mapped and its result right."""
    init(rank, world, init_file, FAKE)
    out: dict[str, Any] = {}
    check = Checker(rank)
    x = to_torch(host_values(rank, 513, torch.float32), torch.device("cpu"))
    dist.all_reduce(x)
    y = to_torch(host_values(rank, 257, torch.float32, salt=1), torch.device("cpu"))
    dist.all_reduce(y)
    # x stays referenced: its fake memory keeps its address, so no new allocation lands
    # there and only the report of the free can make the daemon unmap it.
    path = _fake.free(x)
    out["closed_before"] = os.path.exists(path + ".closed")
    z = to_torch(host_values(rank, 129, torch.float32, salt=2), torch.device("cpu"))
    dist.all_reduce(z)
    out["closed_after"] = os.path.exists(path + ".closed")
    check.same(
        "all_reduce after a free",
        z,
        host_reduce([host_values(r, 129, torch.float32, salt=2) for r in range(world)], pb.SUM),
    )
    out["failures"] = check.failures
    dist.destroy_process_group()
    del x
    return out


def limits_rank(rank: int, world: int, init_file: str, device: int) -> dict[str, Any]:
    """What only a GPU shows of issue 17: capture refused with the message, and an int8
    all_reduce of 2^31 + 17 elements (64-bit indices, a scalar tail) exact at both ends."""
    dev = init(rank, world, init_file, device)
    out: dict[str, Any] = {}
    x = torch.ones(1024, device=dev)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            dist.all_reduce(x)
        out["capture"] = "no error"
    except Exception as exc:
        # Ending the capture may raise over ours: keep the whole chain.
        chain = []
        e: BaseException | None = exc
        while e is not None:
            chain.append(f"{type(e).__name__}: {e}")
            e = e.__context__
        out["capture"] = " <- ".join(chain)
    torch.cuda.synchronize()
    n = (1 << 31) + 17
    big = torch.full((n,), rank + 1, dtype=torch.int8, device=dev)
    start = time.monotonic()
    dist.all_reduce(big)
    torch.cuda.synchronize()
    out["big_s"] = time.monotonic() - start
    total = sum(range(1, world + 1))
    out["big_ok"] = bool((big == total).all()) and int(big[-1]) == total and int(big[0]) == total
    del big
    torch.cuda.empty_cache()
    dist.destroy_process_group()
    return out


def memory_rank(rank: int, world: int, init_file: str, device: int) -> dict[str, Any]:
    """Issue 17's memory lifetime on a real GPU, every rank on ``device``; sizes in bytes.

    1. Each rank all_reduces 1 GiB, ``del`` + ``empty_cache()`` (its segment goes back to the
       driver while the daemon has it mapped), then one small op (which tells the daemon of
       the free): the device's free memory is read after each step.
    2. A forced allocator retry, on rank 0: a 1 GiB tensor the daemon has mapped is deleted
       (cached by torch's allocator, not freed), ballast leaves 0.5 GiB free, and 1.25 GiB is
       asked for: cudaMalloc fails, the allocator frees its cached segments and retries,
       which succeeds only if the daemon's mapping no longer pins the freed segment: with
       close before free (backend/cuda_free_hook.py) the allocator's hook has smddpd unmap
       it inside the retry, before cudaFree.
    """
    dev = init(rank, world, init_file, device)
    gib = 1 << 30
    out: dict[str, Any] = {}

    def free_now() -> int:
        torch.cuda.synchronize()
        return int(torch.cuda.mem_get_info(dev)[0])

    small = torch.ones(1024, device=dev)
    dist.all_reduce(small)  # the daemon's context, streams and kernels exist from here on
    dist.barrier()
    out["base"] = free_now()
    dist.barrier()
    x = torch.ones(gib // 4, device=dev)
    dist.all_reduce(x)
    dist.barrier()
    out["held"] = free_now()
    dist.barrier()
    del x
    torch.cuda.empty_cache()
    dist.barrier()
    out["after_free"] = free_now()
    dist.barrier()
    dist.all_reduce(small)
    torch.cuda.synchronize()
    dist.barrier()
    time.sleep(0.2)  # the daemon closes the mapping once its stream has passed it
    out["after_next_op"] = free_now()
    dist.barrier()

    y = torch.ones(gib // 4, device=dev)
    dist.all_reduce(y)
    torch.cuda.synchronize()
    del y  # cached by the allocator; the daemon still has it mapped
    dist.barrier()
    if rank == 0:
        room = free_now() - gib // 2
        ballast = torch.empty(room - room % (2 << 20), dtype=torch.uint8, device=dev)
        out["ballast_free"] = free_now()
        try:
            z = torch.empty(gib + gib // 4, dtype=torch.uint8, device=dev)
            out["retry"] = "allocated"
            del z
        except torch.cuda.OutOfMemoryError as exc:
            out["retry"] = "OutOfMemoryError: " + str(exc).splitlines()[0][:200]
        del ballast
        torch.cuda.empty_cache()
    dist.barrier()
    dist.all_reduce(small)
    out["small_ok"] = bool((small == float(world) ** 3).all())  # three all_reduces of ones
    from smddp.backend import cuda_free_hook

    channel = cuda_free_hook.installed()
    out["hook"] = channel.stats() if channel is not None else None
    dist.destroy_process_group()
    return out


def free_hook_rank(
    rank: int, world: int, init_file: str, library: str, daemon_pid: int
) -> dict[str, Any]:
    """Close before free on the fake GPU, through the allocator hook's own entry point.

    The hook's C library (``backend/csrc/free_channel.cpp``, built by the test; torch's tracker part
    needs a CUDA torch) is installed on the rank's free channel. A mapped allocation's free
    is announced by the call the tracker makes (``smddp_fc_segment_free``): the daemon must
    have unmapped it when the call returns, and the next op on it maps it afresh with the
    right bits. Then, rank 0 only, a daemon that cannot answer (stopped with SIGSTOP): the
    call returns after the bound, with a log line, and the channel still works afterwards.
    """
    import ctypes
    import signal
    import tempfile

    import procstate

    from smddp.backend import cuda_free_hook

    init(rank, world, init_file, FAKE)
    out: dict[str, Any] = {}
    check = Checker(rank)
    x = to_torch(host_values(rank, 513, torch.float32), torch.device("cpu"))
    dist.all_reduce(x)  # the group's GPU path exists from here on, x's allocation is mapped
    check.same(
        "first all_reduce",
        x,
        host_reduce([host_values(r, 513, torch.float32) for r in range(world)], pb.SUM),
    )
    comm = dist.group.WORLD.comm  # the world is the SmddpProcessGroup itself
    channel = cuda_free_hook.install(
        comm.session, comm.cuda.exporter, comm.config, library=lambda: ctypes.CDLL(library)
    )
    out["installed"] = channel is not None
    (alloc,) = [a for a in _fake.allocations if a.base <= x.data_ptr() < a.base + a.size]
    out["watched"] = channel.stats()["watched"] if channel else 0
    opens_before = _count_lines(alloc.path + ".opens")
    code = channel.segment_free(alloc.base, alloc.size) if channel else -1
    out["code"] = code
    out["closed_at_return"] = os.path.exists(alloc.path + ".closed")
    # The allocation is still there (the fake never reuses it): an op on it maps it again.
    x.copy_(to_torch(host_values(rank, 513, torch.float32, salt=3), torch.device("cpu")))
    dist.all_reduce(x)
    out["reopened"] = _count_lines(alloc.path + ".opens") - opens_before
    check.same(
        "all_reduce after close before free",
        x,
        host_reduce([host_values(r, 513, torch.float32, salt=3) for r in range(world)], pb.SUM),
    )
    dist.barrier()
    if rank == 0 and channel is not None:
        with tempfile.TemporaryFile() as stderr:
            saved = os.dup(2)
            os.dup2(stderr.fileno(), 2)
            # Announced as exported again (a real free is followed by a new allocation,
            # which the exporter announces; this one was only announced freed).
            channel.watch(alloc.base)
            procstate.stop(daemon_pid)  # all its threads: kill() returns before they stop
            try:
                start = time.monotonic()
                out["stopped_code"] = channel.segment_free(alloc.base, alloc.size)
                out["stopped_s"] = time.monotonic() - start
            finally:
                os.kill(daemon_pid, signal.SIGCONT)
                os.dup2(saved, 2)
                os.close(saved)
            stderr.seek(0)
            out["stopped_log"] = stderr.read().decode(errors="replace")
        # The late answer to that request is dropped; the next one gets its own.
        channel.watch(alloc.base)
        out["after_code"] = channel.segment_free(alloc.base, alloc.size)
        out["stats"] = channel.stats()
    dist.barrier()
    out["failures"] = check.failures
    dist.destroy_process_group()
    return out


def _count_lines(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0
