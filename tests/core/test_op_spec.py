"""core/op.py: one op as a rank called it, its signature, and its trip to the wire and back."""

from __future__ import annotations

import ast
import itertools
from enum import IntEnum
from pathlib import Path

import pytest

import smddp.backend
import smddp.client
from smddp.core.op import BARRIER, DType, OpKind, OpSpec, ReduceOp
from smddp.core.region import published_op
from smddp.core.wire import (
    P2P_KINDS,
    REDUCING_KINDS,
    ROOTED_KINDS,
    describe,
    describe_request,
    op_of,
    op_request,
)
from smddp.server.domain import op_signature, request_signature, spec_signature
from smddp.server.peer_wire import FRAME_DATA, pack_header, unpack_header
from smddp.v1 import smddp_pb2 as pb

pytestmark = pytest.mark.timeout(60)

KINDS = [k for k in OpKind if k != OpKind.OP_KIND_UNSPECIFIED]


def _spec(kind: OpKind) -> OpSpec:
    """A spec of ``kind`` with every field its kind uses set to something other than 0."""
    return OpSpec(
        kind,
        DType.DTYPE_UNSPECIFIED if kind == OpKind.BARRIER else DType.FLOAT32,
        0 if kind == OpKind.BARRIER else 4096,
        3 if kind in ROOTED_KINDS or kind in P2P_KINDS else 0,
        ReduceOp.MAX if kind in REDUCING_KINDS else 0,
        7 if kind in P2P_KINDS else 0,
    )


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [(OpKind, pb.OpKind), (DType, pb.DType), (ReduceOp, pb.ReduceOp)],
)
def test_the_enums_are_the_wires(ours: type[IntEnum], theirs: object) -> None:
    # Same names, same values, none missing either way: a member is its wire int.
    wire = {name: int(value) for name, value in theirs.items()}  # type: ignore[attr-defined]
    assert {m.name: m.value for m in ours} == wire


