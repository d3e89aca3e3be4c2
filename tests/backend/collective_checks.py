"""What each rank runs in the collective tests: inputs, references and checks.

Every input is a deterministic function of a key (op, dtype, size, source rank...), so a rank
can rebuild every other rank's input and compute the reference itself, independently of
smddp: reductions go in rank order ``((x0 op x1) op x2) ...`` in the tensor's dtype, so
floating-point results are expected bit for bit. A check that fails is recorded, not raised,
so that every rank keeps calling the same collectives in the same order; the parent test
reports the failures per section. Results that must be identical on every rank are also
hashed per section and group, and the parent compares the hashes across ranks.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
)
FLOAT_OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")
INTEGER_OPS = ("SUM", "MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR")
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

SMALL = 7
CHUNKED_ARENA_BYTES = 1 << 20  # the daemon's chunk becomes a quarter: 256 KiB
CHUNKED_ELEMENTWISE_BYTES = 400_000  # two chunks for every op on such a group
DEFAULT_CHUNK_BYTES = 4 << 20
BARRIER_DIR_ENV = "SMDDP_TEST_BARRIER_DIR"
# new_group does not inherit init_process_group's timeout; a stuck op must fail, not hang.
PG_TIMEOUT = timedelta(seconds=60)

# Sections: the parent test reports each one separately.
COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "barrier",
    "send_recv",
    "batch_isend_irecv",
    "objects",
)
P2P_SECTIONS = ("send_recv", "batch_isend_irecv")
EXTRA_SECTIONS = ("async", "noncontiguous", "arena_wraparound", "sparse")


def ops_for(dtype: torch.dtype) -> tuple[str, ...]:
    """The reduce ops smddp defines for ``dtype``."""
    return FLOAT_OPS if dtype.is_floating_point else INTEGER_OPS


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make(dtype: torch.dtype, shape: int | tuple[int, ...], *key: Any) -> torch.Tensor:
    """A deterministic tensor for ``key``: the same bits in every process.

    Floats are normal draws times 4 with no values near zero (so MIN/MAX never meet -0.0
    against 0.0); integers cover the dtype's whole range (so SUM and PRODUCT wrap around).
    """
    shape = (shape,) if isinstance(shape, int) else shape
    g = torch.Generator().manual_seed(zlib.crc32(repr((dtype_name(dtype), shape, key)).encode()))
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g, dtype=torch.float32)
        x.add_(torch.sign(x), alpha=0.02).mul_(4)  # |x| >= 0.08
        return x.to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).view(torch.bool)
    info = torch.iinfo(dtype)
    lo, hi = (-(2**62), 2**62) if dtype == torch.int64 else (info.min, info.max + 1)
    return torch.randint(lo, hi, shape, generator=g, dtype=dtype)


def junk(dtype: torch.dtype, shape: int | tuple[int, ...]) -> torch.Tensor:
    """An output buffer whose old contents cannot pass for a result: every byte 0xA5."""
    t = torch.empty(shape, dtype=dtype)
    t.view(-1).view(torch.uint8).fill_(0xA5)
    return t


def reduce_ref(xs: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """``((x0 op x1) op x2) ...`` step by step in the inputs' dtype; AVG divides that by W."""
    dtype = xs[0].dtype
    fn = _BOOL_FNS[op] if dtype == torch.bool else _FNS[op]
    acc = xs[0].clone()
    for x in xs[1:]:
        acc = fn(acc, x)
    if op == "AVG":
        # Tensor by tensor, so that no scalar fast path (multiply by 1/W) is taken.
        acc = torch.div(acc, torch.full_like(acc, len(xs)))
    return acc


def bits(t: torch.Tensor) -> bytes:
    """The tensor's bytes in logical (row-major) order."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _diff(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"got {tuple(got.shape)} x {got.dtype}, expected {tuple(want.shape)} x {want.dtype}"
    g = got.detach().contiguous().reshape(-1)
    w = want.detach().contiguous().reshape(-1)
    wrong = (g.view(torch.uint8) != w.view(torch.uint8)) if g.dtype == torch.bool else None
    if wrong is None:
        size = g.element_size()
        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
        wrong = g.view(as_int) != w.view(as_int)
    idx = wrong.nonzero().reshape(-1)
    first = int(idx[0])
    return (
        f"{idx.numel()} of {g.numel()} elements differ; first at [{first}]: "
        f"got {g[first].item()!r}, expected {w[first].item()!r}"
    )


@dataclass
class Group:
    """A process group as the checks see it: its handle, this rank's place, its members."""

    name: str
    pg: Any  # None for the default group
    ranks: list[int]  # global ranks, in group-rank order

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def me(self) -> int:
        return dist.get_rank(self.pg)

    def glob(self, group_rank: int) -> int:
        return self.ranks[group_rank]


