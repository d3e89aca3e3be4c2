"""Predicted time of each algorithm between nodes, and the choice of the fastest.

The model (the one ``algo_simulate`` runs step by step): a message of b bytes occupies its sender's
link for ``alpha + b * beta`` (alpha: the per-message cost, mostly the daemons' software;
beta: seconds per byte of the node's link), messages leave a node one after another and
arrive when sent; combining b bytes costs ``gamma * b`` of the receiving node's time. The
closed forms below follow each algorithm's critical path under that model, as NCCL's
``tuning.cc`` does for its ring and tree (latency per step plus bytes over bandwidth).

The constants start as measured on this project's test machine (daemons over loopback and
network namespaces, Python transport); ``CostModel.fit`` turns measured round trips into
alpha and beta. The choice must be the same on every node of a communicator, so a model fed
with measurements must be fed the same values everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Per message: a frame through the daemons' Python transport costs about 0.1 ms of CPU per
# peer (issue 32: 0.15 ms per extra peer for a 4-byte all_reduce, send and receive).
ALPHA_S = 100e-6
# Per byte of a node's link: about 1 GB/s between daemons over loopback TCP here.
BETA_S_PER_BYTE = 1e-9
# Per byte combined: numpy's add of two float32 arrays, about 2 GB/s of input here.
GAMMA_S_PER_BYTE = 0.5e-9
# The ring cuts each of its blocks into at most this many pieces, the chain its whole message
# into at most CHAIN_MAX_SEGMENTS (its pipeline is N long: it wants about sqrt(N S beta /
# alpha) pieces), none below MIN_PIECE_BYTES: a piece costs alpha, which more would outweigh.
MAX_SEGMENTS = 16
CHAIN_MAX_SEGMENTS = 4096
MIN_PIECE_BYTES = 64 << 10


@dataclass(frozen=True)
class CostModel:
    """alpha (s per message), beta (s per byte), gamma (s per byte combined)."""

    alpha: float = ALPHA_S
    beta: float = BETA_S_PER_BYTE
    gamma: float = GAMMA_S_PER_BYTE

    def msg(self, nbytes: float) -> float:
        """Seconds one message of ``nbytes`` holds its sender's link."""
        return self.alpha + nbytes * self.beta

    @classmethod
    def fit(
        cls, samples: Sequence[tuple[int, float]], gamma: float = GAMMA_S_PER_BYTE
    ) -> CostModel:
        """alpha and beta from one-way times of messages of several sizes (half a ping-pong's
        round trip), by least squares; at least two sizes.

        Raises:
            ValueError: fewer than two distinct sizes, or a fit that is not positive.
        """
        xs = [float(b) for b, _ in samples]
        ys = [t for _, t in samples]
        if len(set(xs)) < 2:
            raise ValueError("fitting alpha and beta needs samples of at least two sizes")
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        alpha = my - beta * mx
        if alpha <= 0 or beta <= 0:
            raise ValueError(f"the samples give alpha {alpha:.3g} s and beta {beta:.3g} s/B")
        return cls(alpha, beta, gamma)


def _log2(n: int) -> int:
    return max(0, (n - 1).bit_length())  # ceil(log2 n)


def segments_for(nbytes: int, parts: int = MAX_SEGMENTS) -> list[int]:
    """The piece counts worth trying for messages of ``nbytes``: 1, 2, 4, ... up to ``parts``
    while a piece stays at least MIN_PIECE_BYTES."""
    out, s = [1], 2
    while s <= parts and nbytes // s >= MIN_PIECE_BYTES:
        out.append(s)
        s *= 2
    return out


# -- all_reduce ----------------------------------------------------------------------------


def all_reduce_direct(m: CostModel, n: int, nbytes: int, segments: int = 1) -> float:
    c = nbytes / n
    return 2 * (n - 1) * m.msg(c) + (n - 1) * c * m.gamma


def all_reduce_ring(m: CostModel, n: int, nbytes: int, segments: int = 1) -> float:
    c = nbytes / n / segments
    # A reduce-scatter step takes its pieces' link time, or one piece's hop plus its
    # reduction when that is longer (a piece cannot go on before it is reduced).
    rs = max(segments * m.msg(c), m.msg(c) + c * m.gamma)
    return (n - 1) * rs + (n - 1) * segments * m.msg(c) + c * m.gamma


def _fold_cost(m: CostModel, n: int, nbytes: int) -> float:
    p = 1 << (n.bit_length() - 1)
    return 0.0 if p == n else 2 * m.msg(nbytes) + nbytes * m.gamma


def all_reduce_recursive_doubling(m: CostModel, n: int, nbytes: int, segments: int = 1) -> float:
    steps = n.bit_length() - 1
    return _fold_cost(m, n, nbytes) + steps * (m.msg(nbytes) + nbytes * m.gamma)


