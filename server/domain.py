"""The daemon's own types for what the protobuf messages carry in: a communicator's layout
across nodes, and what ranks must agree on for their requests to be the same op.

The gRPC edge (``service``, ``peer_service``) converts messages into these once; the rooms
behind it (``communicator``, ``hierarchical``, ``peer_transport``) take these, not messages.
``pb.OpRequest`` is the one message that stays on the hot path: converting it per chunk costs
more than the op's bookkeeping (see docs/architecture.md for the figure).
"""

from __future__ import annotations

from dataclasses import dataclass

from smddp.core.op import OpSpec
from smddp.core.wire import op_of
from smddp.v1 import smddp_pb2 as pb


def op_signature(
    kind: int, dtype: int, count: int, root: int, reduce_op: int, parts: int, direct: bool = False
) -> tuple[int, ...]:
    """What every rank's request for one op must agree on, on this node and across nodes:
    the op's ``OpSpec.signature`` (fields its kind does not use left out, so that ranks which
    fill them differently still match), its number of chunks and whether it runs direct."""
    return spec_signature(OpSpec(kind, dtype, count, root, reduce_op), parts, direct)


def spec_signature(spec: OpSpec, parts: int, direct: bool = False) -> tuple[int, ...]:
    """``op_signature`` of an op given as an ``OpSpec``."""
    return (*spec.signature(), parts, int(direct))


def request_signature(req: pb.OpRequest) -> tuple[int, ...]:
    """``op_signature`` of one rank's request."""
    return spec_signature(op_of(req), req.parts, req.direct)


@dataclass(frozen=True)
class NodeSpec:
    """One node of a job: its id, where its daemon's Peer service listens, its ranks."""

    node_id: str
    peer_address: str
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Registration:
    """A rank's request to join its communicator (``Node.Register``, as the daemon keeps it)."""

    job_id: str
    comm_id: str
    rank: int
    world_size: int
    job_token: bytes
    arena_bytes: int
    timeout_ms: int = 0  # 0: the daemon's default
    pid: int = 0  # as the client says: a hint only (attach checks the kernel's word)
    global_rank: int = 0
    node_id: str = ""
    nodes: tuple[NodeSpec, ...] = ()  # empty: every rank on this node
    # Set by shrink_group: the communicator replaced, its ranks left out, the new generation;
    # by smddp.grow: the communicator replaced, the ranks that joined, the new generation.
    parent_comm_id: str = ""
    excluded: tuple[int, ...] = ()
    generation: int = 0
    joined: tuple[int, ...] = ()

    @classmethod
    def from_proto(cls, req: pb.RegisterRequest) -> Registration:
        """The registration a RegisterRequest carries."""
        return cls(
            job_id=req.job_id, comm_id=req.comm_id, rank=req.rank, world_size=req.world_size,
            job_token=req.job_token, arena_bytes=req.arena_bytes, timeout_ms=req.timeout_ms,
            pid=req.pid, global_rank=req.global_rank, node_id=req.node_id,
            nodes=tuple(NodeSpec(n.node_id, n.peer_address, tuple(n.ranks)) for n in req.nodes),
            parent_comm_id=req.parent_comm_id, excluded=tuple(req.excluded_ranks),
            generation=req.generation, joined=tuple(req.joined_ranks),
        )  # fmt: skip


@dataclass(frozen=True)
class Layout:
    """Where a communicator's ranks are: its identity, and its ranks per node.

    ``nodes[i]`` lists the ranks of node ``i`` in rank order; ``my_node`` is this daemon's
    index; ``specs`` is empty for a single-node communicator.
    """

    job_id: str
    comm_id: str
    nodes: tuple[tuple[int, ...], ...]
    my_node: int = 0
    specs: tuple[NodeSpec, ...] = ()

    @property
    def world_size(self) -> int:
        """How many ranks the communicator has, on every node together."""
        return sum(len(ranks) for ranks in self.nodes)

    @property
    def local(self) -> tuple[int, ...]:
        """The ranks of this node."""
        return self.nodes[self.my_node]

    def name(self) -> str:
        """``job J comm C``, the prefix of every message about this communicator."""
        return f"job {self.job_id} comm {self.comm_id}"

    def node_ids(self) -> list[str]:
        """Every node's id, in node order."""
        return [s.node_id for s in self.specs]

    def others(self) -> list[int]:
        """The indices of the other nodes."""
        return [i for i in range(len(self.nodes)) if i != self.my_node]

    def node_of(self, rank: int) -> int:
        """The index of the node ``rank`` runs on."""
        return next(i for i, ranks in enumerate(self.nodes) if rank in ranks)