@dataclass
class Checks:
    """Failures, check counts and cross-rank hashes, by section."""

    rank: int
    failures: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    counts: Counter = field(default_factory=Counter)
    hashes: dict[str, Any] = field(default_factory=dict)

    def equal(self, section: str, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        """Expects ``got`` to be ``want`` bit for bit (same dtype and shape)."""
        self.counts[section] += 1
        if got.dtype != want.dtype or got.shape != want.shape or bits(got) != bits(want):
            self.failures[section].append(f"{name}: {_diff(got, want)}")

    def true(self, section: str, name: str, ok: bool, detail: str = "") -> None:
        """Expects ``ok``."""
        self.counts[section] += 1
        if not ok:
            self.failures[section].append(f"{name}: {detail or 'failed'}")

    def same_everywhere(self, section: str, group: Group, data: torch.Tensor | bytes) -> None:
        """Adds a result that every rank of ``group`` must hold bit for bit."""
        h = self.hashes.setdefault(f"{section}@{group.name}", hashlib.sha256())
        h.update(data if isinstance(data, bytes) else bits(data))

    def report(self) -> dict[str, Any]:
        """A picklable summary for the parent."""
        return {
            "failures": {k: list(v) for k, v in self.failures.items() if v},
            "counts": dict(self.counts),
            "hashes": {k: h.hexdigest() for k, h in self.hashes.items()},
        }


class Inputs:
    """Deterministic inputs keyed by (tag, what, dtype, n, ...), built once per process."""

    def __init__(self) -> None:
        self._cache: dict[tuple, torch.Tensor] = {}

    def get(self, dtype: torch.dtype, n: int | tuple[int, ...], *key: Any) -> torch.Tensor:
        k = (dtype, n, *key)
        t = self._cache.get(k)
        if t is None:
            t = self._cache[k] = make(dtype, n, *key)
        return t

    def clear(self) -> None:
        self._cache.clear()


# -- the collectives, one function each: (checks, inputs, group, dtype, n, tag) --------------


def _op(name: str) -> dist.ReduceOp:
    return getattr(dist.ReduceOp, name)


def check_all_reduce(
    c: Checks, inp: Inputs, g: Group, dtype: torch.dtype, n: int, tag: str
) -> None:
    xs = [inp.get(dtype, n, tag, "all_reduce", r) for r in range(g.size)]
    for op in ops_for(dtype):
        t = xs[g.me].clone()
        dist.all_reduce(t, op=_op(op), group=g.pg)
        c.equal("all_reduce", f"{tag} {dtype_name(dtype)} n={n} {op}", t, reduce_ref(xs, op))
        c.same_everywhere("all_reduce", g, t)


def check_broadcast(c: Checks, inp: Inputs, g: Group, dtype: torch.dtype, n: int, tag: str) -> None:
    for root in range(g.size):
        src = inp.get(dtype, n, tag, "broadcast", root)
        t = src.clone() if g.me == root else junk(dtype, n)
        dist.broadcast(t, src=g.glob(root), group=g.pg)
        c.equal("broadcast", f"{tag} {dtype_name(dtype)} n={n} root={root}", t, src)
        c.same_everywhere("broadcast", g, t)


def check_reduce(c: Checks, inp: Inputs, g: Group, dtype: torch.dtype, n: int, tag: str) -> None:
    xs = [inp.get(dtype, n, tag, "reduce", r) for r in range(g.size)]
    plan = [(root, "SUM") for root in range(g.size)]
    plan += [(i % g.size, op) for i, op in enumerate(ops_for(dtype)) if op != "SUM"]
    for root, op in plan:
        t = xs[g.me].clone()
        dist.reduce(t, dst=g.glob(root), op=_op(op), group=g.pg)
        if g.me == root:
            c.equal(
                "reduce", f"{tag} {dtype_name(dtype)} n={n} {op} root={root}", t, reduce_ref(xs, op)
            )


def check_all_gather(
    c: Checks, inp: Inputs, g: Group, dtype: torch.dtype, n: int, tag: str
) -> None:
    xs = [inp.get(dtype, n, tag, "all_gather", r) for r in range(g.size)]
    outs = [junk(dtype, n) for _ in range(g.size)]
    dist.all_gather(outs, xs[g.me], group=g.pg)
    for r in range(g.size):
        c.equal("all_gather", f"{tag} {dtype_name(dtype)} n={n} from rank {r}", outs[r], xs[r])
        c.same_everywhere("all_gather", g, outs[r])


def check_all_gather_into_tensor(
    c: Checks, inp: Inputs, g: Group, dtype: torch.dtype, n: int, tag: str
) -> None:
    xs = [inp.get(dtype, n, tag, "all_gather_into_tensor", r) for r in range(g.size)]
    name = f"{tag} {dtype_name(dtype)} n={n}"
    flat = junk(dtype, g.size * n)
    dist.all_gather_into_tensor(flat, xs[g.me], group=g.pg)
    c.equal("all_gather_into_tensor", f"{name} concatenated [W*n]", flat, torch.cat(xs))
    stacked = junk(dtype, (g.size, n))
    dist.all_gather_into_tensor(stacked, xs[g.me], group=g.pg)
    c.equal("all_gather_into_tensor", f"{name} stacked [W, n]", stacked, torch.stack(xs))
    c.same_everywhere("all_gather_into_tensor", g, flat)
    c.same_everywhere("all_gather_into_tensor", g, stacked)


def check_reduce_scatter(
    c: Checks, inp: Inputs, g: Group, dtype: torch.dtype, n: int, tag: str
) -> None:
    w = g.size
    pieces = [[inp.get(dtype, n, tag, "reduce_scatter", r, d) for d in range(w)] for r in range(w)]
    for op in ops_for(dtype):
        out = junk(dtype, n)
        dist.reduce_scatter(out, pieces[g.me], op=_op(op), group=g.pg)
        want = reduce_ref([pieces[r][g.me] for r in range(w)], op)
        c.equal("reduce_scatter", f"{tag} {dtype_name(dtype)} n={n} {op}", out, want)


def check_reduce_scatter_tensor(
    c: Checks, inp: Inputs, g: Group, dtype: torch.dtype, n: int, tag: str
) -> None:
    w, me = g.size, g.me
    xs = [inp.get(dtype, w * n, tag, "reduce_scatter_tensor", r) for r in range(w)]
    for op in ops_for(dtype):
        out = junk(dtype, n)
        dist.reduce_scatter_tensor(out, xs[me], op=_op(op), group=g.pg)
        want = reduce_ref([x[me * n : (me + 1) * n] for x in xs], op)
        c.equal("reduce_scatter_tensor", f"{tag} {dtype_name(dtype)} n={n} {op}", out, want)
    # The input may also be stacked [W, n].
    out = junk(dtype, n)
    dist.reduce_scatter_tensor(out, xs[me].reshape(w, n), group=g.pg)
    want = reduce_ref([x[me * n : (me + 1) * n] for x in xs], "SUM")
    c.equal(
        "reduce_scatter_tensor", f"{tag} {dtype_name(dtype)} n={n} SUM, input [W, n]", out, want
    )


def split_size(src: int, dst: int, n: int) -> int:
    """Uneven block sizes for all_to_all: 0..n elements, some of them 0 when W >= 3."""
    return ((src * 5 + dst * 3 + 1) % 7) * n // 6


def check_all_to_all(
    c: Checks, inp: Inputs, g: Group, dtype: torch.dtype, n: int, tag: str
) -> None:
    w, me = g.size, g.me
    ins = [inp.get(dtype, split_size(me, d, n), tag, "all_to_all", me, d) for d in range(w)]
    outs = [junk(dtype, split_size(s, me, n)) for s in range(w)]
    dist.all_to_all(outs, ins, group=g.pg)
    for s in range(w):
        want = inp.get(dtype, split_size(s, me, n), tag, "all_to_all", s, me)
        c.equal(
            "all_to_all", f"{tag} {dtype_name(dtype)} uneven, block from rank {s}", outs[s], want
        )


def check_all_to_all_single(
    c: Checks, inp: Inputs, g: Group, dtype: torch.dtype, n: int, tag: str
) -> None:
    w, me = g.size, g.me
    section = "all_to_all_single"
    name = f"{tag} {dtype_name(dtype)} n={n}"
    # Even splits.
    xs = [inp.get(dtype, w * n, tag, section, "even", s) for s in range(w)]
    out = junk(dtype, w * n)
    dist.all_to_all_single(out, xs[me], group=g.pg)
    c.equal(section, f"{name} even", out, torch.cat([x[me * n : (me + 1) * n] for x in xs]))
    # Uneven splits, 1-D and 2-D (split along dim 0).
    for cols in (None, 3):

        def shape(rows: int, cols: int | None = cols) -> int | tuple[int, int]:
            return rows if cols is None else (rows, cols)

        sent = [[split_size(s, d, n) for d in range(w)] for s in range(w)]
        xs = [
            inp.get(dtype, shape(sum(sent[s])), tag, section, "uneven", cols, s) for s in range(w)
        ]
        out = junk(dtype, shape(sum(sent[s][me] for s in range(w))))
        dist.all_to_all_single(
            out,
            xs[me],
            output_split_sizes=[sent[s][me] for s in range(w)],
            input_split_sizes=sent[me],
            group=g.pg,
        )
        want = torch.cat([xs[s][sum(sent[s][:me]) : sum(sent[s][: me + 1])] for s in range(w)])
        c.equal(section, f"{name} uneven {'1-D' if cols is None else '2-D'}", out, want)


def check_gather(c: Checks, inp: Inputs, g: Group, dtype: torch.dtype, n: int, tag: str) -> None:
    xs = [inp.get(dtype, n, tag, "gather", r) for r in range(g.size)]
    for root in range(g.size):
        outs = [junk(dtype, n) for _ in range(g.size)] if g.me == root else None
        dist.gather(xs[g.me], outs, dst=g.glob(root), group=g.pg)
        if outs is not None:
            for r in range(g.size):
                c.equal(
                    "gather",
                    f"{tag} {dtype_name(dtype)} n={n} root={root} from rank {r}",
                    outs[r],
                    xs[r],
                )


def check_scatter(c: Checks, inp: Inputs, g: Group, dtype: torch.dtype, n: int, tag: str) -> None:
    for root in range(g.size):
        pieces = [inp.get(dtype, n, tag, "scatter", root, d) for d in range(g.size)]
        out = junk(dtype, n)
        dist.scatter(out, pieces if g.me == root else None, src=g.glob(root), group=g.pg)
        c.equal("scatter", f"{tag} {dtype_name(dtype)} n={n} root={root}", out, pieces[g.me])


def check_barrier(c: Checks, g: Group, tag: str) -> None:
    """Each rank leaves a file, the last one late; after the barrier all files must exist."""
    folder = os.environ[BARRIER_DIR_ENV]
    for i in range(3):
        if g.me == g.size - 1:
            time.sleep(0.05)
        mark = os.path.join(folder, f"{g.name}-{tag}-{i}-{g.me}")
        open(mark, "w").close()
        dist.barrier(group=g.pg)
        missing = [
            r
            for r in range(g.size)
            if not os.path.exists(os.path.join(folder, f"{g.name}-{tag}-{i}-{r}"))
        ]
        c.true("barrier", f"{tag} barrier {i}", not missing, f"left before ranks {missing} arrived")


def check_send_recv(c: Checks, inp: Inputs, g: Group, dtype: torch.dtype, n: int, tag: str) -> None:
    w, me = g.size, g.me
    nxt, prv = (me + 1) % w, (me - 1) % w
    name = f"{tag} {dtype_name(dtype)} n={n}"
    # Blocking, around the ring: even ranks send first, odd ranks receive first.
    x = inp.get(dtype, n, tag, "send_recv", me)
    out = junk(dtype, n)
    if me % 2 == 0:
        dist.send(x, dst=g.glob(nxt), group=g.pg)
        dist.recv(out, src=g.glob(prv), group=g.pg)
    else:
        dist.recv(out, src=g.glob(prv), group=g.pg)
        dist.send(x, dst=g.glob(nxt), group=g.pg)
    c.equal("send_recv", f"{name} ring send/recv", out, inp.get(dtype, n, tag, "send_recv", prv))
    # isend/irecv, two messages in a row to the same peer, with a tag; waited receive first.
    sends = [
        dist.isend(inp.get(dtype, n, tag, "isend", me, k), dst=g.glob(nxt), group=g.pg, tag=7)
        for k in range(2)
    ]
    outs = [junk(dtype, n) for _ in range(2)]
    recvs = [dist.irecv(outs[k], src=g.glob(prv), group=g.pg, tag=7) for k in range(2)]
    for work in recvs + sends:
        work.wait()
    for k in range(2):
        c.equal(
            "send_recv",
            f"{name} isend/irecv message {k}",
            outs[k],
            inp.get(dtype, n, tag, "isend", prv, k),
        )


def check_batch_isend_irecv(
    c: Checks, inp: Inputs, g: Group, dtype: torch.dtype, n: int, tag: str
) -> None:
    w, me = g.size, g.me
    peers = [p for p in range(w) if p != me]
    outs = {p: junk(dtype, n) for p in peers}
    ops = []
    for p in peers:
        ops.append(dist.P2POp(dist.isend, inp.get(dtype, n, tag, "batch", me, p), g.glob(p), g.pg))
        ops.append(dist.P2POp(dist.irecv, outs[p], g.glob(p), g.pg))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for p in peers:
        c.equal(
            "batch_isend_irecv",
            f"{tag} {dtype_name(dtype)} n={n} from rank {p}",
            outs[p],
            inp.get(dtype, n, tag, "batch", p, me),
        )


def _obj(rank: int, tag: str) -> dict[str, Any]:
    return {
        "rank": rank,
        "tag": tag,
        "list": list(range(rank * 3)),
        "text": "é" * rank,
        "t": (rank, None, 1.5),
    }


def check_objects(c: Checks, g: Group, tag: str) -> None:
    w, me = g.size, g.me
    got: list[Any] = [None] * w
    dist.all_gather_object(got, _obj(me, tag), group=g.pg)
    c.true(
        "objects", f"{tag} all_gather_object", got == [_obj(r, tag) for r in range(w)], repr(got)
    )
    c.same_everywhere("objects", g, pickle.dumps(got))
    for root in range(w):
        want = [_obj(root, tag), "x" * (root + 1), torch.arange(root + 2)]
        lst: list[Any] = list(want) if me == root else [None, None, None]
        dist.broadcast_object_list(lst, src=g.glob(root), group=g.pg)
        ok = (
            lst[:2] == want[:2]
            and isinstance(lst[2], torch.Tensor)
            and torch.equal(lst[2], want[2])
        )
        c.true("objects", f"{tag} broadcast_object_list root={root}", ok, repr(lst))
    for root in range(w):
        out: list[Any] | None = [None] * w if me == root else None
        dist.gather_object(_obj(me, tag), out, dst=g.glob(root), group=g.pg)
        if out is not None:
            c.true(
                "objects",
                f"{tag} gather_object root={root}",
                out == [_obj(r, tag) for r in range(w)],
                repr(out),
            )


Check = Callable[[Checks, Inputs, Group, torch.dtype, int, str], None]
# (section, function, size of one piece for n elements per rank)
TENSOR_CHECKS: tuple[tuple[str, Check], ...] = (
    ("all_reduce", check_all_reduce),
    ("broadcast", check_broadcast),
    ("reduce", check_reduce),
    ("all_gather", check_all_gather),
    ("all_gather_into_tensor", check_all_gather_into_tensor),
    ("reduce_scatter", check_reduce_scatter),
    ("reduce_scatter_tensor", check_reduce_scatter_tensor),
    ("all_to_all", check_all_to_all),
    ("all_to_all_single", check_all_to_all_single),
    ("gather", check_gather),
    ("scatter", check_scatter),
    ("send_recv", check_send_recv),
    ("batch_isend_irecv", check_batch_isend_irecv),
)
# Ops whose arena footprint per chunk is (1 + W) pieces rather than one.
_WIDE = {
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
}


def run_matrix(
    c: Checks,
    g: Group,
    dtypes: Sequence[torch.dtype],
    elementwise_bytes: int | None,
    tag: str,
    sections: Sequence[str] | None = None,
    section_for: str | None = None,
) -> None:
    """Every tensor collective × ``dtypes`` on ``g``.

    Args:
        elementwise_bytes: None for the small size (7 elements); otherwise one tensor of an
            element-wise op holds about this many bytes and a piece of a gathering or
            scattering op about this many divided by (1 + W), so that both cross the chunk
            size when it is chosen above it.
        section_for: report every check under this section instead of the collective's.
    """
    inp = Inputs()
    for dtype in dtypes:
        for section, fn in TENSOR_CHECKS:
            if sections is not None and section not in sections:
                continue
            if section in P2P_SECTIONS and g.size == 1:
                continue
            if elementwise_bytes is None:
                n = SMALL
            else:
                n = elementwise_bytes // dtype.itemsize + 3
                if section in _WIDE:
                    n = n // (1 + g.size) + 1
            if section_for is None:
                fn(c, inp, g, dtype, n, tag)
            else:
                _redirected(c, section_for, fn, inp, g, dtype, n, tag)
        inp.clear()
    if elementwise_bytes is None and (sections is None or "barrier" in sections):
        if section_for is None:
            check_barrier(c, g, tag)
        else:
            _redirected(c, section_for, check_barrier, g, tag)
    if elementwise_bytes is None and (sections is None or "objects" in sections):
        if section_for is None:
            check_objects(c, g, tag)
        else:
            _redirected(c, section_for, check_objects, g, tag)


def _redirected(c: Checks, section: str, body: Callable[..., None], *args: Any) -> None:
    """Runs ``body(checks, *args)`` on a scratch Checks and files what it found under
    ``section``."""
    scratch = Checks(c.rank)
    body(scratch, *args)
    for name, fails in scratch.failures.items():
        c.failures[section].extend(f"[{name}] {f}" for f in fails)
    c.counts[section] += sum(scratch.counts.values())
    for key, h in scratch.hashes.items():
        c.same_everywhere(section, Group(key.split("@", 1)[1], None, []), h.digest())


# -- the sections that are not one collective ------------------------------------------------


def check_large_default_chunk(c: Checks, g: Group) -> None:
    """Ops that cross the daemon's default 4 MiB chunk on the default arena."""
    n_elem = DEFAULT_CHUNK_BYTES // 4 + DEFAULT_CHUNK_BYTES // 16 + 1
    n_wide = n_elem // (1 + g.size) + 1
    inp = Inputs()
    tag = "default-chunk"
    for dtype in (torch.float32, torch.int32):
        xs = [inp.get(dtype, n_elem, tag, "all_reduce", r) for r in range(g.size)]
        for op in ("SUM", "BXOR" if dtype == torch.int32 else "AVG"):
            t = xs[g.me].clone()
            dist.all_reduce(t, op=_op(op), group=g.pg)
            c.equal(
                "all_reduce", f"{tag} {dtype_name(dtype)} n={n_elem} {op}", t, reduce_ref(xs, op)
            )
            c.same_everywhere("all_reduce", g, t)
    dtype = torch.float32
    check_broadcast(c, inp, g, dtype, n_elem, tag)
    check_all_gather_into_tensor(c, inp, g, dtype, n_wide, tag)
    out = junk(dtype, n_wide)
    xs = [inp.get(dtype, g.size * n_wide, tag, "rst", r) for r in range(g.size)]
    dist.reduce_scatter_tensor(out, xs[g.me], group=g.pg)
    want = reduce_ref([x[g.me * n_wide : (g.me + 1) * n_wide] for x in xs], "SUM")
    c.equal("reduce_scatter_tensor", f"{tag} float32 n={n_wide} SUM", out, want)
    check_all_to_all_single(c, inp, g, dtype, n_wide, tag)
    if g.size > 1:
        check_send_recv(c, inp, g, dtype, n_elem, tag)


def check_sparse(c: Checks, g: Group) -> None:
    """SUM of sparse COO tensors (as gloo does it): each rank a different number of entries,
    some at indices other ranks use too; the result is the dense sum, on every rank."""
    w, me = g.size, g.me
    shape = (5, 3)

    def rank_tensor(r: int, dtype: torch.dtype) -> torch.Tensor:
        rows = torch.tensor([(r + k) % shape[0] for k in range(r + 1)], dtype=torch.int64)
        cols = torch.tensor([k % shape[1] for k in range(r + 1)], dtype=torch.int64)
        values = torch.arange(1, r + 2, dtype=dtype) * (r + 1)
        return torch.sparse_coo_tensor(torch.stack([rows, cols]), values, shape)

    for dtype in (torch.float32, torch.int64):
        t = rank_tensor(me, dtype)
        dist.all_reduce(t, group=g.pg)
        want = sum(
            (rank_tensor(r, dtype).to_dense() for r in range(w)), torch.zeros(shape, dtype=dtype)
        )
        got = t.coalesce().to_dense()
        c.equal("sparse", f"{dtype_name(dtype)} {shape} SUM", got, want)
        c.same_everywhere("sparse", g, got)


def check_async(c: Checks, g: Group, n: int, tag: str) -> None:
    """Several ops in flight, waited in another order than issued, through every door."""
    w, me = g.size, g.me
    inp = Inputs()
    f32 = torch.float32
    xs = [inp.get(f32, n, tag, "ar", r) for r in range(w)]
    bs = inp.get(torch.bfloat16, n, tag, "bc", w - 1)
    ags = [inp.get(torch.int16, n, tag, "ag", r) for r in range(w)]
    rss = [inp.get(torch.float64, w * n, tag, "rs", r) for r in range(w)]
    a2a = [inp.get(torch.int64, w * n, tag, "a2a", r) for r in range(w)]

    t_ar = xs[me].clone()
    w_ar = dist.all_reduce(t_ar, async_op=True, group=g.pg)
    t_bc = bs.clone() if me == w - 1 else junk(torch.bfloat16, n)
    w_bc = dist.broadcast(t_bc, src=g.glob(w - 1), async_op=True, group=g.pg)
    t_ag = [junk(torch.int16, n) for _ in range(w)]
    w_ag = dist.all_gather(t_ag, ags[me], async_op=True, group=g.pg)
    t_rs = junk(torch.float64, n)
    w_rs = dist.reduce_scatter_tensor(
        t_rs, rss[me], op=dist.ReduceOp.MAX, async_op=True, group=g.pg
    )
    t_a2a = junk(torch.int64, w * n)
    w_a2a = dist.all_to_all_single(t_a2a, a2a[me], async_op=True, group=g.pg)
    t_ar2 = xs[me].clone()
    w_ar2 = dist.all_reduce(t_ar2, op=dist.ReduceOp.PRODUCT, async_op=True, group=g.pg)

    section = "async"
    # Waited in another order than issued, each through a different door.
    w_a2a.wait()
    fut_rs = w_rs.get_future()
    value_rs = fut_rs.wait()
    value_ar2 = w_ar2.get_future().wait()
    w_ag.wait()
    value_ar = w_ar.get_future().wait()
    w_bc.wait()
    for name, work in (
        ("all_reduce", w_ar),
        ("broadcast", w_bc),
        ("all_gather", w_ag),
        ("reduce_scatter_tensor", w_rs),
        ("all_to_all_single", w_a2a),
        ("all_reduce PRODUCT", w_ar2),
    ):
        c.true(section, f"{tag} {name}: is_completed() after wait", work.is_completed())
    c.equal(
        section,
        f"{tag} all_to_all_single",
        t_a2a,
        torch.cat([x[me * n : (me + 1) * n] for x in a2a]),
    )
    c.equal(
        section,
        f"{tag} reduce_scatter_tensor MAX",
        t_rs,
        reduce_ref([x[me * n : (me + 1) * n] for x in rss], "MAX"),
    )
    c.true(
        section,
        f"{tag} reduce_scatter_tensor future value",
        _is_list_of(value_rs, [t_rs]),
        repr(value_rs)[:200],
    )
    c.equal(section, f"{tag} all_reduce PRODUCT", t_ar2, reduce_ref(xs, "PRODUCT"))
    c.true(
        section,
        f"{tag} all_reduce PRODUCT future value",
        _is_list_of(value_ar2, [t_ar2]),
        repr(value_ar2)[:200],
    )
    for r in range(w):
        c.equal(section, f"{tag} all_gather from rank {r}", t_ag[r], ags[r])
    c.equal(section, f"{tag} all_reduce SUM", t_ar, reduce_ref(xs, "SUM"))
    c.true(
        section,
        f"{tag} all_reduce future value",
        _is_list_of(value_ar, [t_ar]),
        repr(value_ar)[:200],
    )
    c.equal(section, f"{tag} broadcast", t_bc, bs)
    c.same_everywhere(section, g, t_ar)
    c.same_everywhere(section, g, t_bc)

    # Polling: is_completed() must turn true without anybody calling wait().
    t = xs[me].clone()
    work = dist.all_reduce(t, async_op=True, group=g.pg)
    deadline = time.monotonic() + 10
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.001)
    c.true(
        section,
        f"{tag} is_completed() turns true while polling",
        work.is_completed(),
        "still false after 10 s",
    )
    work.wait()
    c.equal(section, f"{tag} polled all_reduce", t, reduce_ref(xs, "SUM"))
    # A callback chained on the future sees the result.
    t = xs[me].clone()
    fut = (
        dist.all_reduce(t, async_op=True, group=g.pg).get_future().then(lambda f: f.value()[0] * 2)
    )
    c.equal(section, f"{tag} future.then", fut.wait(), reduce_ref(xs, "SUM") * 2)


