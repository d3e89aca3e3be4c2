"""The job as the torch backend sees it: identity, token, node layout and daemon sockets.

Built once per default process group from the c10d store that init_process_group gives the
backend: rank 0 draws the job id and token, every rank publishes its node, and the first
rank of each node (its local leader) finds the node's daemon, or starts an embedded one,
and publishes its socket and peer address for the others.

Every key carries the attempt: torchrun keeps its store across ``--max-restarts``, so a
restarted rank would otherwise read the job id and the socket of the attempt before it
(whose embedded daemon is gone) and fail with "no smddpd socket found".
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # torch.distributed re-exports Store only when it is available: mypy cannot see it there.
    from torch._C._distributed_c10d import Store

from smddp.client.communicator import Communicator, connect, daemon_info
from smddp.client.config import ClientConfig
from smddp.client.embedded import find_or_start_daemon
from smddp.client.errors import ConnectError
from smddp.core.wire import node_layout, outward_ip

# torch's launcher variables, not smddp's (those are ClientConfig's).
ENV_RESTART = (
    "TORCHELASTIC_RESTART_COUNT"  # set by torchrun: 0 on the first attempt, then 1, 2, ...
)
ENV_MASTER_ADDR = "MASTER_ADDR"

_rounds = itertools.count()  # default groups this process created: a new init after a destroy


def peer_host(config: ClientConfig) -> str:
    """Where other nodes reach this node's embedded daemon: ``config.advertise``
    (SMDDP_ADVERTISE), else the address of the route toward MASTER_ADDR (the rendezvous
    host every node reaches)."""
    if config.advertise:
        return config.advertise
    master = os.environ.get(ENV_MASTER_ADDR, "")
    try:
        toward = socket.gethostbyname(master) if master else ""
    except OSError:
        toward = ""
    return outward_ip(toward) if toward and not toward.startswith("127.") else outward_ip()


@dataclass(frozen=True)
class Job:
    """What every process group of the job shares."""

    job_id: str
    token: bytes
    node_id: str
    socket_path: str
    node_of_rank: tuple[str, ...]
    peer_of_node: dict[str, str] = field(default_factory=dict)

    def connect(
        self,
        *,
        rank: int,
        comm_id: str,
        member_nodes: Sequence[str],
        global_rank: int,
        timeout_s: float,
        config: ClientConfig,
        parent_comm_id: str = "",
        excluded_ranks: Sequence[int] = (),
        generation: int = 0,
        joined_ranks: Sequence[int] = (),
    ) -> Communicator:
        """Registers this process as ``rank`` of a communicator of this job, whose members
        (in rank order) live on ``member_nodes``; the lineage arguments are ``connect``'s.

        Raises:
            SmddpError: the daemon refused or could not be reached (``connect``'s errors).
        """
        return connect(
            job_id=self.job_id,
            job_token=self.token,
            rank=rank,
            world_size=len(member_nodes),
            comm_id=comm_id,
            socket_path=self.socket_path,
            timeout_s=timeout_s,
            global_rank=global_rank,
            nodes=node_layout(list(member_nodes), self.peer_of_node),
            config=config,
            parent_comm_id=parent_comm_id,
            excluded_ranks=excluded_ranks,
            generation=generation,
            joined_ranks=joined_ranks,
        )


def _get(store: Store, key: str) -> str:
    value: bytes = store.get(key)
    return value.decode()


def attempt_prefix(round_in_process: int) -> str:
    """The store prefix of this attempt's keys: torchrun's restart count, and how many
    default groups this process made before (every rank re-initialises as often as the
    others, so both agree across the job)."""
    restart = os.environ.get(ENV_RESTART, "0")
    return f"smddp/a{restart}.{round_in_process}/"


def rendezvous(
    store: Store,
    rank: int,
    world_size: int,
    timeout: timedelta,
    config: ClientConfig,
    attempt: str | None = None,
) -> Job:
    """Agrees on the job through ``store`` and finds this node's daemon.

    ``config`` (the one the backend built for this process group) names this node
    (``node_id``), where its daemon is or may be started, and the embedded daemon's address.
    ``attempt`` replaces the attempt's key prefix (``attempt_prefix``) where the caller's store
    is already fresh for every group it makes and its ranks did not all make as many groups
    before (torchft: a new store prefix per quorum, and a restarted replica counts from 0).

    Raises:
        ConnectError: no daemon could be found or started, or it cannot reach other nodes.
    """
    store.set_timeout(timeout)
    at = attempt if attempt is not None else attempt_prefix(next(_rounds))
    if rank == 0:
        store.set(
            at + "job",
            json.dumps({"job_id": "j" + secrets.token_hex(8), "token": secrets.token_hex(32)}),
        )
    job = json.loads(_get(store, at + "job"))
    me = config.node_id
    store.set(f"{at}node/{rank}", me)
    nodes = tuple(_get(store, f"{at}node/{r}") for r in range(world_size))
    spans_nodes = len(set(nodes)) > 1
    leader = nodes.index(me)
    key = f"{at}socket/{me}"
    if rank == leader:
        try:
            path = find_or_start_daemon(peer_host(config) if spans_nodes else None, config)
            peer = daemon_info(path).peer_address
            if spans_nodes and not peer:
                raise ConnectError(
                    f"smddpd at {path} accepts no peer connections (--peer-bind off)"
                )
        except ConnectError as exc:
            store.set(
                key, "!" + str(exc)
            )  # tell the other local ranks instead of leaving them waiting
            raise
        store.set(f"{at}peer/{me}", peer)
        store.set(key, path)
    path = _get(store, key)
    if path.startswith("!"):
        raise ConnectError(f"the local leader (rank {leader}) could not reach a daemon: {path[1:]}")
    peers = {n: _get(store, f"{at}peer/{n}") for n in sorted(set(nodes))} if spans_nodes else {}
    return Job(job["job_id"], bytes.fromhex(job["token"]), me, path, nodes, peers)
