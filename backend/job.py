"""The job as the torch backend sees it: identity, token, node layout and daemon socket.

Built once per default process group from the c10d store that init_process_group gives the
backend: rank 0 draws the job id and token, every rank publishes its node, and the first
rank of each node (its local leader) finds the node's daemon, or starts an embedded one,
and publishes its socket for the other local ranks.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from smddp.client.embedded import find_or_start_daemon
from smddp.client.errors import ConnectError

ENV_NODE_ID = "SMDDP_NODE_ID"
KEY_JOB = "smddp/job"


def node_id() -> str:
    """This process's node identity: SMDDP_NODE_ID, else the host name."""
    return os.environ.get(ENV_NODE_ID) or socket.gethostname()


@dataclass(frozen=True)
class Job:
    """What every process group of the job shares."""

    job_id: str
    token: bytes
    node_id: str
    socket_path: str
    node_of_rank: tuple[str, ...]


def _get(store: dist.Store, key: str) -> str:
    return store.get(key).decode()


def rendezvous(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> Job:
    """Agrees on the job through ``store`` and finds this node's daemon.

    Raises:
        ConnectError: no daemon could be found or started, or ranks span several nodes.
    """
    store.set_timeout(timeout)
    if rank == 0:
        store.set(KEY_JOB, json.dumps({"job_id": "j" + secrets.token_hex(8), "token": secrets.token_hex(32)}))
    job = json.loads(_get(store, KEY_JOB))
    me = node_id()
    store.set(f"smddp/node/{rank}", me)
    nodes = tuple(_get(store, f"smddp/node/{r}") for r in range(world_size))
    if len(set(nodes)) > 1:
        raise ConnectError(
            f"smddp: this job's ranks run on {len(set(nodes))} nodes ({', '.join(sorted(set(nodes)))}); "
            "this version carries collectives within one node only"
        )
    leader = nodes.index(me)
    key = f"smddp/socket/{me}"
    if rank == leader:
        try:
            path = find_or_start_daemon()
        except ConnectError as exc:
            store.set(key, "!" + str(exc))  # tell the other local ranks instead of leaving them waiting
            raise
        store.set(key, path)
    path = _get(store, key)
    if path.startswith("!"):
        raise ConnectError(f"the local leader (rank {leader}) could not reach a daemon: {path[1:]}")
    return Job(job["job_id"], bytes.fromhex(job["token"]), me, path, nodes)