def _is_list_of(value: Any, tensors: list[torch.Tensor]) -> bool:
    return (
        isinstance(value, list)
        and len(value) == len(tensors)
        and all(
            isinstance(v, torch.Tensor) and v.data_ptr() == t.data_ptr() and bits(v) == bits(t)
            for v, t in zip(value, tensors)
        )
    )


def check_noncontiguous(c: Checks, g: Group, dtype: torch.dtype, tag: str) -> None:
    """Outputs (and some inputs) that are strided views: results land in the right places."""
    w, me = g.size, g.me
    s = "noncontiguous"
    inp = Inputs()
    n = SMALL
    name = f"{tag} {dtype_name(dtype)}"

    def strided(base: torch.Tensor) -> torch.Tensor:
        return base[::2]

    # all_reduce into a transposed view, in place.
    xs = [inp.get(dtype, (3, n), tag, "ar", r).t() for r in range(w)]
    base = xs[me].t().clone()
    t = base.t()
    dist.all_reduce(t, group=g.pg)
    c.equal(s, f"{name} all_reduce into a transposed view", t, reduce_ref(xs, "SUM"))
    c.equal(s, f"{name} all_reduce: the view's storage", base, reduce_ref(xs, "SUM").t())
    # broadcast into a transposed view, every root.
    for root in range(w):
        src = inp.get(dtype, (n, 2), tag, "bc", root)
        t = src.t().contiguous().t() if me == root else junk(dtype, (2, n)).t()
        dist.broadcast(t, src=g.glob(root), group=g.pg)
        c.equal(s, f"{name} broadcast root={root} into a transposed view", t, src)
    # reduce into a strided view on the root; the elements in between must stay as they were.
    root = w - 1
    xs = [inp.get(dtype, n, tag, "red", r) for r in range(w)]
    base = junk(dtype, 2 * n)
    before = base.clone()
    t = strided(base)
    t.copy_(xs[me])
    dist.reduce(t, dst=g.glob(root), op=dist.ReduceOp.MAX, group=g.pg)
    if me == root:
        c.equal(s, f"{name} reduce MAX into a strided view", t, reduce_ref(xs, "MAX"))
    c.equal(s, f"{name} reduce: untouched between the strides", base[1::2], before[1::2])
    # all_gather (list) into transposed views, from a transposed input.
    xs = [inp.get(dtype, (2, n), tag, "ag", r) for r in range(w)]
    outs = [junk(dtype, (n, 2)).t() for _ in range(w)]
    dist.all_gather(outs, xs[me], group=g.pg)
    for r in range(w):
        c.equal(s, f"{name} all_gather into a transposed view, from rank {r}", outs[r], xs[r])
    xs_t = [x.t() for x in xs]  # non-contiguous inputs
    outs = [junk(dtype, (n, 2)) for _ in range(w)]
    dist.all_gather(outs, xs_t[me], group=g.pg)
    for r in range(w):
        c.equal(s, f"{name} all_gather from a transposed input, rank {r}", outs[r], xs_t[r])
    # all_gather_into_tensor: stacked [W, n] as a transposed view; concatenated as a strided one.
    xs = [inp.get(dtype, n, tag, "agt", r) for r in range(w)]
    stacked = junk(dtype, (n, w)).t()
    dist.all_gather_into_tensor(stacked, xs[me], group=g.pg)
    c.equal(
        s, f"{name} all_gather_into_tensor into a transposed [W, n] view", stacked, torch.stack(xs)
    )
    base = junk(dtype, 2 * w * n)
    before = base.clone()
    flat = strided(base)
    dist.all_gather_into_tensor(flat, xs[me], group=g.pg)
    c.equal(s, f"{name} all_gather_into_tensor into a strided [W*n] view", flat, torch.cat(xs))
    c.equal(
        s, f"{name} all_gather_into_tensor: untouched between the strides", base[1::2], before[1::2]
    )
    # reduce_scatter (list, strided inputs) and reduce_scatter_tensor into strided outputs.
    pieces = [[strided(inp.get(dtype, 2 * n, tag, "rs", r, d)) for d in range(w)] for r in range(w)]
    base = junk(dtype, 2 * n)
    before = base.clone()
    out = strided(base)
    dist.reduce_scatter(out, pieces[me], group=g.pg)
    c.equal(
        s,
        f"{name} reduce_scatter into a strided view",
        out,
        reduce_ref([pieces[r][me] for r in range(w)], "SUM"),
    )
    c.equal(s, f"{name} reduce_scatter: untouched between the strides", base[1::2], before[1::2])
    xs = [inp.get(dtype, (n, w), tag, "rst", r).t() for r in range(w)]  # a transposed [W, n] input
    out = junk(dtype, (n, 2))[:, 0]
    dist.reduce_scatter_tensor(out, xs[me], op=dist.ReduceOp.MIN, group=g.pg)
    c.equal(
        s,
        f"{name} reduce_scatter_tensor into a column view",
        out,
        reduce_ref([x[me] for x in xs], "MIN"),
    )
    # all_to_all_single into a transposed [W*m, 2] view; all_to_all (list) into strided views.
    m = 3
    xs = [inp.get(dtype, (w * m, 2), tag, "a2as", r) for r in range(w)]
    out = junk(dtype, (2, w * m)).t()
    dist.all_to_all_single(out, xs[me], group=g.pg)
    c.equal(
        s,
        f"{name} all_to_all_single into a transposed view",
        out,
        torch.cat([x[me * m : (me + 1) * m] for x in xs]),
    )
    ins = [inp.get(dtype, n, tag, "a2a", me, d) for d in range(w)]
    outs = [strided(junk(dtype, 2 * n)) for _ in range(w)]
    dist.all_to_all(outs, ins, group=g.pg)
    for src in range(w):
        c.equal(
            s,
            f"{name} all_to_all into a strided view, from rank {src}",
            outs[src],
            inp.get(dtype, n, tag, "a2a", src, me),
        )
    # gather into transposed views on the root; scatter into a strided view.
    root = 0
    xs = [inp.get(dtype, (n, 2), tag, "ga", r) for r in range(w)]
    outs_g = [junk(dtype, (2, n)).t() for _ in range(w)] if me == root else None
    dist.gather(xs[me], outs_g, dst=g.glob(root), group=g.pg)
    if outs_g is not None:
        for r in range(w):
            c.equal(s, f"{name} gather into a transposed view, from rank {r}", outs_g[r], xs[r])
    root = w - 1
    pieces = [inp.get(dtype, n, tag, "sc", d) for d in range(w)]
    out = strided(junk(dtype, 2 * n))
    dist.scatter(out, pieces if me == root else None, src=g.glob(root), group=g.pg)
    c.equal(s, f"{name} scatter into a strided view", out, pieces[me])
    # recv into a transposed view from a strided send.
    if w > 1:
        nxt, prv = (me + 1) % w, (me - 1) % w
        x = strided(inp.get(dtype, (4, n), tag, "p2p", me))
        out = junk(dtype, (n, 2)).t()
        sent = dist.isend(x, dst=g.glob(nxt), group=g.pg)
        dist.recv(out, src=g.glob(prv), group=g.pg)
        sent.wait()
        c.equal(
            s,
            f"{name} recv into a transposed view",
            out,
            strided(inp.get(dtype, (4, n), tag, "p2p", prv)),
        )


