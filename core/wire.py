"""What the daemon and its clients both know about the wire: dtypes, op names, framing.

Both sides import this module; it depends on nothing but numpy, ml_dtypes and the
generated stubs, so the daemon stays free of torch. ml_dtypes is imported at the first use of
bfloat16, not here: version 0.7 spends about 1 s of CPU in its import (measured on the 2-core
CI machine; 0.06 s for 0.5 and 0.6), which every rank and every daemon would pay at start.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Sequence
from typing import cast

import numpy as np

from smddp.core.op import OpSpec
from smddp.v1 import smddp_pb2 as pb

# Data socket framing: one SOCK_SEQPACKET message is a 1-byte type and a serialized proto.
MSG_ATTACH = 1
MSG_ATTACH_REPLY = 2
MSG_OP = 3
MSG_OP_REPLY = 4
# A rank asks for the arena memfds of every rank of its communicator (single node only); the
# reply carries them as SCM_RIGHTS in rank order, once every rank has attached.
MSG_PEER_ARENAS = 5
MSG_PEER_ARENAS_REPLY = 6
# A rank's free channel (close before free, backend/csrc/free_channel.cpp): a connection that opens
# with MSG_FREE_ATTACH (an AttachRequest, no memfd) and then carries SegmentFree requests and
# SegmentFreeReply answers. backend/csrc/free_channel.cpp repeats these three numbers.
MSG_FREE_ATTACH = 7
MSG_FREE = 8
MSG_FREE_REPLY = 9
# smddpctl's status and metrics (server/ctl.py): a connection that opens with MSG_STATUS (a
# StatusRequest) or MSG_METRICS (a MetricsRequest) gets one MSG_QUERY_REPLY, an AttachReply
# (ok, error) carrying, when ok, a memfd that holds the serialized StatusReply or MetricsReply
# (no size limit), and is closed. Here, unlike on gRPC, the kernel names the asker's uid
# (SO_PEERCRED): a user is shown only their own jobs, root and the admin group every job.
# The request's bytes follow QUERY_MAGIC, so that no stray first message passes for a query
# (it is refused as any message that is not an AttachRequest).
MSG_STATUS = 10
MSG_METRICS = 11
MSG_QUERY_REPLY = 12
QUERY_MAGIC = b"smddpctl/1 "
MAX_MESSAGE_BYTES = 1 << 20

DATA_SOCKET_SUFFIX = ".data"


# The one dtype table: wire code -> numpy dtype. bfloat16's numpy dtype exists only once
# ml_dtypes is imported, so its entry is added at its first use (``_bfloat16``).
_NUMPY: dict[int, np.dtype] = {
    pb.FLOAT16: np.dtype(np.float16),
    pb.FLOAT32: np.dtype(np.float32),
    pb.FLOAT64: np.dtype(np.float64),
    pb.INT8: np.dtype(np.int8),
    pb.UINT8: np.dtype(np.uint8),
    pb.INT16: np.dtype(np.int16),
    pb.INT32: np.dtype(np.int32),
    pb.INT64: np.dtype(np.int64),
    pb.BOOL: np.dtype(np.bool_),
}
_WIRE: dict[np.dtype, int] = {v: k for k, v in _NUMPY.items()}
# Every wire dtype, in the order error messages list them; membership needs no ml_dtypes.
WIRE_CODES: tuple[int, ...] = (
    pb.FLOAT16,
    pb.BFLOAT16,
    pb.FLOAT32,
    pb.FLOAT64,
    pb.INT8,
    pb.UINT8,
    pb.INT16,
    pb.INT32,
    pb.INT64,
    pb.BOOL,
)


def _bfloat16() -> np.dtype:
    """Imports ml_dtypes and adds bfloat16 to the table (once)."""
    found = _NUMPY.get(pb.BFLOAT16)
    if found is None:
        import ml_dtypes

        found = np.dtype(ml_dtypes.bfloat16)
        _WIRE[found] = pb.BFLOAT16
        _NUMPY[pb.BFLOAT16] = found
    return found


def numpy_dtype(code: int) -> np.dtype:
    """The numpy dtype of wire dtype ``code``.

    Raises:
        KeyError: ``code`` is no wire dtype (``code in WIRE_CODES`` says so beforehand).
    """
    found = _NUMPY.get(code)
    if found is None:
        if code != pb.BFLOAT16:
            raise KeyError(code)
        found = _bfloat16()
    return found


def wire_dtype(dtype: np.dtype) -> int | None:
    """The wire code of numpy ``dtype``, or None when the wire does not carry it."""
    code = _WIRE.get(dtype)
    # A numpy dtype named bfloat16 exists only once ml_dtypes is imported (by whoever made it).
    if code is None and getattr(dtype, "name", None) == "bfloat16":
        _bfloat16()
        code = _WIRE.get(dtype)
    return code


FLOAT_DTYPES: frozenset[int] = frozenset({pb.FLOAT16, pb.BFLOAT16, pb.FLOAT32, pb.FLOAT64})

KIND_NAMES: dict[int, str] = {
    pb.ALL_REDUCE: "all_reduce",
    pb.BROADCAST: "broadcast",
    pb.REDUCE: "reduce",
    pb.ALL_GATHER: "all_gather",
    pb.REDUCE_SCATTER: "reduce_scatter",
    pb.ALL_TO_ALL: "all_to_all",
    pb.GATHER: "gather",
    pb.SCATTER: "scatter",
    pb.BARRIER: "barrier",
    pb.SEND: "send",
    pb.RECV: "recv",
}
REDUCE_NAMES: dict[int, str] = {
    pb.SUM: "SUM",
    pb.AVG: "AVG",
    pb.MIN: "MIN",
    pb.MAX: "MAX",
    pb.PRODUCT: "PRODUCT",
    pb.BAND: "BAND",
    pb.BOR: "BOR",
    pb.BXOR: "BXOR",
}
REDUCING_KINDS: frozenset[int] = frozenset({pb.ALL_REDUCE, pb.REDUCE, pb.REDUCE_SCATTER})
ROOTED_KINDS: frozenset[int] = frozenset({pb.BROADCAST, pb.REDUCE, pb.GATHER, pb.SCATTER})
P2P_KINDS: frozenset[int] = frozenset({pb.SEND, pb.RECV})
# The ops whose local phases run in the control region on a communicator spanning nodes
# (OpRequest.node_combined): the node's lowest rank alone takes them to the daemon.
COMBINED_KINDS: frozenset[int] = frozenset({pb.ALL_REDUCE, pb.BROADCAST, pb.BARRIER})


def dtype_name(dtype: int) -> str:
    """Returns the torch-style name of a wire dtype, e.g. ``float32``."""
    if dtype == pb.BFLOAT16:
        return "bfloat16"
    if dtype not in WIRE_CODES:
        return f"dtype#{dtype}"
    np_dtype = numpy_dtype(dtype)
    return "bool" if np_dtype == np.bool_ else np_dtype.name


def reduce_op_check(dtype: int, reduce_op: int) -> str | None:
    """Says why ``reduce_op`` cannot apply to ``dtype``, or None when it can."""
    if reduce_op not in REDUCE_NAMES:
        return f"unknown reduce op {reduce_op}"
    if reduce_op in (pb.BAND, pb.BOR, pb.BXOR) and dtype in FLOAT_DTYPES:
        return f"{REDUCE_NAMES[reduce_op]} is only defined for integer and bool tensors, not {dtype_name(dtype)}"  # noqa: E501
    if reduce_op == pb.AVG and dtype not in FLOAT_DTYPES:
        return f"AVG is only defined for floating-point tensors, not {dtype_name(dtype)}"
    return None


def describe(op: OpSpec) -> str:
    """Names an op the way a user wrote it, e.g. ``broadcast(src=1, 4096 x float32)``."""
    kind, dtype, count, root, reduce_op, _ = op
    name = KIND_NAMES.get(kind, f"op#{kind}")
    if kind == pb.BARRIER:
        return "barrier()"
    args = []
    if kind in REDUCING_KINDS:
        args.append(REDUCE_NAMES.get(reduce_op, f"op#{reduce_op}"))
    if kind in (pb.BROADCAST, pb.SCATTER):
        args.append(f"src={root}")
    elif kind in (pb.REDUCE, pb.GATHER) or kind == pb.SEND:
        args.append(f"dst={root}")
    elif kind == pb.RECV:
        args.append(f"src={root}")
    if kind == pb.ALL_TO_ALL:
        args.append(f"{count} x {dtype_name(dtype)} sent")
    else:
        args.append(f"{count} x {dtype_name(dtype)}")
    return f"{name}({', '.join(args)})"


def op_request(op: OpSpec, seq: int = 0) -> pb.OpRequest:
    """The daemon's request for ``op`` as op ``seq`` (its chunks are copies with ``part``
    and ``parts`` set): the one place an ``OpSpec`` becomes protobuf."""
    # The stubs type enum fields by their enum classes; a spec's ints are those values.
    return pb.OpRequest(
        seq=seq,
        kind=cast("pb.OpKind", op.kind),
        dtype=cast("pb.DType", op.dtype),
        count=op.elements,
        root=op.root,
        reduce_op=cast("pb.ReduceOp", op.reduce_op),
        tag=op.tag,
    )


def op_of(req: pb.OpRequest) -> OpSpec:
    """The ``OpSpec`` a request (or a GPU op's request) carries."""
    return OpSpec(req.kind, req.dtype, req.count, req.root, req.reduce_op, req.tag)


def describe_request(req: pb.OpRequest) -> str:
    """``describe`` applied to an OpRequest; a GPU op says so:
    ``all_reduce(SUM, 8 x float32 on GPU)``, and a receive from any source too:
    ``recv(src=any, 8 x float32)``."""
    text = describe(op_of(req))
    if req.kind == pb.RECV and req.any_source:
        text = text.replace(f"src={req.root}", "src=any", 1)
    return text[:-1] + " on GPU)" if req.HasField("cuda") else text


def pack(msg_type: int, message: bytes) -> bytes:
    """Frames one data-socket message."""
    return struct.pack("B", msg_type) + message


def unpack(data: bytes) -> tuple[int, bytes]:
    """Splits one data-socket message into its type and payload.

    Raises:
        ValueError: the message is empty.
    """
    if not data:
        raise ValueError("empty message")
    return data[0], data[1:]


def rank_list(ranks: Sequence[int]) -> str:
    """Formats ranks compactly: ``rank 3``, ``ranks 0-2``, ``ranks 0, 2, 5-7``."""
    ranks = sorted(ranks)
    runs: list[list[int]] = []  # [first, last] of each run of consecutive ranks
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs]
    label = "rank" if len(ranks) == 1 else "ranks"
    return f"{label} {', '.join(parts)}"


