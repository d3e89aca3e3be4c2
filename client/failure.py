"""What a failed communicator's daemons agreed on: who is gone, and the communicator's generation.

A failure reaches a rank as an error (an OpReply, or the control region's failure words),
which says why in words. The failed ranks as a set, the same on every surviving rank of every
node, come from the daemon on request (``Node.Failure``), once, when a rank needs them: to say
who failed in a ``RankFailedError``, and for ``shrink_group``. The common op never pays for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from smddp.client.errors import DaemonLostError
from smddp.client.session import DaemonSession

# How long a rank waits for the daemons of a communicator spanning nodes to agree on the
# failed ranks (the daemon bounds it too); on one node the answer is at once.
AGREE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Failure:
    """A communicator's failure as its daemons agreed on it.

    Attributes:
        kind: the wire ErrorKind (RANK_FAILED for a dead rank or a lost node).
        message: the daemon's message, as the failed ops said it.
        failed_ranks: the communicator's ranks that are gone, the same on every survivor
            (empty when the failure named no rank: a timeout, a mismatch).
        generation: the communicator's generation (0 unless shrink_group made it).
        agreed: False when a peer daemon did not answer in time (its node is then lost, and
            its ranks are named as the lost node's wherever that was found first).
    """

    kind: int
    message: str
    failed_ranks: frozenset[int]
    generation: int
    agreed: bool = True


def ask_failure(session: DaemonSession, timeout_s: float = AGREE_TIMEOUT_S) -> Failure | None:
    """The failure of the session's communicator, or None while it has not failed.

    Raises:
        DaemonLostError: the daemon did not answer.
    """
    # The daemon answers within half a second each time (so that no rank holds its threads
    # longer): ask again until the daemons agreed, or this rank's own wait is up.
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reply = session.failure(max(0.0, deadline - time.monotonic()))
        except grpc.RpcError as exc:
            raise DaemonLostError(
                f"job {session.job_id} comm {session.comm_id} rank {session.rank}: smddpd at {session.socket_path} did not say why the communicator failed: {exc.details() or exc.code()}"  # noqa: E501
            ) from None
        if not reply.failed:
            return None
        if reply.agreed or time.monotonic() >= deadline:
            break
    return Failure(
        kind=reply.kind,
        message=reply.message,
        failed_ranks=frozenset(reply.failed_ranks),
        generation=reply.generation,
        agreed=reply.agreed,
    )


def revoke(session: DaemonSession, reason: str) -> None:
    """Has the daemon fail every pending and later op of the session's communicator on every
    rank with ``reason`` (shrink_group's SHRINK_ABORT).

    Raises:
        DaemonLostError: the daemon did not answer.
    """
    try:
        session.revoke(reason, AGREE_TIMEOUT_S)
    except grpc.RpcError as exc:
        raise DaemonLostError(
            f"job {session.job_id} comm {session.comm_id} rank {session.rank}: smddpd at {session.socket_path} could not revoke the communicator: {exc.details() or exc.code()}"  # noqa: E501
        ) from None
