"""The client's exception hierarchy. Every message comes from the daemon or names the op."""

from __future__ import annotations

import builtins

from smddp.v1 import smddp_pb2 as pb


class SmddpError(Exception):
    """Base of every error the smddp client raises."""


class UnsupportedError(SmddpError, ValueError):
    """The call cannot be carried out (dtype, op, layout); nothing was sent to the daemon."""


class ConnectError(SmddpError):
    """No daemon answered, or it refused the registration."""


class DaemonLostError(SmddpError):
    """The daemon's connection broke: it stopped, restarted or crashed."""


class OpError(SmddpError):
    """The daemon failed an op; ``kind`` is the wire ErrorKind."""

    kind: int = pb.INVALID


class MismatchError(OpError):
    """Ranks called different collectives as the same op number."""

    kind = pb.MISMATCH


class RankFailedError(OpError):
    """A rank of the communicator died, disconnected or left."""

    kind = pb.RANK_FAILED


class OpTimeoutError(OpError, builtins.TimeoutError):
    """Ranks did not arrive within the communicator's timeout (also a builtin TimeoutError)."""

    kind = pb.TIMEOUT


class DaemonStoppingError(OpError, DaemonLostError):
    """The daemon failed the op because it is shutting down (it stops or restarts)."""

    kind = pb.SHUTDOWN


_BY_KIND: dict[int, type[OpError]] = {
    pb.MISMATCH: MismatchError,
    pb.RANK_FAILED: RankFailedError,
    pb.TIMEOUT: OpTimeoutError,
    pb.SHUTDOWN: DaemonStoppingError,
}


def op_error(kind: int, message: str) -> OpError:
    """The exception for a failed OpReply."""
    cls = _BY_KIND.get(kind, OpError)
    err = cls(message)
    err.kind = kind
    return err


def progress_bug(rank: int, seq: int, exc: Exception) -> SmddpError:
    """The error of op ``seq`` when something other than an SmddpError escaped it on the
    progress thread (a bug): it fails that op, rather than hang its waiters."""
    return SmddpError(f"rank {rank}: op #{seq} failed in the progress thread: {exc!r}")


def __getattr__(name: str) -> type[OpTimeoutError]:
    # The class was called TimeoutError, which shadowed the builtin in every module that
    # imported it; the old name still resolves for code that reads it as an attribute.
    if name == "TimeoutError":
        return OpTimeoutError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
