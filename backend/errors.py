"""The torch-facing errors: subclasses of torch.distributed.DistBackendError."""

from __future__ import annotations

import logging

import torch.distributed as dist

from smddp.client import errors as client_errors
from smddp.client.communicator import Communicator

log = logging.getLogger(__name__)


class SmddpBackendError(dist.DistBackendError):
    """An smddp collective failed; the message says which ranks, node and op."""


class SmddpMismatchError(SmddpBackendError):
    """Ranks called different collectives as the same op number."""


class SmddpRankFailedError(SmddpBackendError):
    """A rank of the group died, disconnected or left, or its node was lost.

    Attributes:
        failed_ranks: the group's ranks that are gone, as the daemons agreed: the same set on
            every surviving rank (pass ``sorted(failed_ranks)`` to ``smddp.shrink_group``).
            Empty when the daemon could not be asked (it is gone too).
        generation: the group's generation: 0 for a group made by init_process_group or
            new_group, one more with each shrink_group that led to it.
    """

    failed_ranks: frozenset[int] = frozenset()
    generation: int = 0


class SmddpTimeoutError(SmddpBackendError):
    """Some ranks did not arrive within the process group's timeout."""


class SmddpDaemonLostError(SmddpBackendError):
    """The node daemon stopped, restarted or crashed."""


class SmddpJoinError(SmddpBackendError):
    """``smddp.join`` could not make this process a rank of the job (the message says why)."""


class SmddpJoinTimeoutError(SmddpJoinError):
    """No ``smddp.grow`` admitted the joining process within ``smddp.join``'s timeout."""


def translate(exc: client_errors.SmddpError, comm: Communicator | None = None) -> SmddpBackendError:
    """The backend error for a client error, with the same message; a rank failure of
    ``comm`` also says which ranks failed and the group's generation (asked of its daemon)."""
    if isinstance(exc, client_errors.MismatchError):
        return SmddpMismatchError(str(exc))
    if isinstance(exc, client_errors.RankFailedError):
        err = SmddpRankFailedError(str(exc))
        if comm is not None:
            err.generation = comm.generation
            try:
                failure = comm.failure()
            except client_errors.SmddpError as lost:
                log.warning("%s; the error names no failed ranks", lost)
            else:
                if failure is not None:
                    err.failed_ranks = failure.failed_ranks
        return err
    if isinstance(exc, client_errors.TimeoutError):
        return SmddpTimeoutError(str(exc))
    if isinstance(exc, client_errors.DaemonLostError):
        return SmddpDaemonLostError(str(exc))
    return SmddpBackendError(str(exc))
