"""Dissemination barrier (Hensgen, Finkel and Manber): ceil(log2 N) rounds; in round k each
node sends an empty frame to node me + 2^k and waits for one from node me - 2^k. After the
last round every node has heard, directly or not, from every other."""

from __future__ import annotations

from collections.abc import Iterator

from smddp.server.algo_schedule import RECV, SEND, Shape, Step


def barrier(s: Shape) -> Iterator[Step]:
    """ceil(log2 N) rounds of one empty frame out and one in."""
    n, k, d = s.nodes, 0, 1
    while d < n:
        yield Step(SEND, (s.me + d) % n, k, 0, 0)
        yield Step(RECV, (s.me - d) % n, k, 0, 0)
        k, d = k + 1, d * 2