def check_arena_wraparound(c: Checks, g: Group) -> None:
    """On a 1 MiB arena: the chunk is 256 KiB, and many ops in flight wrap the ring."""
    section = "arena_wraparound"
    comm = getattr(g.pg, "comm", None)
    chunk = getattr(comm, "chunk_bytes", None)
    c.true(
        section,
        "the group's chunk is a quarter of its 1 MiB arena",
        chunk == CHUNKED_ARENA_BYTES // 4,
        f"chunk_bytes={chunk}",
    )
    w, me = g.size, g.me
    inp = Inputs()
    sizes = [70_001, 130_003, 5, 110_000, 90_017, 1, 65_536, 64_999, 120_011, 77_777, 3, 100_000]
    pending = []
    for i, n in enumerate(sizes):
        dtype = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)[i % 4]
        xs = [inp.get(dtype, n, "wrap", i, r) for r in range(w)]
        if i % 3 == 2:
            outs = [junk(dtype, n) for _ in range(w)]
            pending.append(
                (
                    f"all_gather #{i} {dtype_name(dtype)} n={n}",
                    dist.all_gather(outs, xs[me], group=g.pg, async_op=True),
                    outs,
                    xs,
                )
            )
        else:
            t = xs[me].clone()
            pending.append(
                (
                    f"all_reduce #{i} {dtype_name(dtype)} n={n}",
                    dist.all_reduce(t, group=g.pg, async_op=True),
                    [t],
                    [reduce_ref(xs, "SUM")],
                )
            )
    for name, work, got, want in reversed(pending):
        work.wait()
        for k, (a, b) in enumerate(zip(got, want)):
            c.equal(section, f"{name} [{k}]", a, b)
            c.same_everywhere(section, g, a)


