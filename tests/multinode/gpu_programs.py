"""What the ranks of tests/multinode/test_multinode_gpu.py run (``rank_main.py gpu_collectives``).

Each rank's GPU is the fake one of tests/gpu/fake_device.py (SPEC's ``fake_gpu``: rank_main):
"GPU tensors" in host shared memory, exported over fake CUDA IPC to the node's real smddpd,
whose fake runtime runs the generated kernels. Every collective runs twice on the same
inputs, on CPU tensors (the host path across nodes) and on fake GPU tensors (the daemon's
GPU path across nodes: combined on the GPU, staged through pinned host memory, exchanged,
copied back); the GPU results must be the host path's bits. A failure is recorded, not
raised, so every rank keeps calling the same collectives.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from rank_main import Checks, Layout, bits, make, ops_for, split_size

DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}


class Both:
    """Makes an op's tensors on the CPU and on the fake GPU, from the same values."""

    def __init__(self, fake: Any) -> None:
        self.fake = fake

    def pair(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.clone(), self.fake.tensor(x)

    def pairs(self, xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [x.clone() for x in xs], [self.fake.tensor(x) for x in xs]


def _junk(dtype: torch.dtype, n: int) -> torch.Tensor:
    return make(dtype, n, "junk", "output")


def run_checks(c: Checks, lay: Layout, me: int, dtype: torch.dtype, n: int, fake: Any) -> None:
    """Every collective on ``n`` elements (blocks) of ``dtype``: GPU against host, bitwise."""
    w = lay.world
    both = Both(fake)

    def same(section: str, name: str, host: torch.Tensor, gpu: torch.Tensor) -> None:
        c.counts[section] += 1
        # As a host reading GPU memory must: after the stream (which waits on the daemon's
        # done events; the daemon's fake GPU runs its streams in order, later).
        fake.streams[0].synchronize(120.0)
        if bits(gpu) != bits(host):
            c.failures.append(f"{section} {dtype} n={n} {name}: the GPU path's bits differ")

    xs = [make(dtype, n, "gpu", r) for r in range(w)]
    for op in ops_for(dtype):
        h, g = both.pair(xs[me])
        for t in (h, g):
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        same("all_reduce", op, h, g)
    for root in (0, w - 1):  # on the first node and on the last
        h, g = both.pair(xs[me] if me == root else _junk(dtype, n))
        for t in (h, g):
            dist.broadcast(t, src=root)
        same("broadcast", f"root={root}", h, g)
        op = ops_for(dtype)[root % len(ops_for(dtype))]
        h, g = both.pair(xs[me])
        for t in (h, g):
            dist.reduce(t, dst=root, op=getattr(dist.ReduceOp, op))
        if me == root:
            same("reduce", f"{op} root={root}", h, g)
        hs, gs = both.pairs([_junk(dtype, n) for _ in range(w)] if me == root else [])
        src_h, src_g = both.pair(xs[me])
        dist.gather(src_h, hs if me == root else None, dst=root)
        dist.gather(src_g, gs if me == root else None, dst=root)
        for r, (a, b) in enumerate(zip(hs, gs)):
            same("gather", f"root={root} from {r}", a, b)
        pieces = [make(dtype, n, "scatter", root, d) for d in range(w)]
        ph, pg = both.pairs(pieces if me == root else [])
        h, g = both.pair(_junk(dtype, n))
        dist.scatter(h, ph if me == root else None, src=root)
        dist.scatter(g, pg if me == root else None, src=root)
        same("scatter", f"root={root}", h, g)
    hs, gs = both.pairs([_junk(dtype, n) for _ in range(w)])
    src_h, src_g = both.pair(xs[me])
    dist.all_gather(hs, src_h)
    dist.all_gather(gs, src_g)
    for r, (a, b) in enumerate(zip(hs, gs)):
        same("all_gather", f"from {r}", a, b)
    h, g = both.pair(_junk(dtype, w * n))
    dist.all_gather_into_tensor(h, src_h)
    dist.all_gather_into_tensor(g, src_g)
    same("all_gather", "into tensor", h, g)
    blocks = [make(dtype, n, "rs", me, d) for d in range(w)]
    for op in ops_for(dtype)[:3]:
        bh, bg = both.pairs(blocks)
        h, g = both.pair(_junk(dtype, n))
        dist.reduce_scatter(h, bh, op=getattr(dist.ReduceOp, op))
        dist.reduce_scatter(g, bg, op=getattr(dist.ReduceOp, op))
        same("reduce_scatter", op, h, g)
    # Uneven blocks (never empty: the fake device cannot tell an empty tensor's device).
    ins = [make(dtype, split_size(me, d, n) + 1, "a2a", me, d) for d in range(w)]
    ih, ig = both.pairs(ins)
    oh, og = both.pairs([_junk(dtype, split_size(s, me, n) + 1) for s in range(w)])
    dist.all_to_all(oh, ih)
    dist.all_to_all(og, ig)
    for s, (a, b) in enumerate(zip(oh, og)):
        same("all_to_all", f"from {s}", a, b)
    # send/recv around the ring (2 x 2: within each node and across nodes both ways), one
    # pair after another
    for k, (s, d) in enumerate([(r, (r + 1) % w) for r in range(w)]):
        if me == s:
            h, g = both.pair(make(dtype, n, "p2p", s, d, k))
            dist.send(h, dst=d)
            dist.send(g, dst=d)
        elif me == d:
            h, g = both.pair(_junk(dtype, n))
            dist.recv(h, src=s)
            dist.recv(g, src=s)
            same("send_recv", f"{s}->{d}", h, g)
            want = make(dtype, n, "p2p", s, d, k)
            c.true("send_recv", f"{dtype} n={n} {s}->{d} value", bits(h) == bits(want))
    dist.barrier()
    c.counts["barrier"] += 1


def gpu_collectives(spec: dict[str, Any]) -> dict[str, Any]:
    """Every collective, dtype (and reduce op) of ``spec`` on the default group."""
    from smddp.backend.cuda import device_api

    fake = device_api()
    assert hasattr(fake, "allocations"), "the backend did not take the fake device"
    me = dist.get_rank()
    lay = Layout("world", spec["node_of_rank"])
    c = Checks()
    started = time.monotonic()
    try:
        for name in spec["dtypes"]:
            for n in [spec["small"], *spec["chunked"].get(name, [])]:
                run_checks(c, lay, me, DTYPES[name], n, fake)
        # A large all_reduce and broadcast: many chunks of the daemon's staging.
        big: Callable[[], torch.Tensor] = lambda: make(torch.float32, spec["large"], "big", me)  # noqa: E731
        h, g = big(), fake.tensor(big())
        for t in (h, g):
            dist.all_reduce(t)
        fake.streams[0].synchronize(120.0)
        c.true("large", "all_reduce", bits(h) == bits(g), "the GPU path's bits differ")
        for t in (h, g):
            dist.broadcast(t, src=lay.world - 1)
        fake.streams[0].synchronize(120.0)
        c.true("large", "broadcast", bits(h) == bits(g), "the GPU path's bits differ")
    except Exception:
        c.failures.append(f"raised:\n{traceback.format_exc()}")
    report = c.report()
    report["exports"] = fake.exports
    report["done_waits"] = (fake.streams[0].recorded_waits, fake.streams[0].unrecorded_waits)
    report["total_s"] = time.monotonic() - started
    return report
