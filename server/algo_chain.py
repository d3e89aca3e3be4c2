"""Pipelined chain broadcast: root -> root+1 -> ... -> root-1, in ``segments`` pieces.

Each node forwards piece q as soon as it has it, so N + segments - 2 piece-times in all:
for large data about the time of sending it once (S/B), whatever the node count.
"""

from __future__ import annotations

from collections.abc import Iterator

from smddp.server.algo_schedule import RECV, SEND, Shape, Step, piece


def broadcast(s: Shape) -> Iterator[Step]:
    """Receive each piece from the previous node, pass it to the next."""
    n, segs = s.nodes, max(1, s.segments)
    vr = (s.me - s.root) % n
    prev, nxt = (s.me - 1) % n, (s.me + 1) % n
    for q in range(segs):
        lo, hi = piece(0, s.count, q, segs)
        if vr > 0:
            yield Step(RECV, prev, q, lo, hi)
        if vr < n - 1:
            yield Step(SEND, nxt, q, lo, hi)
