"""The torch-facing errors: subclasses of torch.distributed.DistBackendError."""

from __future__ import annotations

import torch.distributed as dist

from smddp.client import errors as client_errors


class SmddpBackendError(dist.DistBackendError):
    """An smddp collective failed; the message says which ranks, node and op."""


class SmddpMismatchError(SmddpBackendError):
    """Ranks called different collectives as the same op number."""


class SmddpRankFailedError(SmddpBackendError):
    """A rank of the group died, disconnected or left."""


class SmddpTimeoutError(SmddpBackendError):
    """Some ranks did not arrive within the process group's timeout."""


class SmddpDaemonLostError(SmddpBackendError):
    """The node daemon stopped, restarted or crashed."""


def translate(exc: client_errors.SmddpError) -> SmddpBackendError:
    """The backend error for a client error, with the same message."""
    if isinstance(exc, client_errors.MismatchError):
        return SmddpMismatchError(str(exc))
    if isinstance(exc, client_errors.RankFailedError):
        return SmddpRankFailedError(str(exc))
    if isinstance(exc, client_errors.TimeoutError):
        return SmddpTimeoutError(str(exc))
    if isinstance(exc, client_errors.DaemonLostError):
        return SmddpDaemonLostError(str(exc))
    return SmddpBackendError(str(exc))
