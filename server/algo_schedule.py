"""The steps an algorithm between nodes is made of, and the loop that carries them out.

An algorithm (one module of this package per shape) is a generator of ``Step``s for one node:
send a range of the node's working buffer to a node, receive a range (copying it, or combining
it with what the buffer holds), or receive one range from every other node and fold them in
node order. ``run`` carries the steps out over real peers; ``algo_simulate`` runs the very same
generators against a modelled link. The working buffer is the node's partial (all_reduce), the
data (broadcast), the node-major blocks (all_gather) or nothing (barrier).

A step names its round: the frame's ``round`` field, which with the op's sequence number and
chunk and the sending node keys a message, so an algorithm numbers its rounds such that no
node sends two messages of one round to the same node.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from smddp.core.reduce import reduce_into

SEND = 0  # send buf[lo:hi] to ``peer``
RECV = 1  # buf[lo:hi] = what ``peer`` sent
REDUCE = 2  # buf[lo:hi] = incoming (op) buf[lo:hi] when ``first``, else buf[lo:hi] (op) incoming
FOLD = 3  # buf[lo:hi] = the ranges of every node, this one's included, folded in node order


class Step(NamedTuple):
    """One step of one node: ``op`` (SEND, RECV, REDUCE, FOLD) with ``peer`` over
    ``buf[lo:hi]`` in ``round``; ``first``: for REDUCE, the incoming operand goes first."""

    op: int
    peer: int
    round: int
    lo: int
    hi: int
    first: bool = False


@dataclass(frozen=True)
class Shape:
    """What an algorithm needs to know of one op's chunk on one node.

    Attributes:
        nodes: how many nodes take part.
        me: this node's index.
        count: elements of the working buffer.
        root: the root's node (broadcast).
        blocks: each node's block of the buffer, in node order (all_gather; sums to count).
        segments: how many pieces an algorithm that pipelines cuts its messages into.
    """

    nodes: int
    me: int
    count: int
    root: int = 0
    blocks: tuple[int, ...] = ()
    segments: int = 1


def bounds(n: int, parts: int) -> list[int]:
    """The boundaries of ``parts`` near-equal ranges covering ``range(n)``: part j is
    ``[b[j], b[j+1])``, the first parts the shorter ones (as the direct exchange cuts)."""
    return [n * j // parts for j in range(parts + 1)]


def piece(lo: int, hi: int, q: int, parts: int) -> tuple[int, int]:
    """Piece ``q`` of ``parts`` of the range ``[lo, hi)``."""
    return lo + (hi - lo) * q // parts, lo + (hi - lo) * (q + 1) // parts


class Exchange(Protocol):
    """What ``run`` needs of the other nodes: ``hierarchical._NodeChunk``, or a test's."""

    def send(self, node: int, round_: int, payloads: Sequence[np.ndarray]) -> None: ...

    def recv(self, node: int, round_: int, expect: int | None = None) -> np.ndarray: ...


def run(
    steps: Iterator[Step], x: Exchange, buf: np.ndarray, reduce_op: int, nodes: int, me: int
) -> None:
    """Carries out one node's ``steps`` over ``x`` on ``buf``.

    Every combination is ``reduce_into`` with divisor 1 (an AVG is divided once, by the caller,
    at the end), so each element's order of operations is the one the algorithm states.

    Raises:
        SmddpError: from the exchange: a peer's frame of the wrong op or size, a lost node.
    """
    for op, peer, round_, lo, hi, first in steps:
        if op == SEND:
            x.send(peer, round_, [buf[lo:hi]])
        elif op == RECV:
            buf[lo:hi] = x.recv(peer, round_, hi - lo)
        elif op == REDUCE:
            data = x.recv(peer, round_, hi - lo)
            mine = buf[lo:hi]
            reduce_into([mine], [data, mine] if first else [mine, data], reduce_op, divisor=1)
        else:
            parts = [buf[lo:hi] if i == me else x.recv(i, round_, hi - lo) for i in range(nodes)]
            reduce_into([buf[lo:hi]], parts, reduce_op, divisor=1)
