"""The algorithms between nodes over in-memory peers, a thread per node: no sockets.

Each algorithm runs for N = 2..17 nodes (odd and even, powers of two and not), sizes of 0 and
1 element and sizes that N does not divide, every dtype and reduce op it serves; every node's
result must be bit for bit a numpy reference computed here in the order the algorithm's module
documents. Then the cost model's choices, the simulator against the model, SMDDP_ALGO, and
``hierarchical.execute`` with a selector (AVG, interleaved ranks, roots on every node).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from smddp.core.reduce import reduce_into
from smddp.server import config, hierarchical
from smddp.server.algo_cost import PREDICTIONS, CostModel, choose, predict
from smddp.server.algo_schedule import Shape, bounds, run
from smddp.server.algo_simulate import simulate
from smddp.server.algorithms import ALGORITHMS, Selector, parse_pins
from smddp.server.arena import Arena
from smddp.server.domain import Layout, NodeSpec
from smddp.server.errors import PeerError
from smddp.v1 import smddp_pb2 as pb

pytestmark = pytest.mark.timeout(120)

NODE_COUNTS = range(2, 18)
# (dtype, reduce op) pairs the algorithms serve; AVG goes through hierarchical (it divides).
COMBOS = [
    (np.float32, pb.SUM),
    (np.float64, pb.PRODUCT),
    (np.float32, pb.MAX),
    (np.float64, pb.MIN),
    (np.int32, pb.SUM),
    (np.int32, pb.PRODUCT),
    (np.bool_, pb.SUM),
    (np.bool_, pb.PRODUCT),
]


class _Wire:
    """Every node's mailbox, keyed (to, tag, round, from); a key sent twice is a bug of the
    algorithm (two messages of one round between one pair), so it fails the test."""

    def __init__(self) -> None:
        self.mail: dict[tuple[int, object, int, int], np.ndarray] = {}
        self.cond = threading.Condition()
        self.duplicates: list[tuple[int, object, int, int]] = []


class _Node:
    """One node's ``Exchange`` over the wire: what ``hierarchical._NodeChunk`` does over
    ``CommPeers``; ``tag`` keeps the ops of one test apart."""

    def __init__(self, wire: _Wire, me: int, tag: object) -> None:
        self.wire, self.me, self.tag = wire, me, tag

    def send(self, node: int, round_: int, payloads: Sequence[np.ndarray]) -> None:
        data = np.concatenate([np.ascontiguousarray(p).reshape(-1) for p in payloads])
        key = (node, self.tag, round_, self.me)
        with self.wire.cond:
            if key in self.wire.mail:
                self.wire.duplicates.append(key)
            self.wire.mail[key] = data.copy()
            self.wire.cond.notify_all()

    def recv(self, node: int, round_: int, expect: int | None = None) -> np.ndarray:
        key = (self.me, self.tag, round_, node)
        with self.wire.cond:
            if not self.wire.cond.wait_for(lambda: key in self.wire.mail, timeout=20):
                raise PeerError(f"node {self.me}: nothing from node {node} in round {round_}")
            data = self.wire.mail.pop(key)
        assert expect is None or data.size == expect, (node, round_, data.size, expect)
        return data


def _threads(n: int, body: Callable[[int], None]) -> None:
    """Runs ``body(i)`` for every node on a thread each; re-raises the first failure."""
    errors: dict[int, BaseException] = {}

    def node(i: int) -> None:
        try:
            body(i)
        except BaseException as exc:  # reported below, with the node
            errors[i] = exc

    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a node hung"
    if errors:
        i = min(errors)
        raise AssertionError(f"node {i} of {n}: {errors[i]!r}") from errors[i]


# -- references, each in its module's documented order ---------------------------------------


def _op2(a: np.ndarray, b: np.ndarray, op: int) -> np.ndarray:
    out = np.empty_like(a)
    reduce_into([out], [a, b], op, divisor=1)
    return out


def _fold(xs: Sequence[np.ndarray], op: int) -> np.ndarray:
    acc = xs[0].copy()
    for x in xs[1:]:
        acc = _op2(acc, x, op)
    return acc


def ref_direct(ps: Sequence[np.ndarray], op: int) -> np.ndarray:
    """((p0 op p1) op p2) ...: node order."""
    return _fold(ps, op)


def ref_tree(ps: Sequence[np.ndarray], op: int) -> np.ndarray:
    """Fold node 2i into 2i+1 for i < r, then a balanced tree over the P partials."""
    n = len(ps)
    p = 1 << (n.bit_length() - 1)
    r = n - p
    qs = [_op2(ps[2 * i], ps[2 * i + 1], op) for i in range(r)] + list(ps[2 * r :])
    while len(qs) > 1:
        qs = [_op2(qs[i], qs[i + 1], op) for i in range(0, len(qs), 2)]
    return qs[0]


def ref_ring(ps: Sequence[np.ndarray], op: int) -> np.ndarray:
    """Segment k from node k+1 round to node k; the arriving partial first until the chain
    wraps past node N-1, second after."""
    n, count = len(ps), ps[0].size
    b = bounds(count, n)
    out = np.empty_like(ps[0])
    for k in range(n):
        seg = slice(b[k], b[k + 1])
        start = (k + 1) % n
        acc = ps[start][seg].copy()
        for t in range(1, n):
            i = (start + t) % n
            acc = _op2(acc, ps[i][seg], op) if i > start else _op2(ps[i][seg], acc, op)
        out[seg] = acc
    return out


REFERENCES = {
    "direct": ref_direct,
    "ring": ref_ring,
    "recursive_doubling": ref_tree,
    "halving_doubling": ref_tree,
}


def _inputs(n: int, count: int, dtype: type, seed: int) -> list[np.ndarray]:
    g = np.random.default_rng(seed)
    if dtype is np.bool_:
        return [g.integers(0, 2, count).astype(bool) for _ in range(n)]
    if np.issubdtype(dtype, np.integer):
        return [g.integers(-(2**31), 2**31, count).astype(dtype) for _ in range(n)]
    # Floats of mixed magnitudes, so that a change of order changes the bits of a sum.
    return [
        (g.standard_normal(count) * 10.0 ** g.integers(-3, 4, count)).astype(dtype)
        for _ in range(n)
    ]


def _sizes(n: int) -> list[int]:
    return [0, 1, 2 * n + 3, 61]


# -- all_reduce -------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS["all_reduce"]))
@pytest.mark.parametrize("n", NODE_COUNTS)
def test_all_reduce_is_the_documented_order_on_every_node(algorithm: str, n: int) -> None:
    segments = 1 + n % 3  # the ring cuts its blocks in 1, 2 or 3 pieces
    cases = [
        (count, dtype, op, seed) for seed, count in enumerate(_sizes(n)) for dtype, op in COMBOS
    ]
    inputs = [_inputs(n, count, dtype, seed) for count, dtype, _, seed in cases]
    results: dict[tuple[int, int], np.ndarray] = {}
    wire = _Wire()

    def node(i: int) -> None:
        for c, (count, _, op, _) in enumerate(cases):
            buf = inputs[c][i].copy()
            steps = ALGORITHMS["all_reduce"][algorithm](Shape(n, i, count, segments=segments))
            run(steps, _Node(wire, i, c), buf, op, n, i)
            results[(c, i)] = buf

    _threads(n, node)
    assert wire.duplicates == [] and wire.mail == {}
    for c, (count, dtype, op, _) in enumerate(cases):
        want = REFERENCES[algorithm](inputs[c], op)
        for i in range(n):
            got = results[(c, i)]
            assert got.tobytes() == want.tobytes(), (
                f"{algorithm} N={n} node {i} count={count} {np.dtype(dtype)} op={op}"
            )


def test_the_orders_differ_where_the_modules_say_they_do() -> None:
    # The references are not all one function in disguise: for 5 float nodes the ring, the
    # tree and node order give different bits, so each test above can fail.
    ps = _inputs(5, 1000, np.float32, 7)
    bits = {name: ref(ps, pb.SUM).tobytes() for name, ref in REFERENCES.items()}
    assert len({bits["direct"], bits["ring"], bits["halving_doubling"]}) == 3
    # For 2 and 3 nodes the tree is node order (the multi-node tests' reference), and for 2
    # nodes the ring too.
    for n in (2, 3):
        ps = _inputs(n, 1000, np.float32, n)
        assert ref_tree(ps, pb.SUM).tobytes() == ref_direct(ps, pb.SUM).tobytes()
    ps = _inputs(2, 1000, np.float32, 2)
    assert ref_ring(ps, pb.SUM).tobytes() == ref_direct(ps, pb.SUM).tobytes()


# -- broadcast, all_gather, barrier -----------------------------------------------------------


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS["broadcast"]))
@pytest.mark.parametrize("n", NODE_COUNTS)
def test_broadcast_reaches_every_node_from_every_root(algorithm: str, n: int) -> None:
    roots = sorted({0, n // 2, n - 1})
    cases = [(root, count) for root in roots for count in _sizes(n) + [1000]]
    data = [_inputs(1, count, np.float64, root)[0] for root, count in cases]
    results: dict[tuple[int, int], np.ndarray] = {}
    wire = _Wire()

    def node(i: int) -> None:
        for c, (root, count) in enumerate(cases):
            buf = data[c].copy() if i == root else np.full(count, np.nan)
            shape = Shape(n, i, count, root=root, segments=1 + c % 4)
            run(ALGORITHMS["broadcast"][algorithm](shape), _Node(wire, i, c), buf, pb.SUM, n, i)
            results[(c, i)] = buf

    _threads(n, node)
    assert wire.duplicates == [] and wire.mail == {}
    for c in range(len(cases)):
        for i in range(n):
            assert results[(c, i)].tobytes() == data[c].tobytes(), (algorithm, n, cases[c], i)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS["all_gather"]))
@pytest.mark.parametrize("n", NODE_COUNTS)
def test_all_gather_gives_every_node_every_block(algorithm: str, n: int) -> None:
    cases = [tuple((i % 3) * per for i in range(n)) for per in (0, 1, 5)]  # uneven, some empty
    results: dict[tuple[int, int], np.ndarray] = {}
    wire = _Wire()
    wants = [np.arange(sum(blocks), dtype=np.int32) * 7 for blocks in cases]

    def node(i: int) -> None:
        for c, blocks in enumerate(cases):
            start = sum(blocks[:i])
            buf = np.full(sum(blocks), -1, dtype=np.int32)
            buf[start : start + blocks[i]] = wants[c][start : start + blocks[i]]
            shape = Shape(n, i, sum(blocks), blocks=blocks)
            run(ALGORITHMS["all_gather"][algorithm](shape), _Node(wire, i, c), buf, 0, n, i)
            results[(c, i)] = buf

    _threads(n, node)
    assert wire.duplicates == [] and wire.mail == {}
    for c in range(len(cases)):
        for i in range(n):
            assert results[(c, i)].tolist() == wants[c].tolist(), (algorithm, n, cases[c], i)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS["barrier"]))
@pytest.mark.parametrize("n", NODE_COUNTS)
def test_no_node_leaves_the_barrier_before_every_node_entered(algorithm: str, n: int) -> None:
    entered = [threading.Event() for _ in range(n)]
    wire = _Wire()
    late = n // 2

    def node(i: int) -> None:
        if i == late:  # comes late: a barrier that let a node through early would show it
            threading.Event().wait(0.05)
        entered[i].set()
        shape = Shape(n, i, 0)
        buf = np.empty(0, dtype=np.uint8)
        run(ALGORITHMS["barrier"][algorithm](shape), _Node(wire, i, 0), buf, 0, n, i)
        missing = [j for j in range(n) if not entered[j].is_set()]
        assert missing == [], f"node {i} left the barrier before nodes {missing} entered"

    _threads(n, node)
    assert wire.duplicates == [] and wire.mail == {}


def test_dissemination_takes_log2_rounds_where_direct_takes_n_minus_1_frames() -> None:
    for n in NODE_COUNTS:
        steps = list(ALGORITHMS["barrier"]["dissemination"](Shape(n, 0, 0)))
        assert len(steps) == 2 * (n - 1).bit_length()
        assert len(list(ALGORITHMS["barrier"]["direct"](Shape(n, 0, 0)))) == 2 * (n - 1)


# -- the cost model --------------------------------------------------------------------------

MIB = 1 << 20


@pytest.mark.parametrize(
    ("op", "n", "nbytes", "want"),
    [
        ("all_reduce", 2, 4, "recursive_doubling"),
        ("all_reduce", 16, 4, "recursive_doubling"),
        ("all_reduce", 1024, 4, "recursive_doubling"),
        ("all_reduce", 3, MIB, "direct"),
        ("all_reduce", 8, MIB, "halving_doubling"),
        ("all_reduce", 8, 16 * MIB, "ring"),
        ("all_reduce", 12, 16 * MIB, "ring"),  # not a power of two: the fold costs 2 whole copies
        ("broadcast", 2, 4, "tree"),
        ("broadcast", 16, 4096, "tree"),
        ("broadcast", 16, 16 * MIB, "chain"),
        ("broadcast", 1024, 256 * MIB, "chain"),
        ("all_gather", 8, MIB, "ring"),
        ("barrier", 2, 0, "dissemination"),
        ("barrier", 17, 0, "dissemination"),
    ],
)
def test_the_model_chooses(op: str, n: int, nbytes: int, want: str) -> None:
    assert choose(CostModel(), op, n, nbytes)[0] == want


def test_below_four_nodes_the_choice_keeps_node_order() -> None:
    # The multi-node tests (2 and 3 nodes) compare floats bit for bit with node order: the
    # algorithms the model may pick there are the ones whose order is node order at N <= 3.
    for n in (2, 3):
        for nbytes in [0, 4, 28, 512 << 10, 4 * MIB, 64 * MIB, 1 << 30]:
            name = choose(CostModel(), "all_reduce", n, nbytes)[0]
            assert name in ("direct", "recursive_doubling", "halving_doubling"), (n, nbytes)


def test_costlier_messages_move_the_choice_to_fewer_steps() -> None:
    # 1 MiB over 8 nodes: halving-doubling with the default costs; with a millisecond per
    # message, the 3 whole-buffer steps of recursive doubling beat its 6 half-size ones.
    assert choose(CostModel(), "all_reduce", 8, MIB)[0] == "halving_doubling"
    assert choose(CostModel(alpha=1e-3), "all_reduce", 8, MIB)[0] == "recursive_doubling"
    assert choose(CostModel(alpha=1e-6), "all_reduce", 8, 64 << 10)[0] == "halving_doubling"


def test_fit_recovers_alpha_and_beta() -> None:
    samples = [(b, 50e-6 + b * 2e-9) for b in (0, 1 << 10, 1 << 20, 16 << 20)]
    m = CostModel.fit(samples)
    assert m.alpha == pytest.approx(50e-6) and m.beta == pytest.approx(2e-9)
    with pytest.raises(ValueError, match="at least two sizes"):
        CostModel.fit([(100, 1e-3), (100, 2e-3)])


@pytest.mark.parametrize("n", [4, 7, 16, 64])
@pytest.mark.parametrize("nbytes", [4, 64 << 10, 16 * MIB])
def test_the_simulation_agrees_with_the_model_within_10_percent(n: int, nbytes: int) -> None:
    # The same step generators as the daemon runs, over the modelled link, against the closed
    # forms; 10 % covers what the closed forms leave out (the ring's pipeline fill).
    m = CostModel()
    for op in ("all_reduce", "broadcast", "all_gather"):
        for name in PREDICTIONS[op]:
            count = max(1, nbytes // 4) if op != "all_gather" else max(1, nbytes // 4 // n)
            predicted, segs = predict(
                m, op, name, n, count * 4 if op != "all_gather" else count * 4 * n
            )
            simulated = simulate(m, op, name, n, count, 4, segs)
            assert simulated == pytest.approx(predicted, rel=0.10), (op, name, n, nbytes, segs)
    for name in PREDICTIONS["barrier"]:
        assert simulate(m, "barrier", name, n, 0) == pytest.approx(
            predict(m, "barrier", name, n, 0)[0]
        )


# -- SMDDP_ALGO and the selector -------------------------------------------------------------


def test_pins_read_per_op_or_one_name_for_every_op_that_has_it() -> None:
    assert parse_pins("") == {}
    assert parse_pins("all_reduce=ring, broadcast=tree") == {
        "all_reduce": "ring",
        "broadcast": "tree",
    }
    assert parse_pins("direct") == {op: "direct" for op in ALGORITHMS}
    assert parse_pins("ring") == {"all_reduce": "ring", "all_gather": "ring"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bogus", "SMDDP_ALGO: 'bogus' is no algorithm; choose one of chain, direct,"),
        (
            "all_reduce=tree",
            "SMDDP_ALGO: all_reduce has no algorithm 'tree'; choose one of direct,",
        ),
        ("reduce=ring", "SMDDP_ALGO: 'reduce' is not an op with a choice of algorithm; choose one"),
    ],
)
def test_a_bad_pin_names_the_valid_choices(text: str, message: str, capsys) -> None:
    with pytest.raises(ValueError, match=message):
        parse_pins(text)
    with pytest.raises(SystemExit):
        config.load([], {"SMDDP_ALGO": text})
    assert message in capsys.readouterr().err


def test_the_selector_logs_once_per_op_and_size_class_and_lists_its_choices(caplog) -> None:
    sel = Selector("job j comm c", pins="broadcast=direct")
    with caplog.at_level(logging.INFO, logger="smddp.server.algorithms"):
        for nbytes in (100, 120, 128, 16 * MIB):
            sel.choose("all_reduce", 8, nbytes)
        sel.choose("broadcast", 8, 16 * MIB)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "broadcast of up to 16777216 bytes over 8 nodes runs direct" in lines[2]
    assert "pinned by SMDDP_ALGO" in lines[2]
    assert sel.choices() == [
        "all_reduce <= 128 B: recursive_doubling x1",
        "all_reduce <= 16777216 B: ring x2",
        "broadcast <= 16777216 B: direct x1",
    ]


# -- through hierarchical.execute ------------------------------------------------------------


class _Peers:
    """``hierarchical.Peers`` over a _Wire, keyed by the op's seq and chunk."""

    def __init__(self, wire: _Wire, me: int) -> None:
        self.node = _Node(wire, me, None)

    def send(self, node, ftype, req, round_=0, payloads=()):
        from smddp.server.peer_wire import pack_header, unpack_header

        r = req or pb.OpRequest()
        data = b"".join(np.ascontiguousarray(p).tobytes() for p in payloads)
        header = pack_header(
            ftype, self.node.me, len(data), kind=r.kind, dtype=r.dtype, seq=r.seq, part=r.part,
            parts=r.parts, round_=round_, count=r.count, root=r.root, reduce_op=r.reduce_op,
        )  # fmt: skip
        frame, _ = unpack_header(header)
        frame.payload = np.frombuffer(data, dtype=np.uint8)
        self.node.tag = (r.seq, r.part)
        with self.node.wire.cond:
            self.node.wire.mail[(node, (r.seq, r.part), round_, self.node.me)] = frame  # type: ignore[assignment]
            self.node.wire.cond.notify_all()

    def recv(self, seq, part, round_, node):
        key = (self.node.me, (seq, part), round_, node)
        with self.node.wire.cond:
            if not self.node.wire.cond.wait_for(lambda: key in self.node.wire.mail, timeout=20):
                raise PeerError(f"op #{seq}: node {node} sent nothing")
            return self.node.wire.mail.pop(key)


