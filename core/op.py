"""An op as smddp carries it: what a rank asked for, made once where a call enters smddp.

``OpSpec`` holds an op's kind, wire dtype, element count, root, reduce op and tag; the client
builds one per collective in its public method and hands that one down to the path that runs
it (the control region, the direct path, the daemon's requests), and the daemon reads one
from each request and peer frame. ``OpSpec.signature`` is what the ranks of one op must agree
on, wherever they compare it (in the control region, at the daemon, between nodes).

``OpKind``, ``DType`` and ``ReduceOp`` name the protobuf enums' values (``smddp.v1``): an
IntEnum member *is* its wire int, so a spec travels to the wire unchanged
(``core.wire.op_request`` and ``op_of`` convert to and from ``pb.OpRequest``). This module
imports no protobuf: the backend and a user's script name reduce ops and dtypes through it.

A NamedTuple, not a dataclass: a collective on one node takes 10-70 µs, and building a
NamedTuple costs a few hundred nanoseconds where a frozen dataclass's ``__init__`` costs
several times that (it sets each field through ``object.__setattr__``).
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple


class OpKind(IntEnum):
    """A collective's kind; the values are ``smddp.v1.OpKind``'s."""

    OP_KIND_UNSPECIFIED = 0
    ALL_REDUCE = 1
    BROADCAST = 2
    REDUCE = 3
    ALL_GATHER = 4
    REDUCE_SCATTER = 5
    ALL_TO_ALL = 6
    GATHER = 7
    SCATTER = 8
    BARRIER = 9
    SEND = 10
    RECV = 11


class DType(IntEnum):
    """An element type the wire carries; the values are ``smddp.v1.DType``'s."""

    DTYPE_UNSPECIFIED = 0
    FLOAT16 = 1
    BFLOAT16 = 2
    FLOAT32 = 3
    FLOAT64 = 4
    INT8 = 5
    UINT8 = 6
    INT16 = 7
    INT32 = 8
    INT64 = 9
    BOOL = 10


class ReduceOp(IntEnum):
    """How a reducing collective combines the ranks' elements; the values are
    ``smddp.v1.ReduceOp``'s (``REDUCE_OP_UNSPECIFIED``: the op reduces nothing)."""

    REDUCE_OP_UNSPECIFIED = 0
    SUM = 1
    AVG = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5
    BAND = 6
    BOR = 7
    BXOR = 8


# Plain ints: a set of ints answers ``in`` faster than a set of IntEnum members is built.
_ROOTED = frozenset({OpKind.BROADCAST.value, OpKind.REDUCE.value, OpKind.GATHER.value,
                     OpKind.SCATTER.value})  # fmt: skip
_REDUCING = frozenset({OpKind.ALL_REDUCE.value, OpKind.REDUCE.value,
                       OpKind.REDUCE_SCATTER.value})  # fmt: skip
_ALL_TO_ALL = OpKind.ALL_TO_ALL.value
_BARRIER = OpKind.BARRIER.value

# (kind, dtype, count, root, reduce op): what the ranks of one op must agree on.
Signature = tuple[int, int, int, int, int]


class OpSpec(NamedTuple):
    """One op as a rank called it.

    Fields hold wire ints (an enum member or the int it equals): ``kind`` an ``OpKind``,
    ``dtype`` a ``DType`` (``DTYPE_UNSPECIFIED`` for a barrier), ``elements`` the elements
    per rank (an all_to_all's: every block this rank sends, together; the wire's ``count``;
    a NamedTuple's ``count`` is tuple's method), ``root`` the root rank of
    a rooted collective or the peer of a send or receive (0 where unused), ``reduce_op`` a
    ``ReduceOp`` (``REDUCE_OP_UNSPECIFIED`` where unused), ``tag`` a send's or receive's tag.
    """

    kind: int
    dtype: int
    elements: int
    root: int = 0
    reduce_op: int = 0
    tag: int = 0

    def signature(self) -> Signature:
        """What every rank's call of this op must agree on, on one node and across nodes.

        Fields the kind does not use are 0, so that ranks which fill them differently still
        match; an all_to_all's element count is 0, as its ranks may send different totals
        (its blocks are checked pairwise). The tag is left out: only sends and receives
        carry one, and they are matched pairwise. A spec the client built has 0 in every
        unused field already, so its signature equals its first five fields but for an
        all_to_all's.
        """
        kind, dtype, elements, root, reduce_op, _ = self
        return (
            kind,
            0 if kind == _BARRIER else dtype,
            0 if kind == _ALL_TO_ALL else elements,
            root if kind in _ROOTED else 0,
            reduce_op if kind in _REDUCING else 0,
        )


BARRIER = OpSpec(OpKind.BARRIER, DType.DTYPE_UNSPECIFIED, 0)