def all_reduce_halving_doubling(m: CostModel, n: int, nbytes: int, segments: int = 1) -> float:
    steps = n.bit_length() - 1
    t = _fold_cost(m, n, nbytes)
    for k in range(steps):
        half = nbytes / 2 ** (k + 1)
        t += 2 * m.msg(half) + half * m.gamma
    return t


# -- broadcast, all_gather, barrier ---------------------------------------------------------


def broadcast_direct(m: CostModel, n: int, nbytes: int, segments: int = 1) -> float:
    return (n - 1) * m.msg(nbytes)


def broadcast_tree(m: CostModel, n: int, nbytes: int, segments: int = 1) -> float:
    return _log2(n) * m.msg(nbytes)


def broadcast_chain(m: CostModel, n: int, nbytes: int, segments: int = 1) -> float:
    return (n + segments - 2) * m.msg(nbytes / segments)


def all_gather_direct(m: CostModel, n: int, nbytes: int, segments: int = 1) -> float:
    return (n - 1) * m.msg(nbytes / n)


def all_gather_ring(m: CostModel, n: int, nbytes: int, segments: int = 1) -> float:
    return (n - 1) * m.msg(nbytes / n)


def barrier_direct(m: CostModel, n: int, nbytes: int = 0, segments: int = 1) -> float:
    return (n - 1) * m.alpha


def barrier_dissemination(m: CostModel, n: int, nbytes: int = 0, segments: int = 1) -> float:
    return _log2(n) * m.alpha


Predictor = Callable[[CostModel, int, int, int], float]

# Per op, the algorithms in order of preference on a tie (the one with fewer peers per
# node first), each with its prediction and whether it cuts its messages into pieces.
PREDICTIONS: dict[str, dict[str, tuple[Predictor, bool]]] = {
    "all_reduce": {
        "recursive_doubling": (all_reduce_recursive_doubling, False),
        "halving_doubling": (all_reduce_halving_doubling, False),
        "ring": (all_reduce_ring, True),
        "direct": (all_reduce_direct, False),
    },
    "broadcast": {
        "tree": (broadcast_tree, False),
        "chain": (broadcast_chain, True),
        "direct": (broadcast_direct, False),
    },
    "all_gather": {"ring": (all_gather_ring, False), "direct": (all_gather_direct, False)},
    "barrier": {"dissemination": (barrier_dissemination, False), "direct": (barrier_direct, False)},
}


def ring_allowed(nodes: int) -> bool:
    """Below 4 nodes a ring step is a direct exchange made sequential, and the ring's
    reduction order is not node order: the model leaves it out (``SMDDP_ALGO`` may pin it)."""
    return nodes >= 4


def predict(m: CostModel, op: str, algorithm: str, nodes: int, nbytes: int) -> tuple[float, int]:
    """The predicted seconds of ``algorithm`` for ``op`` over ``nodes`` nodes and ``nbytes``
    bytes (the working buffer of one node), and the piece count that gives it."""
    fn, pieced = PREDICTIONS[op][algorithm]
    if not pieced:
        return fn(m, nodes, nbytes, 1), 1
    if op == "all_reduce":
        tries = segments_for(nbytes // nodes)
    else:
        tries = segments_for(nbytes, CHAIN_MAX_SEGMENTS)
    best = min((fn(m, nodes, nbytes, s), s) for s in tries)
    return best


def choose(m: CostModel, op: str, nodes: int, nbytes: int) -> tuple[str, int, float]:
    """The algorithm with the least predicted time (ties to the earlier in PREDICTIONS):
    its name, piece count and prediction."""
    best: tuple[str, int, float] | None = None
    for name in PREDICTIONS[op]:
        if name == "ring" and op == "all_reduce" and not ring_allowed(nodes):
            continue
        t, segs = predict(m, op, name, nodes, nbytes)
        if best is None or t < best[2]:
            best = (name, segs, t)
    assert best is not None
    return best


def nccl_ring_all_reduce(m: CostModel, n: int, nbytes: int) -> float:
    """NCCL's ring formula (tuning.cc): 2 (N-1) step latencies plus 2 (N-1)/N bytes per link."""
    return 2 * (n - 1) * m.alpha + 2 * (n - 1) / n * nbytes * m.beta


def nccl_tree_all_reduce(m: CostModel, n: int, nbytes: int) -> float:
    """NCCL's tree formula (tuning.cc): 2 log2 N step latencies (up and down the tree) and
    the bytes at half the bus bandwidth (its ``ratio = .5``): twice the data per link."""
    return 2 * math.log2(n) * m.alpha + 2 * nbytes * m.beta
