"""Ring: each node sends only to the next node (me+1) and receives only from the previous one.

- all_reduce: reduce-scatter then all-gather around the ring, 2 (N-1) steps, each node
  sending 2 (N-1)/N of the data, the bandwidth optimum; every step's block is cut into
  ``segments`` pieces sent one after another, so a node forwards piece q while piece q+1 is
  still arriving (several pieces in flight, the reduction overlapping the transfer).
  Segment k (``bounds(count, N)``) starts at node k+1 and ends, reduced, at node k; at node i
  the arriving partial goes first while the chain has not wrapped past node N-1
  (``acc (op) p_i`` for i > k+1), and second once it has (``p_i (op) acc`` for i <= k). So
  segment k is ``p_k (op) (... (p_1 (op) (p_0 (op) ((p_{k+1} (op) p_{k+2}) ... p_{N-1}))))``:
  for N = 2 that is ``p_0 (op) p_1``, node order; from N = 3 on it is not (the cost model
  does not pick the ring below 4 nodes, where it gains nothing on the direct exchange).
- all_gather: node i's block travels the ring, N-1 steps.
"""

from __future__ import annotations

from collections.abc import Iterator

from smddp.server.algo_schedule import RECV, REDUCE, SEND, Shape, Step, bounds, piece


def all_reduce(s: Shape) -> Iterator[Step]:
    """Pipelined ring reduce-scatter and all-gather."""
    n, me, segs = s.nodes, s.me, max(1, s.segments)
    b = bounds(s.count, n)
    right, left = (me + 1) % n, (me - 1) % n

    def sub(k: int, q: int) -> tuple[int, int]:
        return piece(b[k], b[k + 1], q, segs)

    # Reduce-scatter: at step t node me receives segment (me - 2 - t) and passes it on.
    for q in range(segs):
        yield Step(SEND, right, q, *sub((me - 1) % n, q))
    for t in range(n - 1):
        k = (me - 2 - t) % n
        first = (k + 1) % n < me  # the chain started below this node: not wrapped yet
        for q in range(segs):
            yield Step(REDUCE, left, t * segs + q, *sub(k, q), first)
            if t < n - 2:
                yield Step(SEND, right, (t + 1) * segs + q, *sub(k, q))
    # All-gather: node me now holds segment me, reduced.
    base = (n - 1) * segs
    for q in range(segs):
        yield Step(SEND, right, base + q, *sub(me, q))
    for t in range(n - 1):
        k = (me - 1 - t) % n
        for q in range(segs):
            yield Step(RECV, left, base + t * segs + q, *sub(k, q))
            if t < n - 2:
                yield Step(SEND, right, base + (t + 1) * segs + q, *sub(k, q))


def all_gather(s: Shape) -> Iterator[Step]:
    """Node i's block goes round the ring: N-1 steps."""
    n, me = s.nodes, s.me
    off = [0]
    for size in s.blocks:
        off.append(off[-1] + size)
    right, left = (me + 1) % n, (me - 1) % n
    for t in range(n - 1):
        k = (me - t) % n
        yield Step(SEND, right, t, off[k], off[k + 1])
        k = (me - 1 - t) % n
        yield Step(RECV, left, t, off[k], off[k + 1])