def check_subgroups(c: Checks, world: Group, subsets: Sequence[Sequence[int]]) -> None:
    """new_group on subsets: collectives on each, interleaved with the default group's."""
    section = "subgroups"
    rank = dist.get_rank()
    groups = []
    for ranks in subsets:
        pg = dist.new_group(list(ranks), timeout=PG_TIMEOUT)  # every rank calls it, members or not
        groups.append(Group("g" + "".join(map(str, ranks)), pg, list(ranks)))
    mine = [g for g in groups if rank in g.ranks]
    for g in mine:
        run_matrix(
            c,
            g,
            (torch.float32, torch.bfloat16, torch.int64, torch.bool),
            None,
            f"sub-{g.name}",
            section_for=section,
        )
    # Interleaved: async ops on the subgroups stay in flight across default-group ops.
    inp = Inputs()
    for i in range(3):
        in_flight = []
        for g in mine:
            xs = [inp.get(torch.float32, 1000, "inter", g.name, i, r) for r in range(g.size)]
            t = xs[g.me].clone()
            in_flight.append(
                (g, t, reduce_ref(xs, "SUM"), dist.all_reduce(t, group=g.pg, async_op=True))
            )
        xs = [inp.get(torch.int32, 999, "inter", "world", i, r) for r in range(world.size)]
        t = xs[rank].clone()
        dist.all_reduce(t, op=dist.ReduceOp.BXOR)
        c.equal(section, f"interleaved {i}: default group all_reduce", t, reduce_ref(xs, "BXOR"))
        for g in mine:
            root = g.size - 1
            src = inp.get(torch.int8, 33, "inter-bc", g.name, i)
            b = src.clone() if g.me == root else junk(torch.int8, 33)
            dist.broadcast(b, src=g.glob(root), group=g.pg)
            c.equal(section, f"interleaved {i}: {g.name} broadcast", b, src)
        outs = [junk(torch.float64, 5) for _ in range(world.size)]
        ys = [inp.get(torch.float64, 5, "inter-ag", i, r) for r in range(world.size)]
        dist.all_gather(outs, ys[rank])
        for r in range(world.size):
            c.equal(
                section, f"interleaved {i}: default group all_gather from rank {r}", outs[r], ys[r]
            )
        for g, t, want, work in reversed(in_flight):
            work.wait()
            c.equal(section, f"interleaved {i}: {g.name} async all_reduce", t, want)
            c.same_everywhere(section, g, t)