def _arena(nbytes: int) -> Arena:
    fd = os.memfd_create("smddp-test", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return Arena(fd, nbytes, "test")


def _execute(
    nodes: list[list[int]], reqs: dict[int, pb.OpRequest], pins: str, ins: dict[int, np.ndarray]
) -> dict[int, Arena]:
    world = sum(len(r) for r in nodes)
    arenas = {r: _arena(1 << 16) for r in range(world)}
    for r, x in ins.items():
        arenas[r].view(reqs[r].input, x.dtype)[:] = x
    specs = tuple(NodeSpec(f"n{i}", f"10.0.0.{i}:1") for i in range(len(nodes)))
    layout_nodes = tuple(tuple(r) for r in nodes)
    wire = _Wire()

    def node(i: int) -> None:
        layout = Layout("j", "c", layout_nodes, i, specs)
        local = nodes[i]
        hierarchical.execute(
            layout, _Peers(wire, i), {r: reqs[r] for r in local}, {r: arenas[r] for r in local},
            Selector(layout.name(), pins),
        )  # fmt: skip

    _threads(len(nodes), node)
    return arenas


def _req(kind: int, count: int, out_count: int | None = None, **fields: int) -> pb.OpRequest:
    out = 4 * (count if out_count is None else out_count)
    return pb.OpRequest(
        request_id=1, seq=1, part=0, parts=1, kind=kind, dtype=pb.FLOAT32, count=count,
        input=pb.Region(offset=0, nbytes=4 * count), output=pb.Region(offset=4 * count, nbytes=out),
        **fields,
    )  # fmt: skip


# 5 nodes of 1 to 3 ranks, ranks interleaved: node order is by lowest rank.
NODES = [[0, 5, 9], [1, 6], [2], [3, 7, 10], [4, 8]]
WORLD = 11


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS["all_reduce"]))
def test_execute_all_reduce_avg_is_the_order_then_one_division(algorithm: str) -> None:
    n = 23
    xs = _inputs(WORLD, n, np.float32, 3)
    reqs = {r: _req(pb.ALL_REDUCE, n, reduce_op=pb.AVG) for r in range(WORLD)}
    arenas = _execute(NODES, reqs, f"all_reduce={algorithm}", dict(enumerate(xs)))
    partials = [_fold([xs[r] for r in ranks], pb.SUM) for ranks in NODES]
    want = REFERENCES[algorithm](partials, pb.SUM) / np.float32(WORLD)
    for r in range(WORLD):
        got = arenas[r].view(reqs[r].output, np.dtype(np.float32))
        assert got.tobytes() == want.astype(np.float32).tobytes(), (algorithm, r)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS["broadcast"]))
