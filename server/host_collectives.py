"""Carries out one matched chunk of a collective over the ranks' arenas.

Every function receives the ranks' requests in rank order (all of the same kind, dtype and
part, already matched) and their arenas, checks that the regions fit the op, and moves or
reduces the bytes. Layouts, with ``n`` the chunk's element count and ``W`` the world size:

- all_reduce: input n, output n (may be the same region);
- broadcast: input n on the root, output n everywhere (the root's may be its input);
- reduce: input n everywhere, output n on the root;
- all_gather / gather: input n, output W*n rank-major (gather: on the root only);
- reduce_scatter / scatter: input W*n rank-major (scatter: on the root only), output n;
- all_to_all: send_blocks[d] to rank d, recv_blocks[s] from rank s, sizes agreeing pairwise;
- send/recv: the sender's input to the receiver's output, equal sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from smddp.core.reduce import copy_into, reduce_into
from smddp.core.wire import describe_request, numpy_dtype
from smddp.server.arena import Arena
from smddp.server.errors import InvalidRequest
from smddp.v1 import smddp_pb2 as pb


def _views(
    arenas: Sequence[Arena], regions: Sequence[pb.Region], dtype: np.dtype
) -> list[np.ndarray]:
    return [a.view(r, dtype) for a, r in zip(arenas, regions)]


def _expect(
    views: Sequence[np.ndarray], sizes: Sequence[int], what: str, req: pb.OpRequest
) -> None:
    for rank, (v, n) in enumerate(zip(views, sizes)):
        if v.size != n:
            raise InvalidRequest(
                f"{describe_request(req)}: "
                f"rank {rank}'s {what} holds {v.size} elements of this chunk where {n} were expected (tensors of mismatched sizes?)"  # noqa: E501
            )


def execute(reqs: Sequence[pb.OpRequest], arenas: Sequence[Arena]) -> None:
    """Runs one chunk of a collective; ``reqs[r]`` and ``arenas[r]`` belong to rank ``r``.

    Raises:
        InvalidRequest: regions outside an arena or sizes that disagree across ranks.
    """
    req0 = reqs[0]
    kind = req0.kind
    if kind == pb.BARRIER or req0.direct:
        return
    dtype = numpy_dtype(req0.dtype)
    world = len(reqs)
    if kind == pb.ALL_TO_ALL:
        _all_to_all(reqs, arenas, dtype)
        return
    ins = _views(arenas, [r.input for r in reqs], dtype)
    outs = _views(arenas, [r.output for r in reqs], dtype)
    root = req0.root
    if kind == pb.ALL_REDUCE:
        n = ins[0].size
        _expect(ins, [n] * world, "input", req0)
        _expect(outs, [n] * world, "output", req0)
        reduce_into(outs, ins, req0.reduce_op)
    elif kind == pb.BROADCAST:
        n = ins[root].size
        _expect(outs, [n] * world, "output", req0)
        copy_into(outs, ins[root])
    elif kind == pb.REDUCE:
        n = ins[0].size
        _expect(ins, [n] * world, "input", req0)
        _expect(outs[root : root + 1], [n], "output", req0)
        reduce_into([outs[root]], ins, req0.reduce_op)
    elif kind in (pb.ALL_GATHER, pb.GATHER):
        n = ins[0].size
        _expect(ins, [n] * world, "input", req0)
        targets = outs if kind == pb.ALL_GATHER else [outs[root]]
        _expect(targets, [n * world] * len(targets), "output", req0)
        for r in range(world):
            copy_into([t[r * n : (r + 1) * n] for t in targets], ins[r])
    elif kind == pb.REDUCE_SCATTER:
        n = outs[0].size
        _expect(outs, [n] * world, "output", req0)
        _expect(ins, [n * world] * world, "input", req0)
        for d in range(world):
            reduce_into([outs[d]], [x[d * n : (d + 1) * n] for x in ins], req0.reduce_op)
    elif kind == pb.SCATTER:
        n = outs[0].size
        _expect(outs, [n] * world, "output", req0)
        _expect(ins[root : root + 1], [n * world], "input", req0)
        for d in range(world):
            copy_into([outs[d]], ins[root][d * n : (d + 1) * n])
    else:
        raise InvalidRequest(f"op kind {kind} cannot run as a collective")


def _all_to_all(reqs: Sequence[pb.OpRequest], arenas: Sequence[Arena], dtype: np.dtype) -> None:
    world = len(reqs)
    for r, req in enumerate(reqs):
        if len(req.send_blocks) != world or len(req.recv_blocks) != world:
            raise InvalidRequest(
                "all_to_all: "
                f"rank {r} gave {len(req.send_blocks)} send and {len(req.recv_blocks)} receive blocks for a world of {world}"  # noqa: E501
            )
    sends = [[arenas[s].view(b, dtype) for b in reqs[s].send_blocks] for s in range(world)]
    recvs = [[arenas[d].view(b, dtype) for b in reqs[d].recv_blocks] for d in range(world)]
    for s in range(world):
        for d in range(world):
            if sends[s][d].size != recvs[d][s].size:
                raise InvalidRequest(
                    "all_to_all: "
                    f"rank {s} sends {sends[s][d].size} elements to rank {d} in this chunk but rank {d} expects {recvs[d][s].size} from rank {s} (input and output split sizes disagree)"  # noqa: E501
                )
    for s in range(world):
        for d in range(world):
            copy_into([recvs[d][s]], sends[s][d])


def execute_p2p(send: pb.OpRequest, recv: pb.OpRequest, src: Arena, dst: Arena) -> None:
    """Copies one chunk of a send into the matching receive.

    Raises:
        InvalidRequest: sizes disagree or regions lie outside the arenas.
    """
    dtype = numpy_dtype(send.dtype)
    data = src.view(send.input, dtype)
    out = dst.view(recv.output, dtype)
    if data.size != out.size:
        raise InvalidRequest(
            f"send of {data.size} elements from rank {recv.root} meets a recv of {out.size} elements"  # noqa: E501
        )
    copy_into([out], data)