# -- entry points for the spawned ranks ------------------------------------------------------


def matrix_main(rank: int, world_size: int) -> dict[str, Any]:
    """The whole matrix for one world size, in one process group (plus its subgroups)."""
    c = Checks(rank)
    world = Group("world", None, list(range(world_size)))
    # Every collective × every dtype, 7 elements, default group.
    run_matrix(c, world, DTYPES, None, "small")
    for dtype in DTYPES:
        check_noncontiguous(c, world, dtype, "small")
    # Crossing the default 4 MiB chunk.
    check_large_default_chunk(c, world)
    check_async(c, world, 300_001, "async")
    check_sparse(c, world)
    # A group on a 1 MiB arena: 256 KiB chunks, so every op below is cut and the ring wraps.
    os.environ["SMDDP_ARENA_BYTES"] = str(CHUNKED_ARENA_BYTES)
    small_arena = Group(
        "arena1m",
        dist.new_group(list(range(world_size)), timeout=PG_TIMEOUT),
        list(range(world_size)),
    )
    dist.barrier(group=small_arena.pg)
    del os.environ["SMDDP_ARENA_BYTES"]
    run_matrix(c, small_arena, DTYPES, CHUNKED_ELEMENTWISE_BYTES, "chunked")
    check_arena_wraparound(c, small_arena)
    check_async(c, small_arena, 100_003, "async-chunked")
    if world_size == 4:
        check_subgroups(c, world, ([0, 2], [1, 2, 3]))
    elif world_size == 3:
        check_subgroups(c, world, ([0, 2],))
    dist.barrier()
    return c.report()


