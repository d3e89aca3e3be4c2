"""What one rank of a multi-node test job runs: ``python rank_main.py PROGRAM SPEC OUT``.

The launcher (``conftest.World``) sets the ``env://`` variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) and the rank's node (SMDDP_NODE_ID, SMDDP_SOCKET); SPEC is a JSON
file that every rank reads, OUT the pickle this rank leaves its result in.

Programs:
- ``collectives``: every collective on the default group and on subgroups (each a layout of
  its own), against references computed here, independently of smddp. Inputs are deterministic
  functions of a key, so a rank rebuilds every other rank's
  input. Reductions follow smddp's documented order across nodes: each node's ranks in rank
  order, then the node partials in node order (nodes ordered by their lowest rank), in the
  tensor's dtype, so floating-point results are expected bit for bit. A failed check is
  recorded, not raised, so that every rank keeps calling the same collectives; results that
  every rank must hold are hashed, and the parent compares the hashes.
- ``ddp``: a few DDP steps of a small MLP; returns the final parameters.
- ``gpu_collectives``: every collective on fake GPU tensors against the host path
  (``gpu_programs``; SPEC's ``fake_gpu`` gives the backend the fake device).
- ``hold``: joins, runs a barrier, prints ``ready`` and waits for a line on stdin, so that
  the parent can look at the daemons while the job is registered.
- ``recv_any``: ``recv``/``irecv`` from any source, senders on the same node and on another.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
import time
import traceback
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

PG_TIMEOUT_S = 60.0
SMALL = 7  # not divisible by 2 or 3 nodes: the per-node segments of all_reduce are uneven
LARGE_BYTES = 1_300_000  # several chunks: with SMDDP_ARENA_BYTES=1048576 a chunk is at most 512 KiB
FLOAT_OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")
INT_OPS = ("SUM", "MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR")
BOOL_OPS = ("SUM", "MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR")
# smddp's bool semantics: SUM/MAX/BOR = or, PRODUCT/MIN/BAND = and, BXOR = xor.
_BOOL_FNS = {
    "SUM": torch.logical_or,
    "MAX": torch.logical_or,
    "BOR": torch.logical_or,
    "PRODUCT": torch.logical_and,
    "MIN": torch.logical_and,
    "BAND": torch.logical_and,
    "BXOR": torch.logical_xor,
}
_FNS = {
    "SUM": torch.add,
    "AVG": torch.add,
    "MIN": torch.minimum,
    "MAX": torch.maximum,
    "PRODUCT": torch.mul,
    "BAND": torch.bitwise_and,
    "BOR": torch.bitwise_or,
    "BXOR": torch.bitwise_xor,
}
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "bool": torch.bool,
}


def ops_for(dtype: torch.dtype) -> tuple[str, ...]:
    if dtype == torch.bool:
        return BOOL_OPS
    return FLOAT_OPS if dtype.is_floating_point else INT_OPS


def large_n(dtype: torch.dtype) -> int:
    """An odd element count of about LARGE_BYTES for ``dtype``."""
    return (LARGE_BYTES // torch.empty(0, dtype=dtype).element_size()) | 1


def make(dtype: torch.dtype, n: int | tuple[int, ...], *key: Any) -> torch.Tensor:
    """The same tensor in every process for the same key.

    Floats are normal draws times 4 kept away from zero (MIN/MAX never meet -0.0 and 0.0);
    integers span int64 (SUM and PRODUCT wrap around); bools are fair coins.
    """
    shape = (n,) if isinstance(n, int) else n
    g = torch.Generator().manual_seed(zlib.crc32(repr((str(dtype), shape, key)).encode()))
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g) * 4
        x[x.abs() < 0.01] = 0.5
        return x.to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-(2**62), 2**62, shape, generator=g, dtype=torch.int64).to(dtype)


def junk(dtype: torch.dtype, n: int | tuple[int, ...]) -> torch.Tensor:
    """An output buffer whose contents cannot pass for a result."""
    return make(dtype, n, "junk", os.getpid())


def fold(xs: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """``((x0 op x1) op x2) ...`` step by step in the inputs' dtype."""
    fn = _BOOL_FNS[op] if xs[0].dtype == torch.bool else _FNS[op]
    acc = xs[0].clone()
    for x in xs[1:]:
        acc = fn(acc, x)
    return acc


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class Layout:
    """A process group as the checks see it: which of its ranks run on which node, with
    nodes ordered by their lowest rank as smddp orders them.

    Attributes:
        name: the group's name in reports.
        pg: the process group (None for the default group).
        ranks: the global rank of each group rank.
        nodes: per node, its group ranks.
        world: the group's size.
    """

    def __init__(
        self,
        name: str,
        node_of_rank: Sequence[int],
        pg: Any = None,
        ranks: Sequence[int] | None = None,
    ) -> None:
        order: list[int] = []
        for node in node_of_rank:
            if node not in order:
                order.append(node)
        self.name = name
        self.pg = pg
        self.ranks = list(ranks) if ranks is not None else list(range(len(node_of_rank)))
        self.nodes = [[r for r, n in enumerate(node_of_rank) if n == node] for node in order]
        self.world = len(node_of_rank)

    def g(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` (torch's src/dst/peer arguments are global)."""
        return self.ranks[group_rank]

    def reduce(self, xs: Sequence[torch.Tensor], op: str) -> torch.Tensor:
        """The reference of a reduction over ranks: per node in rank order, then by node."""
        acc = fold([fold([xs[r] for r in ranks], op) for ranks in self.nodes], op)
        if op == "AVG":
            # Tensor by tensor, as smddp divides: no scalar fast path (multiply by 1/W).
            acc = torch.div(acc, torch.full_like(acc, self.world))
        return acc


class Checks:
    """Failures, counts and cross-rank hashes of one rank."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.counts: Counter[str] = Counter()
        self.hashes: dict[str, Any] = defaultdict(hashlib.sha256)
        self.seconds: Counter[str] = Counter()  # time spent per section, for slow-test hunting

    def equal(
        self,
        section: str,
        name: str,
        got: torch.Tensor,
        want: torch.Tensor,
        everywhere: bool = False,
    ) -> None:
        """Expects ``got`` to be ``want`` bit for bit; ``everywhere``: every rank holds it."""
        self.counts[section] += 1
        if got.dtype != want.dtype or got.shape != want.shape:
            self.failures.append(
                f"{section} {name}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} "
                f"{want.dtype}"
            )
        elif bits(got) != bits(want):
            g, w = got.reshape(-1), want.reshape(-1)
            wrong = (
                (g != w)
                if g.dtype == torch.bool
                else (g.view(torch.uint8) != w.view(torch.uint8)).reshape(g.numel(), -1).any(1)
            )
            idx = wrong.nonzero().reshape(-1)
            first = int(idx[0])
            self.failures.append(
                f"{section} {name}: {idx.numel()} of {g.numel()} elements differ, first [{first}]: "
                f"got {g[first].item()!r}, want {w[first].item()!r}"
            )
        if everywhere:
            self.hashes[section].update(bits(got))

    def true(self, section: str, name: str, ok: bool, detail: str = "") -> None:
        self.counts[section] += 1
        if not ok:
            self.failures.append(f"{section} {name}: {detail or 'failed'}")

    def report(self) -> dict[str, Any]:
        return {
            "failures": self.failures,
            "counts": dict(self.counts),
            "hashes": {k: h.hexdigest() for k, h in self.hashes.items()},
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
        }


# -- the collectives ---------------------------------------------------------------------------


def _op(name: str) -> dist.ReduceOp:
    return getattr(dist.ReduceOp, name)


def _roots(lay: Layout) -> list[int]:
    """Roots on the first, a middle and the last node: the first rank, a rank of another
    node than rank 0's, and the last rank."""
    return sorted({0, lay.nodes[len(lay.nodes) // 2][-1], lay.world - 1})


def check_all_reduce(c: Checks, lay: Layout, me: int, dtype: torch.dtype, n: int) -> None:
    xs = [make(dtype, n, "all_reduce", r) for r in range(lay.world)]
    for op in ops_for(dtype):
        t = xs[me].clone()
        dist.all_reduce(t, op=_op(op), group=lay.pg)
        c.equal("all_reduce", f"{dtype} n={n} {op}", t, lay.reduce(xs, op), everywhere=True)


def check_broadcast(c: Checks, lay: Layout, me: int, dtype: torch.dtype, n: int) -> None:
    for root in _roots(lay):
        src = make(dtype, n, "broadcast", root)
        t = src.clone() if me == root else junk(dtype, n)
        dist.broadcast(t, src=lay.g(root), group=lay.pg)
        c.equal("broadcast", f"{dtype} n={n} root={root}", t, src, everywhere=True)


def check_reduce(c: Checks, lay: Layout, me: int, dtype: torch.dtype, n: int) -> None:
    xs = [make(dtype, n, "reduce", r) for r in range(lay.world)]
    roots = _roots(lay)
    plan = [(root, "SUM") for root in roots] + [
        (roots[i % len(roots)], op) for i, op in enumerate(ops_for(dtype)[1:])
    ]
    for root, op in plan:
        t = xs[me].clone()
        dist.reduce(t, dst=lay.g(root), op=_op(op), group=lay.pg)
        if me == root:
            c.equal("reduce", f"{dtype} n={n} {op} root={root}", t, lay.reduce(xs, op))


def check_all_gather(c: Checks, lay: Layout, me: int, dtype: torch.dtype, n: int) -> None:
    w = lay.world
    xs = [make(dtype, n, "all_gather", r) for r in range(w)]
    outs = [junk(dtype, n) for _ in range(w)]
    dist.all_gather(outs, xs[me], group=lay.pg)
    for r in range(w):
        c.equal("all_gather", f"{dtype} n={n} list, from rank {r}", outs[r], xs[r], everywhere=True)
    flat = junk(dtype, w * n)
    dist.all_gather_into_tensor(flat, xs[me], group=lay.pg)
    c.equal("all_gather", f"{dtype} n={n} into tensor [W*n]", flat, torch.cat(xs), everywhere=True)
    stacked = junk(dtype, (w, n))
    dist.all_gather_into_tensor(stacked, xs[me], group=lay.pg)
    c.equal(
        "all_gather", f"{dtype} n={n} into tensor [W, n]", stacked, torch.stack(xs), everywhere=True
    )


def check_reduce_scatter(c: Checks, lay: Layout, me: int, dtype: torch.dtype, n: int) -> None:
    w = lay.world
    pieces = [[make(dtype, n, "reduce_scatter", r, d) for d in range(w)] for r in range(w)]
    flats = [make(dtype, w * n, "reduce_scatter_tensor", r) for r in range(w)]
    for op in ops_for(dtype):
        out = junk(dtype, n)
        dist.reduce_scatter(out, pieces[me], op=_op(op), group=lay.pg)
        c.equal(
            "reduce_scatter",
            f"{dtype} n={n} list {op}",
            out,
            lay.reduce([p[me] for p in pieces], op),
        )
        out = junk(dtype, n)
        dist.reduce_scatter_tensor(out, flats[me], op=_op(op), group=lay.pg)
        want = lay.reduce([x[me * n : (me + 1) * n] for x in flats], op)
        c.equal("reduce_scatter", f"{dtype} n={n} tensor {op}", out, want)


def split_size(src: int, dst: int, n: int) -> int:
    """Uneven all_to_all blocks: 0..n elements, some 0 (rank 0 to rank 1 always is)."""
    return ((src * 5 + dst * 3 + 4) % 7) * n // 6


def check_all_to_all(c: Checks, lay: Layout, me: int, dtype: torch.dtype, n: int) -> None:
    w = lay.world
    ins = [make(dtype, split_size(me, d, n), "a2a", me, d) for d in range(w)]
    outs = [junk(dtype, split_size(s, me, n)) for s in range(w)]
    dist.all_to_all(outs, ins, group=lay.pg)
    for s in range(w):
        c.equal(
            "all_to_all",
            f"{dtype} n={n} list uneven, from rank {s}",
            outs[s],
            make(dtype, split_size(s, me, n), "a2a", s, me),
        )
    # single, even splits
    xs = [make(dtype, w * n, "a2a_single", s) for s in range(w)]
    out = junk(dtype, w * n)
    dist.all_to_all_single(out, xs[me], group=lay.pg)
    c.equal(
        "all_to_all",
        f"{dtype} n={n} single even",
        out,
        torch.cat([x[me * n : (me + 1) * n] for x in xs]),
    )
    # single, uneven splits
    sent = [[split_size(s, d, n) for d in range(w)] for s in range(w)]
    xs = [make(dtype, sum(sent[s]), "a2a_uneven", s) for s in range(w)]
    out = junk(dtype, sum(sent[s][me] for s in range(w)))
    dist.all_to_all_single(
        out,
        xs[me],
        output_split_sizes=[sent[s][me] for s in range(w)],
        input_split_sizes=sent[me],
        group=lay.pg,
    )
    want = torch.cat([xs[s][sum(sent[s][:me]) : sum(sent[s][: me + 1])] for s in range(w)])
    c.equal("all_to_all", f"{dtype} n={n} single uneven", out, want)


def check_gather_scatter(c: Checks, lay: Layout, me: int, dtype: torch.dtype, n: int) -> None:
    w = lay.world
    xs = [make(dtype, n, "gather", r) for r in range(w)]
    for root in _roots(lay):
        outs = [junk(dtype, n) for _ in range(w)] if me == root else None
        dist.gather(xs[me], outs, dst=lay.g(root), group=lay.pg)
        if outs is not None:
            for r in range(w):
                c.equal("gather", f"{dtype} n={n} root={root} from rank {r}", outs[r], xs[r])
        pieces = [make(dtype, n, "scatter", root, d) for d in range(w)]
        out = junk(dtype, n)
        dist.scatter(out, pieces if me == root else None, src=lay.g(root), group=lay.pg)
        c.equal("scatter", f"{dtype} n={n} root={root}", out, pieces[me])


def p2p_pairs(lay: Layout) -> list[tuple[int, int]]:
    """(src, dst) pairs in one global order: every pair for small worlds, else the ring both
    ways plus one pair between the first and the last node; within and across nodes."""
    w = lay.world
    if w <= 4:
        return [(s, d) for s in range(w) for d in range(w) if s != d]
    ring = [(s, (s + 1) % w) for s in range(w)] + [(s, (s - 1) % w) for s in range(w)]
    return ring + [(lay.nodes[0][0], lay.nodes[-1][-1])]


def check_send_recv(c: Checks, lay: Layout, me: int, dtype: torch.dtype, n: int) -> None:
    node_of = {r: i for i, ranks in enumerate(lay.nodes) for r in ranks}
    # Pairs one after another in the same order on every rank: the earliest pair not yet
    # done always has both its ranks at it, so this cannot deadlock.
    for k, (s, d) in enumerate(p2p_pairs(lay)):
        where = "within a node" if node_of[s] == node_of[d] else "across nodes"
        if me == s:
            dist.send(make(dtype, n, "p2p", s, d, k), dst=lay.g(d), group=lay.pg)
        elif me == d:
            out = junk(dtype, n)
            dist.recv(out, src=lay.g(s), group=lay.pg)
            c.equal(
                "send_recv",
                f"{dtype} n={n} {s}->{d} ({where})",
                out,
                make(dtype, n, "p2p", s, d, k),
            )


def check_batch_isend_irecv(c: Checks, lay: Layout, me: int, dtype: torch.dtype, n: int) -> None:
    w = lay.world
    nxt, prv = (me + 1) % w, (me - 1) % w
    send_to = sorted({nxt, prv})  # the ring both ways; for W = 2 both are the one peer
    outs = {p: junk(dtype, n) for p in send_to}
    ops = []
    for p in send_to:
        ops.append(dist.P2POp(dist.isend, make(dtype, n, "batch", me, p), lay.g(p), lay.pg))
        ops.append(dist.P2POp(dist.irecv, outs[p], lay.g(p), lay.pg))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for p in send_to:
        c.equal(
            "batch_isend_irecv",
            f"{dtype} n={n} from rank {p}",
            outs[p],
            make(dtype, n, "batch", p, me),
        )


def check_barrier(c: Checks, lay: Layout, me: int, folder: str) -> None:
    """Each rank leaves a file (the last rank late); after the barrier every file exists."""
    for i in range(3):
        if me == lay.world - 1:
            time.sleep(0.1)
        open(os.path.join(folder, f"{lay.name}-b{i}-{me}"), "w").close()
        dist.barrier(group=lay.pg)
        missing = [
            r
            for r in range(lay.world)
            if not os.path.exists(os.path.join(folder, f"{lay.name}-b{i}-{r}"))
        ]
        c.true("barrier", f"barrier {i}", not missing, f"left before ranks {missing} arrived")


Check = Callable[[Checks, Layout, int, torch.dtype, int], None]
CHECKS: dict[str, Check] = {
    "all_reduce": check_all_reduce,
    "broadcast": check_broadcast,
    "reduce": check_reduce,
    "all_gather": check_all_gather,
    "reduce_scatter": check_reduce_scatter,
    "all_to_all": check_all_to_all,
    "gather_scatter": check_gather_scatter,
    "send_recv": check_send_recv,
    "batch_isend_irecv": check_batch_isend_irecv,
}
# Ops that move W pieces per rank: their large case uses pieces of LARGE_BYTES / W, so the
# W-piece buffer crosses chunks; float32 only, to keep the matrix quick (all_reduce, broadcast,
# reduce and the point-to-point ops cross chunks in every dtype).
_WIDE = {"all_gather", "reduce_scatter", "all_to_all", "gather_scatter"}


def collectives(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs the checks on every group of ``spec["groups"]``, one after another.

    ``spec``: ``groups`` ([name, global ranks or None for the default group], ...),
    ``node_of_rank`` (the node of each global rank), ``dtypes``, ``large`` (also sizes that
    cross chunks), ``barrier_dir``.

    Returns:
        {group name: report} for the groups this rank belongs to. An op that raises ends
        that group's checks with the traceback as a failure; the next group still runs.
    """
    me = dist.get_rank()
    node_of = spec["node_of_rank"]
    layouts = []
    for name, ranks in spec["groups"]:
        if ranks is None:
            layouts.append(Layout(name, node_of))
        else:  # every rank creates every group, in the same order
            pg = dist.new_group(ranks)
            layouts.append(Layout(name, [node_of[r] for r in ranks], pg, ranks))
    reports = {}
    for lay in layouts:
        if me in lay.ranks:
            reports[lay.name] = check_group(spec, lay, lay.ranks.index(me))
    return reports


def check_group(spec: dict[str, Any], lay: Layout, me: int) -> dict[str, Any]:
    """Every check on one group; ``me`` is this rank's rank in it."""
    c = Checks()
    started = time.monotonic()
    try:
        for name in spec["dtypes"]:
            dtype = DTYPES[name]
            for section, fn in CHECKS.items():
                t0 = time.monotonic()
                fn(c, lay, me, dtype, SMALL)
                if spec["large"] and (section not in _WIDE or dtype == torch.float32):
                    n = (
                        large_n(dtype)
                        if section not in _WIDE
                        else (large_n(dtype) // lay.world) | 1
                    )
                    fn(c, lay, me, dtype, n)
                c.seconds[section] += time.monotonic() - t0
        check_barrier(c, lay, me, spec["barrier_dir"])
    except Exception:  # the group's communicator failed: say so, go on with the next group
        c.failures.append(f"raised:\n{traceback.format_exc()}")
    report = c.report()
    report["total_s"] = time.monotonic() - started
    return report


def ddp(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec["steps"]`` DDP steps of a small MLP, each rank on its own data; small buckets so
    that several all_reduces run per step. Returns the final parameters and losses."""
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    torch.manual_seed(1000 + rank)  # ranks start apart; DDP broadcasts rank 0's weights
    model = nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )
    net = DDP(model, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(7 + rank)
    losses = []
    for _ in range(spec["steps"]):
        x = torch.randn(32, 16, generator=data)
        y = x.sum(dim=1, keepdim=True).sin()
        opt.zero_grad()
        loss = F.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"params": [p.detach().clone() for p in model.parameters()], "losses": losses}


def hold(spec: dict[str, Any]) -> dict[str, Any]:
    """Stays registered until the parent writes a line to stdin."""
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.barrier()
    print("ready", flush=True)
    sys.stdin.readline()
    dist.barrier()
    return {"sum": t.tolist()}


def _message(sender: int, k: int, n: int) -> torch.Tensor:
    """Message #k of ``sender``, ``n`` elements whose values say both."""
    return torch.arange(n, dtype=torch.float32) + (1000.0 * sender + 100_000.0 * k)


def _origin(t: torch.Tensor) -> tuple[int, int]:
    """The (sender, k) of a tensor filled by ``_message``, or (-1, -1) if it is not one."""
    k, rest = divmod(float(t[0]), 100_000.0)
    sender = int(rest // 1000.0)
    if not torch.equal(t, _message(sender, int(k), t.numel())):
        return -1, -1
    return sender, int(k)


def recv_any(spec: dict[str, Any]) -> dict[str, Any]:
    """``recv``/``irecv`` with no source, on 3 ranks: 0 and 1 on one node, 2 on another.

    Returns what each receive got, as (reported sender, (sender, k) read from the values):
    - ``race``: ranks 1 (same node) and 2 (other node) each send ``spec["race"]`` messages
      to rank 0 at once; rank 0 receives them all from any source, recv and irecv in turn;
    - ``tags``: rank 2's tag-5 send and rank 1's tag-7 send both wait before rank 0's
      receives with tag 7, then tag 5;
    - ``posted``: rank 0's irecv waits at its daemon before rank 2 sends, a message of
      several chunks (``spec["big"]`` elements);
    - ``remote_receiver``: rank 2 receives from ranks 0 and 1, both on the other node;
    - ``mismatch``: on the group [0, 2], rank 2 sends 5 elements and rank 0 receives 7 from
      any source: rank 0's error.
    """
    me = dist.get_rank()
    got: dict[str, Any] = {}
    n, big, race = 16, spec["big"], spec["race"]

    def take(key: str, out: torch.Tensor, work: Any = None) -> None:
        if work is None:
            src = dist.recv(out)
        else:
            work.wait()
            src = work._source_rank()
        got.setdefault(key, []).append((src, _origin(out)))

    dist.barrier()
    if me == 0:
        for i in range(2 * race):
            out = torch.full((n,), -7.0)
            take("race", out, dist.irecv(out) if i % 2 else None)
    else:
        for w in [dist.isend(_message(me, k, n), dst=0) for k in range(race)]:
            w.wait()
    dist.barrier()
    sends = []
    if me in (1, 2):
        sends.append(dist.isend(_message(me, 10, n), dst=0, tag=7 if me == 1 else 5))
    dist.barrier()
    if me == 0:
        for tag in (7, 5):
            out = torch.full((n,), -7.0)
            src = dist.recv(out, tag=tag)
            got.setdefault("tags", []).append((src, _origin(out)))
    for w in sends:
        w.wait()
    if me == 0:
        out = torch.full((big,), -7.0)
        work = dist.irecv(out)
        dist.barrier()
        take("posted", out, work)
    else:
        dist.barrier()
        if me == 2:
            dist.send(_message(2, 20, big), dst=0)
    if me == 2:
        for _ in range(2):
            out = torch.full((n,), -7.0)
            take("remote_receiver", out)
    else:
        dist.send(_message(me, 30, n), dst=2)
    dist.barrier()
    pair = dist.new_group([0, 2])
    if me == 0:
        try:
            dist.recv(torch.zeros(7), group=pair)
        except Exception as exc:
            got["mismatch"] = f"{type(exc).__name__}: {exc}"
    elif me == 2:
        dist.send(torch.ones(5), dst=0, group=pair)
    dist.barrier()  # the default group goes on
    return got


def gpu_collectives(spec: dict[str, Any]) -> dict[str, Any]:
    """Every collective on the fake GPU against the host path (``gpu_programs``)."""
    import gpu_programs

    return gpu_programs.gpu_collectives(spec)


PROGRAMS = {
    "collectives": collectives,
    "ddp": ddp,
    "hold": hold,
    "gpu_collectives": gpu_collectives,
    "recv_any": recv_any,
}


def main() -> None:
    program, spec_path, out_path = sys.argv[1:4]
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        import smddp  # noqa: F401  (registers the backend)

        if spec.get("fake_gpu"):
            # The rank's "GPU" is tests/gpu/fake_device.py's, given to the backend before
            # the process's first device call.
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
            import fake_device

            from smddp.backend.cuda import use_device

            use_device(fake_device.get())
        torch.set_num_threads(1)  # many ranks share two cores
        t0 = time.monotonic()
        dist.init_process_group(
            spec.get("backend", "smddp"),
            timeout=timedelta(seconds=spec.get("pg_timeout_s", PG_TIMEOUT_S)),
        )
        t1 = time.monotonic()
        result = PROGRAMS[program](spec)
        print(
            f"rank {dist.get_rank()}: joined in {t1 - t0:.1f} s, {program} took "
            f"{time.monotonic() - t1:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        dist.destroy_process_group()
    except BaseException:  # the parent must see every failure
        with open(out_path, "wb") as f:
            pickle.dump({"error": traceback.format_exc()}, f)
        sys.exit(1)
    with open(out_path, "wb") as f:
        pickle.dump({"result": result}, f)


if __name__ == "__main__":
    main()
