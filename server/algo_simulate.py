"""Runs the algorithms' own step generators over a modelled link: the time an op would take
on N nodes, without sending a byte.

The model is ``algo_cost``'s: a message of b bytes holds its sender's link for alpha + b beta and
arrives when it leaves it; a node's messages leave one after another; combining b bytes
costs the receiver gamma b; a node waits at a receive until the message arrived. No data
is moved, so an op of any size runs: steps carry element ranges, times ``itemsize`` bytes.
"""

from __future__ import annotations

from collections import deque

from smddp.server.algo_cost import CostModel
from smddp.server.algo_schedule import FOLD, RECV, REDUCE, SEND, Shape, Step
from smddp.server.algorithms import ALGORITHMS


def simulate(
    model: CostModel,
    op: str,
    algorithm: str,
    nodes: int,
    count: int,
    itemsize: int = 4,
    segments: int = 1,
    root: int = 0,
) -> float:
    """Seconds until the last node finishes ``algorithm`` for ``op`` on a buffer of ``count``
    elements of ``itemsize`` bytes (for all_gather: ``count`` per node).

    Raises:
        RuntimeError: the steps deadlock (a receive no node ever sends): a bug in an algorithm.
    """
    blocks: tuple[int, ...] = ()
    if op == "all_gather":
        blocks, count = (count,) * nodes, count * nodes
    gens = [
        ALGORITHMS[op][algorithm](Shape(nodes, i, count, root, blocks, segments))
        for i in range(nodes)
    ]
    clock = [0.0] * nodes  # when each node is free to take its next step
    link = [0.0] * nodes  # when each node's link is free
    sent: dict[tuple[int, int, int], float] = {}  # (src, dst, round) -> arrival time
    waiting: dict[tuple[int, int, int], int] = {}  # the node blocked on that message
    current: list[Step | None] = [None] * nodes
    ready = deque(range(nodes))
    done = 0
    while ready:
        i = ready.popleft()
        gen = gens[i]
        while True:
            step = current[i] if current[i] is not None else next(gen, None)
            current[i] = None
            if step is None:
                done += 1
                break
            op_, peer, round_, lo, hi, _ = step
            nbytes = (hi - lo) * itemsize
            if op_ == SEND:
                start = max(clock[i], link[i])
                link[i] = start + model.msg(nbytes)
                key = (i, peer, round_)
                sent[key] = link[i]
                clock[i] = start + model.alpha
                waiter = waiting.pop(key, None)
                if waiter is not None:
                    ready.append(waiter)
                continue
            sources = [j for j in range(nodes) if j != i] if op_ == FOLD else [peer]
            missing = [j for j in sources if (j, i, round_) not in sent]
            if missing:
                waiting[(missing[0], i, round_)] = i
                current[i] = step
                break
            arrived = max(sent.pop((j, i, round_)) for j in sources)
            clock[i] = max(clock[i], arrived)
            if op_ == REDUCE:
                clock[i] += model.gamma * nbytes
            elif op_ == FOLD:
                clock[i] += model.gamma * nbytes * (nodes - 1)
            else:
                assert op_ == RECV
    if done != nodes:
        raise RuntimeError(f"{op} {algorithm} on {nodes} nodes: {nodes - done} nodes never finish")
    return max(max(clock), max(link))
