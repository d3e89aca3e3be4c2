"""Binomial-tree broadcast (MPICH's): ceil(log2 N) rounds, each node receiving once.

With ranks relative to the root (vr = (node - root) mod N), node vr receives from
vr - 2^j, 2^j its lowest set bit, then sends to vr + 2^i for each i < j (the largest subtree
first). The root sends log2 N times the data, where the star sent N-1 times.
"""

from __future__ import annotations

from collections.abc import Iterator

from smddp.server.algo_schedule import RECV, SEND, Shape, Step


def broadcast(s: Shape) -> Iterator[Step]:
    """Receive from the parent, then send to the children, largest subtree first."""
    n = s.nodes
    vr = (s.me - s.root) % n
    mask = 1
    while mask < n:
        if vr & mask:
            yield Step(RECV, (vr - mask + s.root) % n, 0, 0, s.count)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vr + mask < n:
            yield Step(SEND, (vr + mask + s.root) % n, 0, 0, s.count)
        mask >>= 1