def test_execute_broadcast_from_a_rank_of_each_node(algorithm: str) -> None:
    n = 37
    for root in (0, 6, 2, 10, 8):
        src = _inputs(1, n, np.float32, root)[0]
        reqs = {r: _req(pb.BROADCAST, n, root=root) for r in range(WORLD)}
        arenas = _execute(NODES, reqs, f"broadcast={algorithm}", {root: src})
        for r in range(WORLD):
            out = arenas[r].view(reqs[r].output, np.dtype(np.float32))
            assert out.tobytes() == src.tobytes(), (algorithm, root, r)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS["all_gather"]))
@pytest.mark.parametrize(
    "nodes", [NODES, [[0, 1], [2], [3, 4, 5]]], ids=["interleaved", "contiguous"]
)
def test_execute_all_gather_is_rank_major(algorithm: str, nodes: list[list[int]]) -> None:
    n, world = 3, sum(len(r) for r in nodes)
    reqs = {r: _req(pb.ALL_GATHER, n, out_count=n * world) for r in range(world)}
    ins = {r: np.full(n, r, dtype=np.float32) for r in range(world)}
    arenas = _execute(nodes, reqs, f"all_gather={algorithm}", ins)
    for r in range(world):
        got = arenas[r].view(reqs[r].output, np.dtype(np.float32)).tolist()
        assert got == [float(k // n) for k in range(n * world)], (algorithm, r)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS["barrier"]))
def test_execute_barrier(algorithm: str) -> None:
    reqs = {
        r: pb.OpRequest(request_id=1, seq=1, part=0, parts=1, kind=pb.BARRIER) for r in range(WORLD)
    }
    _execute(NODES, reqs, f"barrier={algorithm}", {})


def test_the_communicators_status_lists_the_choices() -> None:
    from smddp.server.communicator import Communicator

    specs = (NodeSpec("a", "10.0.0.1:1"), NodeSpec("b", "10.0.0.2:1"))
    comm = Communicator("j", "c", 4, b"k" * 32, 10.0, 4096, nodes=[[0, 1], [2, 3]], specs=specs)
    assert list(comm.status().algorithms) == []
    comm.algorithms.choose("all_reduce", 2, 4)
    comm.algorithms.choose("barrier", 2, 0)
    assert list(comm.status().algorithms) == [
        "all_reduce <= 4 B: recursive_doubling x1",
        "barrier <= 0 B: dissemination x1",
    ]
