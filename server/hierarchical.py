"""Hierarchical collectives: inside the node, among the node daemons, inside the node again.

One function per op kind runs one chunk on this node, given its local ranks' requests and
arenas. Network traffic is per node, not per rank: the local ranks' contributions are
combined first (reduced, or concatenated), then exchanged between the nodes.

all_reduce, broadcast, all_gather and barrier run between nodes the algorithm that the
communicator's ``algorithms.Selector`` picks for the op and chunk size (ring, halving-doubling,
recursive doubling, tree, chain, dissemination or the direct exchange; each module of
``server/algo_*`` states its reduction order); a caller that passes no selector gets the
direct exchange. Every element is computed exactly once, in an order fixed by the algorithm,
the ranks and the nodes, so every rank gets the same bits, and a rerun too. An AVG is summed,
then divided by the world size once, at the end. reduce, gather, scatter, reduce_scatter and
all_to_all exchange directly between node pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from smddp.core.reduce import copy_into, reduce_into
from smddp.core.wire import (
    WIRE_CODES,
    describe,
    describe_request,
    numpy_dtype,
    op_of,
    rank_list,
)
from smddp.server.algo_schedule import Shape, run
from smddp.server.algorithms import ALGORITHMS, Selector
from smddp.server.arena import Arena
from smddp.server.domain import Layout, spec_signature
from smddp.server.errors import InvalidRequest, OpMismatch
from smddp.server.peer_wire import FRAME_DATA, Frame
from smddp.v1 import smddp_pb2 as pb


class Peers(Protocol):
    """What the algorithms need of the other nodes: ``peer_transport.CommPeers``, or two
    in-memory peers in a test."""

    def send(
        self, node: int, ftype: int, req: pb.OpRequest | None, round_: int = 0,
        payloads: Sequence[np.ndarray | bytes] = (),
    ) -> None: ...  # fmt: skip

    def recv(self, seq: int, part: int, round_: int, node: int) -> Frame: ...


class _NodeChunk:
    """One chunk of one op on this node: the op, the layout and the exchange helpers that the
    functions below share."""

    def __init__(
        self,
        layout: Layout,
        peers: Peers,
        reqs: dict[int, pb.OpRequest],
        arenas: dict[int, Arena],
        selector: Selector | None = None,
    ) -> None:
        self.layout = layout
        self.peers = peers
        self.selector = selector
        self.node_ids = layout.node_ids()
        self.nodes = layout.nodes
        self.me = layout.my_node
        # The ranks whose data this node brings: all of the node's, or its lowest alone when
        # they combined it in the control region first (OpRequest.node_combined).
        self.local = list(reqs)
        self.reqs = reqs
        self.arenas = arenas
        self.req0 = reqs[self.local[0]]
        self.dtype = (
            numpy_dtype(self.req0.dtype) if self.req0.dtype in WIRE_CODES else np.dtype(np.uint8)
        )
        self.world = layout.world_size
        self.node_of = {r: i for i, ranks in enumerate(self.nodes) for r in ranks}

    def input(self, rank: int) -> np.ndarray:
        return self.arenas[rank].view(self.reqs[rank].input, self.dtype)

    def output(self, rank: int) -> np.ndarray:
        return self.arenas[rank].view(self.reqs[rank].output, self.dtype)

    def others(self) -> list[int]:
        return self.layout.others()

    def send(self, node: int, round_: int, payloads: Sequence[np.ndarray]) -> None:
        self.peers.send(node, FRAME_DATA, self.req0, round_, payloads)

    def recv(self, node: int, round_: int, expect: int | None = None) -> np.ndarray:
        frame = self.peers.recv(self.req0.seq, self.req0.part, round_, node)
        self._check(frame)
        data = frame.payload.view(self.dtype)
        if expect is not None and data.size != expect:
            raise InvalidRequest(
                f"{describe_request(self.req0)}: "
                f"node {self.node_ids[node]} sent {data.size} elements where this node expected {expect} (tensors of mismatched sizes?)"  # noqa: E501
            )
        return data

    def between_nodes(
        self, op: str, buf: np.ndarray, root: int = 0, blocks: tuple[int, ...] = ()
    ) -> None:
        """Runs ``op``'s algorithm between the nodes on this node's working buffer ``buf``."""
        nodes = len(self.nodes)
        name, segs = self.selector.choose(op, nodes, buf.nbytes) if self.selector else ("direct", 1)
        steps = ALGORITHMS[op][name](Shape(nodes, self.me, buf.size, root, blocks, segs))
        run(steps, self, buf, self.req0.reduce_op, nodes, self.me)

    def _check(self, frame: Frame) -> None:
        r = self.req0
        # Frames carry no ``direct``: an op that spans nodes never runs in the control region.
        if frame.signature() == spec_signature(op_of(r), r.parts):
            return
        theirs = describe(frame.op)
        node = frame.src_node
        who = f"{rank_list(list(self.nodes[node]))} (node {self.node_ids[node]})"
        ours = f"{rank_list(list(self.nodes[self.me]))} (node {self.node_ids[self.me]})"
        mine = describe_request(self.req0)
        raise OpMismatch(
            f"{self.layout.name()}: "
            f"{who} called {theirs} as op #{self.req0.seq} while {ours} called {mine}"
        )

    def same_sizes(self, arrays: Sequence[np.ndarray], n: int, what: str) -> None:
        for rank, a in zip(self.local, arrays):
            if a.size != n:
                raise InvalidRequest(
                    f"{describe_request(self.req0)}: "
                    f"rank {rank}'s {what} holds {a.size} elements of this chunk where {n} were expected (tensors of mismatched sizes?)"  # noqa: E501
                )


def execute(
    layout: Layout,
    peers: Peers,
    reqs: dict[int, pb.OpRequest],
    arenas: dict[int, Arena],
    selector: Selector | None = None,
) -> None:
    """Runs one chunk of a collective across the communicator's nodes.

    Args:
        layout: the communicator's ranks per node, which node this is, every node's id.
        peers: the other nodes (``CommPeers``).
        reqs, arenas: this node's ranks' requests and arenas, by rank.
        selector: the communicator's choice of algorithm; None runs the direct exchange.

    Raises:
        SmddpError: mismatched ops or sizes; PeerError: a node did not answer.
    """
    c = _NodeChunk(layout, peers, reqs, arenas, selector)
    run = _KINDS.get(c.req0.kind)
    if run is None:
        raise InvalidRequest(f"op kind {c.req0.kind} cannot run across nodes")
    run(c)


def _local(c: _NodeChunk, which: str) -> tuple[list[np.ndarray], int]:
    """This node's ranks' inputs or outputs (``which``), checked to hold one size; and the size."""
    arrays = [c.input(r) if which == "input" else c.output(r) for r in c.local]
    n = arrays[0].size
    c.same_sizes(arrays, n, which)
    return arrays, n


def _partial(c: _NodeChunk, inputs: Sequence[np.ndarray], n: int) -> np.ndarray:
    partial = np.empty(n, dtype=c.dtype)
    reduce_into([partial], inputs, c.req0.reduce_op, divisor=1)
    return partial


def _all_reduce(c: _NodeChunk) -> None:
    ins, n = _local(c, "input")
    outs = [c.output(r) for r in c.local]
    c.same_sizes(outs, n, "output")
    partial = _partial(c, ins, n)
    c.between_nodes("all_reduce", partial)
    if c.req0.reduce_op == pb.AVG:
        # Once, at the end, as reduce_into divides: every node divides the same bits alike.
        with np.errstate(all="ignore"):
            np.divide(partial, np.asarray(c.world, dtype=c.dtype), out=partial)
    copy_into(outs, partial)


def _broadcast(c: _NodeChunk) -> None:
    root_node = c.node_of[c.req0.root]
    outs = [c.output(r) for r in c.local]
    if root_node == c.me:
        # Combined in the region, the root's data came to the node's lowest rank.
        data = c.input(c.req0.root if c.req0.root in c.reqs else c.local[0])
    else:
        # Received straight into the first output (tree and chain forward from it).
        data = outs[0]
    c.between_nodes("broadcast", data, root=root_node)
    c.same_sizes(outs, data.size, "output")
    copy_into(outs, data)


def _reduce(c: _NodeChunk) -> None:
    root = c.req0.root
    root_node = c.node_of[root]
    ins, n = _local(c, "input")
    partial = _partial(c, ins, n)
    if root_node != c.me:
        c.send(root_node, 0, [partial])
        return
    parts = [partial if i == c.me else c.recv(i, 0, n) for i in range(len(c.nodes))]
    reduce_into([c.output(root)], parts, c.req0.reduce_op, divisor=c.world)


def _gather(c: _NodeChunk) -> None:
    ins, n = _local(c, "input")
    root_node = c.node_of[c.req0.root]
    targets = [c.req0.root] if root_node == c.me else []
    outs = [c.output(r) for r in targets]
    for out in outs:
        if out.size != n * c.world:
            raise InvalidRequest(
                f"{describe_request(c.req0)}: "
                f"an output holds {out.size} elements, not {n * c.world}"
            )
    receivers = [root_node] if root_node != c.me else []
    for j in receivers:
        c.send(j, 0, ins)
    for rank, x in zip(c.local, ins):
        copy_into([o[rank * n : (rank + 1) * n] for o in outs], x)
    if not outs:
        return
    for i in c.others():
        data = c.recv(i, 0, n * len(c.nodes[i]))
        for k, rank in enumerate(c.nodes[i]):
            copy_into([o[rank * n : (rank + 1) * n] for o in outs], data[k * n : (k + 1) * n])


def _all_gather(c: _NodeChunk) -> None:
    ins, n = _local(c, "input")
    outs = [c.output(r) for r in c.local]
    for out in outs:
        if out.size != n * c.world:
            raise InvalidRequest(
                f"{describe_request(c.req0)}: "
                f"an output holds {out.size} elements, not {n * c.world}"
            )
    # The nodes' blocks in node order: the output itself when that is rank order.
    order = [r for ranks in c.nodes for r in ranks]
    contiguous = order == list(range(c.world))
    buf = outs[0] if contiguous else np.empty(n * c.world, dtype=c.dtype)
    start = n * sum(len(ranks) for ranks in c.nodes[: c.me])
    for k, x in enumerate(ins):
        buf[start + k * n : start + (k + 1) * n] = x
    c.between_nodes("all_gather", buf, blocks=tuple(n * len(ranks) for ranks in c.nodes))
    if contiguous:
        copy_into(outs, buf)
        return
    for k, rank in enumerate(order):
        copy_into([o[rank * n : (rank + 1) * n] for o in outs], buf[k * n : (k + 1) * n])


def _scatter(c: _NodeChunk) -> None:
    root = c.req0.root
    root_node = c.node_of[root]
    outs, n = _local(c, "output")
    if root_node == c.me:
        data = c.input(root)
        if data.size != n * c.world:
            raise InvalidRequest(
                f"{describe_request(c.req0)}: "
                f"the root's input holds {data.size} elements, not {n * c.world}"
            )
        for j in c.others():
            c.send(j, 0, [data[r * n : (r + 1) * n] for r in c.nodes[j]])
        for rank, out in zip(c.local, outs):
            copy_into([out], data[rank * n : (rank + 1) * n])
    else:
        data = c.recv(root_node, 0, n * len(c.local))
        for k, out in enumerate(outs):
            copy_into([out], data[k * n : (k + 1) * n])


def _reduce_scatter(c: _NodeChunk) -> None:
    outs, n = _local(c, "output")
    ins = [c.input(r) for r in c.local]
    c.same_sizes(ins, n * c.world, "input")
    partials = []
    for ranks in c.nodes:
        p = np.empty(n * len(ranks), dtype=c.dtype)
        for k, d in enumerate(ranks):
            reduce_into(
                [p[k * n : (k + 1) * n]],
                [x[d * n : (d + 1) * n] for x in ins],
                c.req0.reduce_op,
                divisor=1,
            )
        partials.append(p)
    for j in c.others():
        c.send(j, 0, [partials[j]])
    parts = [
        partials[c.me] if i == c.me else c.recv(i, 0, n * len(c.local)) for i in range(len(c.nodes))
    ]
    for k, out in enumerate(outs):
        reduce_into(
            [out], [p[k * n : (k + 1) * n] for p in parts], c.req0.reduce_op, divisor=c.world
        )


def _all_to_all(c: _NodeChunk) -> None:
    w = c.world
    for rank in c.local:
        req = c.reqs[rank]
        if len(req.send_blocks) != w or len(req.recv_blocks) != w:
            raise InvalidRequest(
                f"all_to_all: rank {rank} gave the wrong number of blocks for a world of {w}"
            )
    sends = {s: [c.arenas[s].view(b, c.dtype) for b in c.reqs[s].send_blocks] for s in c.local}
    recvs = {d: [c.arenas[d].view(b, c.dtype) for b in c.reqs[d].recv_blocks] for d in c.local}
    for j in c.others():
        c.send(j, 0, [sends[s][d] for s in c.local for d in c.nodes[j]])
    for s in c.local:
        for d in c.local:
            if sends[s][d].size != recvs[d][s].size:
                raise InvalidRequest(
                    "all_to_all: "
                    f"rank {s} sends {sends[s][d].size} elements to rank {d} but rank {d} expects {recvs[d][s].size} (input and output split sizes disagree)"  # noqa: E501
                )
            copy_into([recvs[d][s]], sends[s][d])
    for i in c.others():
        expect = sum(recvs[d][s].size for s in c.nodes[i] for d in c.local)
        data = c.recv(i, 0)
        if data.size != expect:
            raise InvalidRequest(
                "all_to_all: "
                f"{rank_list(c.nodes[i])} sent {data.size} elements to {rank_list(c.local)} which expect {expect} (input and output split sizes disagree)"  # noqa: E501
            )
        off = 0
        for s in c.nodes[i]:
            for d in c.local:
                size = recvs[d][s].size
                copy_into([recvs[d][s]], data[off : off + size])
                off += size


def _barrier(c: _NodeChunk) -> None:
    c.between_nodes("barrier", np.empty(0, dtype=np.uint8))


_KINDS: dict[int, Callable[[_NodeChunk], None]] = {
    pb.ALL_REDUCE: _all_reduce,
    pb.BROADCAST: _broadcast,
    pb.REDUCE: _reduce,
    pb.ALL_GATHER: _all_gather,
    pb.GATHER: _gather,
    pb.SCATTER: _scatter,
    pb.REDUCE_SCATTER: _reduce_scatter,
    pb.ALL_TO_ALL: _all_to_all,
    pb.BARRIER: _barrier,
}
