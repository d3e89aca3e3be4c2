"""Recursive doubling and recursive halving-doubling all_reduce, with the fold for a node
count that is not a power of two (Thakur, Rabenseifner and Gropp, 2005; gloo's
allreduce_halving_doubling).

Fold: with P the largest power of two not above N and r = N - P, node 2i (i < r) sends its
partial to node 2i+1, which reduces ``p_2i (op) p_2i+1`` and takes part as virtual rank i;
node j >= 2r takes part as virtual rank j - r. At the end node 2i+1 sends the result back.

- recursive doubling (small ops): log2 P steps; at step k virtual ranks v and v ^ 2^k swap
  their whole partials and both combine them, the lower group's first.
- halving-doubling (medium and large): a reduce-scatter by recursive halving (at step k
  partners v and v ^ 2^k keep one half of their current range each, the lower v the lower
  half, and combine the other's, lower group first), then an all-gather retracing the steps.

Both reduce every element as the same balanced binary tree over virtual ranks in node order,
``((q0 (op) q1) (op) (q2 (op) q3)) ...`` with q the folded partials, so they give the same
bits as each other. For N = 2 and N = 3 the tree is ``(p0 (op) p1)`` and
``((p0 (op) p1) (op) p2)``: node order, as the direct exchange.
"""

from __future__ import annotations

from collections.abc import Iterator

from smddp.server.algo_schedule import RECV, REDUCE, SEND, Shape, Step


def _fold(s: Shape) -> tuple[int, int, int]:
    """(P, r, this node's virtual rank or -1 when it folds out)."""
    p = 1 << (s.nodes.bit_length() - 1)
    r = s.nodes - p
    if s.me < 2 * r:
        return p, r, s.me // 2 if s.me % 2 else -1
    return p, r, s.me - r


def _node(v: int, r: int) -> int:
    return 2 * v + 1 if v < r else v + r


def recursive_doubling(s: Shape) -> Iterator[Step]:
    """log2 P exchanges of the whole buffer (plus the fold's two)."""
    p, r, v = _fold(s)
    steps = p.bit_length() - 1
    last = steps + 1  # the round of the unfold
    if v < 0:
        yield Step(SEND, s.me + 1, 0, 0, s.count)
        yield Step(RECV, s.me + 1, last, 0, s.count)
        return
    if s.me < 2 * r:
        yield Step(REDUCE, s.me - 1, 0, 0, s.count, True)
    for k in range(steps):
        w = v ^ (1 << k)
        yield Step(SEND, _node(w, r), 1 + k, 0, s.count)
        yield Step(REDUCE, _node(w, r), 1 + k, 0, s.count, w < v)
    if s.me < 2 * r:
        yield Step(SEND, s.me - 1, last, 0, s.count)


def halving_doubling(s: Shape) -> Iterator[Step]:
    """Reduce-scatter by recursive halving, all-gather by recursive doubling."""
    p, r, v = _fold(s)
    steps = p.bit_length() - 1
    last = 2 * steps + 1
    if v < 0:
        yield Step(SEND, s.me + 1, 0, 0, s.count)
        yield Step(RECV, s.me + 1, last, 0, s.count)
        return
    if s.me < 2 * r:
        yield Step(REDUCE, s.me - 1, 0, 0, s.count, True)
    lo, hi = 0, s.count
    given: list[tuple[int, int]] = []
    for k in range(steps):
        w = v ^ (1 << k)
        mid = lo + (hi - lo) // 2
        keep, give = ((lo, mid), (mid, hi)) if w > v else ((mid, hi), (lo, mid))
        yield Step(SEND, _node(w, r), 1 + k, *give)
        yield Step(REDUCE, _node(w, r), 1 + k, *keep, w < v)
        given.append(give)
        lo, hi = keep
    for k in reversed(range(steps)):
        w = v ^ (1 << k)
        yield Step(SEND, _node(w, r), 1 + 2 * steps - 1 - k, lo, hi)
        glo, ghi = given.pop()
        yield Step(RECV, _node(w, r), 1 + 2 * steps - 1 - k, glo, ghi)
        lo, hi = min(lo, glo), max(hi, ghi)
    if s.me < 2 * r:
        yield Step(SEND, s.me - 1, last, 0, s.count)
