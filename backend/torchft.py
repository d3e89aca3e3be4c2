"""torchft on smddp: ``ProcessGroupSmddp``, a process group torchft's ``Manager`` rebuilds.

torchft (https://github.com/pytorch/torchft) keeps a job training when a replica group fails: a
lighthouse forms quorums of the live replica groups, and on each new quorum its ``Manager``
calls ``configure(store_addr, replica_id, rank, world_size, ...)`` on its process group, which
must then be a fresh group of that quorum's replicas. ``ProcessGroupSmddp`` makes that group an
smddp one: every quorum is a new smddp job on the node daemons (agreed through the quorum's
own store prefix, which torchft makes unique per quorum), and the group of the quorum before is
left first, so that the daemon holds only the live one.

Usage, as with torchft's own ``ProcessGroupGloo``::

    from smddp.torchft import ProcessGroupSmddp
    pg = ProcessGroupSmddp(timeout=timedelta(seconds=10))
    manager = torchft.Manager(pg=pg, checkpoint_transport=PGTransport(pg, ...), ...)

Failure and abort: a replica that dies fails the ops of its group on every survivor within
seconds (smddp's failure model), and one that hangs fails them after ``timeout`` (every op of
the group carries it), so torchft's ``should_commit`` skips the step and the next quorum drops
the replica. ``abort()`` returns at once: it leaves the daemon (which fails the group's ops on
every rank, this one's waiting ops included) and releases the rest on a thread of its own, so
that a peer that never answers cannot hold the caller.

Import this module only where torchft is installed; ``import smddp`` never imports it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from torchft.process_group import ProcessGroupWrapper

from smddp.backend.job import rendezvous
from smddp.backend.process_group import SmddpProcessGroup
from smddp.client.config import ClientConfig
from smddp.client.embedded import daemon_answers
from smddp.client.errors import SmddpError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["ProcessGroupSmddp"]

log = logging.getLogger("smddp")

BACKEND_NAME = "torchft-smddp"
# The store torchft hands over is fresh for every quorum (".../torchft/<quorum>/<rank>"), and a
# restarted replica has made fewer groups than the survivors: the job's keys need no attempt
# count (job.attempt_prefix), one fixed prefix does.
STORE_PREFIX = "smddp/"
# The smddp communicator's name inside each quorum's job: there is one per job.
COMM_ID = "0"


class ProcessGroupSmddp(ProcessGroupWrapper):  # type: ignore[misc]  # torchft ships no types
    """A torchft process group whose collectives smddp's node daemons carry out.

    ``configure`` (called by torchft's Manager on every new quorum) leaves the group of the
    quorum before and joins a new smddp job made through the quorum's store; every collective
    then goes to that group (allreduce for the Manager and torchft's DDP, send/recv for
    ``PGTransport``'s healing, broadcast, allgather, barrier and the rest as smddp offers them).

    Args:
        timeout: every op's timeout (a peer that hangs fails the op after it, naming the ranks
            that never arrived) and the rendezvous's on the quorum's store.
    """

    # torchft's ProcessGroupWrapper keeps the live group here (an SmddpProcessGroup, or None).
    _pg: Any

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)
        self._errored: Exception | None = None
        # The daemon of the first quorum, kept for the next ones: where no node daemon runs,
        # the first quorum's leader started an embedded one, which later quorums must reuse
        # rather than start one each.
        self._socket: str | None = None
        self._closing: list[threading.Thread] = []

    def getBackendName(self) -> str:
        """torchft's name for this kind of group."""
        return BACKEND_NAME

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: int | None = None,
        group_rank: int | None = None,
        group_world_size: int | None = None,
        global_ranks: list[int] | None = None,
    ) -> None:
        """Leaves the group of the quorum before (without waiting for it) and joins a new one.

        Args:
            store_addr: ``host:port/prefix`` of the quorum's store, unique per quorum.
            replica_id: this replica group's id, for messages.
            rank: this replica's rank in the quorum.
            world_size: the number of replicas in the quorum.
            quorum_id: the quorum's number, for messages.
            group_rank: this process's rank inside its replica group.
            group_world_size: the number of processes in a replica group.
            global_ranks: every member's global rank, for messages (smddp names ranks by it).

        Raises:
            torch.distributed.DistBackendError: the group could not be made (the message
                names the quorum, the rank and why).
        """
        self._errored = None
        super().configure(
            store_addr,
            replica_id,
            rank,
            world_size,
            quorum_id,
            group_rank,
            group_world_size,
            global_ranks,
        )

    def _create_pg(self, store: Store, rank: int, world_size: int) -> SmddpProcessGroup:
        import torch.distributed as dist

        config = ClientConfig.from_env()
        if self._socket is not None and config.socket is None and daemon_answers(self._socket):
            config = replace(config, socket=self._socket)
        global_ranks = self._global_ranks or list(range(world_size))
        try:
            job = rendezvous(store, rank, world_size, self._timeout, config, STORE_PREFIX)
            comm = job.connect(
                rank=rank,
                comm_id=COMM_ID,
                member_nodes=job.node_of_rank[:world_size],
                global_rank=global_ranks[rank],
                timeout_s=self._timeout.total_seconds(),
                config=config,
            )
        except SmddpError as exc:
            raise dist.DistBackendError(
                f"smddp: replica {self._replica_id} cannot join torchft quorum {self._quorum_id} as rank {rank} of {world_size}: {exc}"  # noqa: E501
            ) from None
        self._socket = job.socket_path
        return SmddpProcessGroup(comm, rank, world_size)

    def abort(self, errored: bool = True) -> None:
        """Leaves the group at once; its ops in flight fail on every rank.

        The daemon fails the group's pending and later ops on every member when this rank
        deregisters, so a collective blocked on a peer that hangs returns with an error instead
        of waiting out its timeout; the arena and the progress thread are released on a thread
        of their own.

        Args:
            errored: True when torchft aborts because of an error (``errored()`` then returns
                it until the next ``configure``); False when it only replaces the group.
        """
        pg = self._pg
        # torchft's own bookkeeping (its error log) with no group left for it to abort.
        self._pg = None
        super().abort(errored=errored)
        if errored:
            self._errored = RuntimeError(
                f"smddp: the process group of replica {self._replica_id} (quorum {self._quorum_id}, rank {self._rank}) was aborted"  # noqa: E501
            )
        if isinstance(pg, SmddpProcessGroup):
            why = "after an error" if errored else "to replace it"
            self._leave(
                pg,
                f"torchft aborted the process group of replica {self._replica_id} (quorum {self._quorum_id}) {why}",  # noqa: E501
            )

    def _leave(self, pg: SmddpProcessGroup, reason: str = "") -> None:
        # Deregistering first is what fails the ops in flight (here and on the peers); the
        # rest (draining them, unmapping the arena) may wait on them, so it runs apart.
        try:
            pg.comm.session.leave(reason)
        except Exception as exc:  # the daemon may be gone: nothing left to leave
            log.debug("smddp: leaving the torchft group failed: %r", exc)

        def release() -> None:
            try:
                pg.abort()
            except Exception as exc:
                log.debug("smddp: releasing the torchft group failed: %r", exc)

        self._closing = [t for t in self._closing if t.is_alive()]
        thread = threading.Thread(target=release, name="smddp-torchft-leave", daemon=True)
        thread.start()
        self._closing.append(thread)

    def shutdown(self) -> None:
        """Leaves the current group and waits until every group left before is released."""
        pg = self._pg
        self._pg = None
        if isinstance(pg, SmddpProcessGroup):
            self._leave(pg)
        for thread in self._closing:
            thread.join(self._timeout.total_seconds())
        self._closing = []

    def errored(self) -> Exception | None:
        """The error of an ``abort`` since the last ``configure``, or None."""
        return self._errored