SYSTEM_SOCKET = "/run/smddp/smddpd.sock"


def user_socket_path() -> str:
    """The per-user fallback socket: ``$XDG_RUNTIME_DIR/smddp`` or ``/tmp/smddp-<uid>``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(runtime, "smddp") if runtime else f"/tmp/smddp-{os.getuid()}"
    return os.path.join(base, "smddpd.sock")


def default_socket_path() -> str:
    """The daemon's socket when none is configured: the system path if we may create it there."""
    folder = os.path.dirname(SYSTEM_SOCKET)
    if os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK):
        return SYSTEM_SOCKET
    if not os.path.exists(folder) and os.access(os.path.dirname(folder), os.W_OK | os.X_OK):
        return SYSTEM_SOCKET
    return user_socket_path()


def socket_candidates() -> list[str]:
    """Where a client looks for a daemon: ``SMDDP_SOCKET`` alone if set, else both defaults."""
    explicit = os.environ.get("SMDDP_SOCKET")
    if explicit:
        return [explicit]
    return [SYSTEM_SOCKET, user_socket_path()]


def outward_ip(toward: str = "10.255.255.255") -> str:
    """This host's IP address on the route toward ``toward`` (a UDP connect sends nothing)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((toward, 9))
        address: str = probe.getsockname()[0]
        return address
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


def node_layout(node_of_rank: Sequence[str], peer_of_node: dict[str, str]) -> list[pb.NodeSpec]:
    """The NodeSpecs of a communicator whose rank r runs on ``node_of_rank[r]``.

    Nodes are ordered by their lowest rank, so every rank computes the same list. Empty when
    every rank is on one node.
    """
    order: list[str] = []
    for node in node_of_rank:
        if node not in order:
            order.append(node)
    if len(order) == 1:
        return []
    return [
        pb.NodeSpec(
            node_id=node,
            peer_address=peer_of_node[node],
            ranks=[r for r, n in enumerate(node_of_rank) if n == node],
        )
        for node in order
    ]