GRPC_DTYPES = (torch.bfloat16, torch.float32, torch.int8, torch.int64, torch.bool)


def grpc_main(rank: int, world_size: int) -> dict[str, Any]:
    """A reduced matrix over the gRPC Ops stream (the arena is 1 MiB, so ops are chunked)."""
    c = Checks(rank)
    world = Group("world", None, list(range(world_size)))
    pg = dist.distributed_c10d._get_default_group()
    session = getattr(getattr(pg, "comm", None), "session", None)
    c.true(
        "grpc",
        "the ops travel on the gRPC stream",
        getattr(session, "_stream_requests", None) is not None,
        f"session {session!r} has no gRPC stream",
    )
    for label, size in (("grpc-small", None), ("grpc-chunked", CHUNKED_ELEMENTWISE_BYTES)):
        run_matrix(c, world, GRPC_DTYPES, size, label, section_for="grpc")
    _redirected(c, "grpc", check_async, world, 100_003, "grpc-async")
    dist.barrier()
    return c.report()


def p2p_receive_first_main(rank: int, world_size: int) -> dict[str, Any]:
    """Two ranks each irecv, then isend, more than their arena holds (torch allows any order)."""
    c = Checks(rank)
    peer = 1 - rank
    n = CHUNKED_ARENA_BYTES // 4 + 1  # float32: just over the whole arena
    out = junk(torch.float32, n)
    received = dist.irecv(out, src=peer)
    sent = dist.isend(make(torch.float32, n, "first", rank), dst=peer)
    received.wait()
    sent.wait()
    c.equal("p2p_receive_first", "irecv before isend", out, make(torch.float32, n, "first", peer))
    return c.report()
