"""Direct exchange: every node talks to every other node in one round per phase.

What smddp ran before the algorithms were chosen by cost; kept as the choice for few nodes
and as ``SMDDP_ALGO=direct``. Each node sends to the others in the order me+1, me+2, ...
(wrapping), so that no node is everyone's first receiver.

- all_reduce: node j reduces segment j (``bounds(count, N)``) of every node's partial, then
  sends it to all. Reduction order: ``((p0 (op) p1) (op) p2) ...``, every node's partial in
  node order, which is the order the multi-node tests' reference follows.
- broadcast: a star, the root sends the whole buffer to each node.
- all_gather: each node sends its block to every other node.
- barrier: an empty frame to every other node, then one from each.
"""

from __future__ import annotations

from collections.abc import Iterator

from smddp.server.algo_schedule import FOLD, RECV, SEND, Shape, Step, bounds


def _order(s: Shape) -> list[int]:
    return [(s.me + k) % s.nodes for k in range(1, s.nodes)]


def all_reduce(s: Shape) -> Iterator[Step]:
    """Reduce-scatter then all-gather, both direct; node order reduction."""
    b = bounds(s.count, s.nodes)
    for j in _order(s):
        yield Step(SEND, j, 0, b[j], b[j + 1])
    yield Step(FOLD, -1, 0, b[s.me], b[s.me + 1])
    for j in _order(s):
        yield Step(SEND, j, 1, b[s.me], b[s.me + 1])
    for i in range(s.nodes):
        if i != s.me:
            yield Step(RECV, i, 1, b[i], b[i + 1])


def broadcast(s: Shape) -> Iterator[Step]:
    """The root sends the whole buffer to every other node."""
    if s.me == s.root:
        for j in _order(s):
            yield Step(SEND, j, 0, 0, s.count)
    else:
        yield Step(RECV, s.root, 0, 0, s.count)


def all_gather(s: Shape) -> Iterator[Step]:
    """Each node's block to every other node."""
    off = [0]
    for size in s.blocks:
        off.append(off[-1] + size)
    for j in _order(s):
        yield Step(SEND, j, 0, off[s.me], off[s.me + 1])
    for i in range(s.nodes):
        if i != s.me:
            yield Step(RECV, i, 0, off[i], off[i + 1])


def barrier(s: Shape) -> Iterator[Step]:
    """An empty frame to every other node, then one from each."""
    for j in _order(s):
        yield Step(SEND, j, 0, 0, 0)
    for i in range(s.nodes):
        if i != s.me:
            yield Step(RECV, i, 0, 0, 0)
