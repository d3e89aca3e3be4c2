"""The daemon's exception hierarchy; each error knows its wire kind and gRPC status."""

from __future__ import annotations

import grpc

from smddp.v1 import smddp_pb2 as pb


class SmddpError(Exception):
    """Base of the daemon's errors; the message names job, rank, node and op involved."""

    kind: int = pb.INVALID
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidRequest(SmddpError):
    """Malformed or impossible input from a client."""

    kind = pb.INVALID
    code = grpc.StatusCode.INVALID_ARGUMENT


class Unauthenticated(SmddpError):
    """Unknown session, wrong secret or wrong job token."""

    kind = pb.UNAUTHENTICATED
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(SmddpError):
    """A client of another user tried to join or use a job."""

    kind = pb.UNAUTHENTICATED
    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(SmddpError):
    """The request is valid but the state does not allow it (e.g. rank already registered)."""

    kind = pb.INVALID
    code = grpc.StatusCode.FAILED_PRECONDITION


class LimitExceeded(SmddpError):
    """A configured limit (jobs, ranks, arena size) would be exceeded."""

    kind = pb.INVALID
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class OpMismatch(SmddpError):
    """Ranks called different collectives as the same op number."""

    kind = pb.MISMATCH
    code = grpc.StatusCode.FAILED_PRECONDITION


class RemoteRefusal(SmddpError):
    """Another node's daemon refused a forwarded request; keeps its gRPC status."""

    kind = pb.INVALID

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class NotFound(SmddpError):
    """What a peer asked for is not here (yet): a communicator not registered on this node."""

    kind = pb.INVALID
    code = grpc.StatusCode.NOT_FOUND


class Aborted(SmddpError):
    """The communicator a peer asked about has failed already."""

    kind = pb.ABORTED
    code = grpc.StatusCode.ABORTED


class PeerError(SmddpError):
    """A peer exchange could not complete; the message names the node.

    ``kind`` is the ErrorKind the communicator fails with: RANK_FAILED for a lost or
    unreachable node, TIMEOUT for one that sent nothing in time; ``failed_ranks``, the ranks
    of a node lost or left (the communicator's failed ranks).
    """

    kind: int = pb.RANK_FAILED
    code = grpc.StatusCode.UNAVAILABLE

    def __init__(
        self, message: str, kind: int = pb.RANK_FAILED, failed_ranks: tuple[int, ...] = ()
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.failed_ranks = failed_ranks


class CudaCallError(SmddpError, RuntimeError):
    """A CUDA call of the daemon's GPU runtime failed; the message names the call and the CUDA
    error. A RuntimeError too, as the GPU code has always caught it."""

    kind = pb.INVALID
    code = grpc.StatusCode.INTERNAL