def test_the_client_exports_the_enums_and_the_backend_no_protobuf() -> None:
    assert smddp.client.ReduceOp is ReduceOp and smddp.client.DType is DType
    assert smddp.client.ReduceOp.SUM == pb.SUM and smddp.client.DType.BFLOAT16 == pb.BFLOAT16
    backend = Path(smddp.backend.__file__).parent
    importers = []
    for path in sorted(backend.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            importers += [path.name for name in names if name.startswith("smddp.v1")]
    assert importers == []


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_a_spec_survives_the_trip_to_the_wire_and_back(kind: OpKind) -> None:
    spec = _spec(kind)
    req = op_request(spec, seq=17)
    assert (req.seq, req.kind, req.dtype, req.count, req.root, req.reduce_op, req.tag) == (
        17,
        spec.kind,
        spec.dtype,
        spec.elements,
        spec.root,
        spec.reduce_op,
        spec.tag,
    )
    assert op_of(req) == spec
    # ...and through the bytes the op channel carries.
    assert op_of(pb.OpRequest.FromString(req.SerializeToString())) == spec
    # A peer frame's header carries the same op, tag included.
    header = pack_header(
        FRAME_DATA, 0, 0, kind=req.kind, dtype=req.dtype, seq=req.seq, count=req.count,
        root=req.root, reduce_op=req.reduce_op, tag=req.tag,
    )  # fmt: skip
    frame, _ = unpack_header(header)
    assert frame.op == spec


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_two_specs_that_differ_in_a_field_the_kind_uses_have_different_signatures(
    kind: OpKind,
) -> None:
    spec = _spec(kind)
    other = {
        "kind": [k for k in KINDS if k != kind],
        "dtype": [] if kind == OpKind.BARRIER else [DType.FLOAT64, DType.BFLOAT16, DType.INT8],
        "elements": [] if kind in (OpKind.BARRIER, OpKind.ALL_TO_ALL) else [4095, 1 << 40],
        "root": [0, 1] if kind in ROOTED_KINDS else [],
        "reduce_op": [ReduceOp.SUM, ReduceOp.MIN] if kind in REDUCING_KINDS else [],
    }
    for field, values in other.items():
        for value in values:
            changed = spec._replace(**{field: value})
            assert changed.signature() != spec.signature(), (field, value)
            assert request_signature(op_request(changed)) != request_signature(op_request(spec))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_fields_a_kind_does_not_use_leave_its_signature_alone(kind: OpKind) -> None:
    spec = _spec(kind)
    unused = {"tag": [1, 99]}  # sends and receives are matched pairwise, tag and all
    if kind == OpKind.BARRIER:
        unused["dtype"] = [DType.FLOAT32]
    if kind == OpKind.ALL_TO_ALL:
        unused["elements"] = [1, 12345]  # its ranks may send different totals
    if kind not in ROOTED_KINDS:
        unused["root"] = [1, 5]
    if kind not in REDUCING_KINDS:
        unused["reduce_op"] = [ReduceOp.SUM, ReduceOp.BXOR]
    for field, values in unused.items():
        for value in values:
            assert spec._replace(**{field: value}).signature() == spec.signature(), field


def test_every_side_computes_the_same_signature() -> None:
    # The daemon (a request), a peer daemon (a frame) and the int form the tests call all
    # reach OpSpec.signature, with the op's chunk count and direct flag after it.
    for kind, parts, direct in itertools.product(KINDS, (1, 3), (False, True)):
        spec = _spec(kind)
        req = op_request(spec, seq=2)
        req.parts, req.direct = parts, direct
        expected = (*spec.signature(), parts, int(direct))
        assert request_signature(req) == expected
        assert spec_signature(spec, parts, direct) == expected
        assert op_signature(*spec[:5], parts, direct) == expected


def test_a_spec_the_client_builds_publishes_its_own_fields_in_the_region() -> None:
    # The client leaves 0 in every field its kind does not use, so the words it publishes
    # (the signature) read back as the spec itself, but for an all_to_all's total.
    for kind in KINDS:
        spec = _spec(kind)._replace(tag=0)
        if kind in P2P_KINDS:
            spec = spec._replace(root=0)  # point-to-point never runs in the region
        words = (1, *spec.signature(), 0, 0)  # seq, the signature, arrival, packed
        expected = spec._replace(elements=0) if kind == OpKind.ALL_TO_ALL else spec
        assert published_op(words) == expected


def test_describe_names_the_op_as_the_user_wrote_it() -> None:
    # The texts mismatch and timeout messages are made of, unchanged.
    assert describe(BARRIER) == "barrier()"
    assert describe(OpSpec(OpKind.BROADCAST, DType.FLOAT32, 4096, 1)) == (
        "broadcast(src=1, 4096 x float32)"
    )
    assert describe(OpSpec(OpKind.ALL_REDUCE, DType.BFLOAT16, 8, 0, ReduceOp.AVG)) == (
        "all_reduce(AVG, 8 x bfloat16)"
    )
    assert describe(OpSpec(OpKind.ALL_TO_ALL, DType.INT64, 6)) == "all_to_all(6 x int64 sent)"
    recv = op_request(OpSpec(OpKind.RECV, DType.FLOAT32, 8, 2, tag=5))
    recv.any_source = True
    assert describe_request(recv) == "recv(src=any, 8 x float32)"


def test_the_enums_still_accept_and_print_as_the_wire_ints() -> None:
    # Scripts that pass protobuf ints keep working, and messages print numbers as before.
    assert OpSpec(pb.ALL_REDUCE, pb.FLOAT32, 1, 0, pb.SUM) == OpSpec(
        OpKind.ALL_REDUCE, DType.FLOAT32, 1, 0, ReduceOp.SUM
    )
    assert f"{ReduceOp.MAX}" == str(pb.MAX)
