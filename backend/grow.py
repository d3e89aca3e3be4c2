"""``smddp.grow`` and ``smddp.join``: replacement processes join a running job.

After a failure the survivors go on as a smaller group (``smddp.shrink_group``). A replacement
process (started by a supervisor, a launcher, Kubernetes) calls ``smddp.join(store)``: it
registers as waiting in the job's store and blocks. The survivors call ``smddp.grow()`` at a
step boundary, every step or every few: when nobody waits it returns the current group after
one store read on rank 0 and one broadcast of one integer; when replacements wait, every
survivor and every admitted replacement ends with a new default group of the survivors (ranks
0..S-1, in their order) followed by the replacements (ranks S.., in the order they queued), one
generation on, whose communicator the daemons know was grown from the old one
(``smddpctl status``: "grown from comm ...; ranks ... joined"). Then ``smddp.heal`` gives the
replacements the survivors' model and optimizer state.

The meeting point is the store the job started with (the launcher's TCPStore, torchrun's
``MASTER_ADDR:MASTER_PORT``), under keys that no other part of smddp or torch uses:

- ``WAITING``: a store queue of joiners' records (node, daemon peer address, a random id).
  Group rank 0 alone pops it, so every survivor admits the same joiners: rank 0 decides and
  broadcasts the count through the group, and the survivors read the decision it wrote.
- ``fate/<id>``: claimed once, with ``compare_set``, by the grow that admits the joiner or by
  the joiner that gives up at its timeout; whoever claims second knows it lost, so a joiner is
  never admitted after it has left.
- ``admit/<id>``: the joiner's rank and where the decision is (or why it was refused).
- ``<job>/<comm>``: the decision: the new communicator, its nodes and their daemons.

A joiner that arrives while rank 0 decides stays in the queue for the next grow.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore
from torch.distributed import distributed_c10d as c10d
from torch.distributed.distributed_c10d import GroupName

import smddp.backend as backend
from smddp.backend.errors import SmddpBackendError, SmddpJoinError, SmddpJoinTimeoutError
from smddp.backend.job import ENV_RESTART, Job, peer_host
from smddp.backend.process_group import BACKEND_NAME, SmddpProcessGroup
from smddp.backend.shrink import _retire, _shrunk_id
from smddp.client.communicator import Communicator, daemon_info
from smddp.client.config import ClientConfig
from smddp.client.embedded import find_or_start_daemon
from smddp.client.errors import SmddpError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

__all__ = ["grow", "join"]

DEFAULT_JOIN_TIMEOUT = timedelta(minutes=30)
# How often rank 0 looks at the queue again while grow(wait_for=...) waits for joiners.
_POLL_S = 0.02
# How long a joiner whose fate a grow claimed waits for that grow's word after its own
# timeout: rank 0 writes it right after the claim, so only a rank 0 that died in between
# leaves it waiting this long.
_ADMIT_GRACE_S = 30.0


def _prefix() -> str:
    """The keys' prefix: torchrun keeps its store across restarts, so each attempt has its own."""
    return f"smddp/grow/a{os.environ.get(ENV_RESTART, '0')}/"


def _waiting_key() -> str:
    return _prefix() + "waiting"


def _fate_key(uid: str) -> str:
    return f"{_prefix()}fate/{uid}"


def _admit_key(uid: str) -> str:
    return f"{_prefix()}admit/{uid}"


def _decision_key(job_id: str, comm_id: str) -> str:
    return f"{_prefix()}{job_id}/{comm_id}"


def _root(store: Store) -> Store:
    """The store under torch's prefixes (the group's ``<name>/``, env://'s ``default_pg``):
    the survivors reach the group's store through torch's tables, a joiner gets the job's store
    itself, and both must meet on the same keys."""
    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store


def _seconds(timeout: timedelta | float | None, default: timedelta) -> float:
    if timeout is None:
        return default.total_seconds()
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


# -- the survivors' side ---------------------------------------------------------------------


def grow(
    group: dist.ProcessGroup | None = None,
    timeout: timedelta | float | None = None,
    wait_for: int = 0,
) -> dist.ProcessGroup:
    """Admits the replacement processes waiting in ``smddp.join`` into the default group.

    Every rank of the group calls it at the same point (a step boundary). When nobody waits it
    returns ``group`` itself, at the cost of one store read on rank 0 and one broadcast of one
    integer, so it can be called every step.

    Args:
        group: the default group (None). Only the default group grows: a joiner has no other.
        timeout: with ``wait_for``, how long rank 0 waits for that many joiners (default 30
            min); the group's timeout must be longer, since the other ranks wait in a
            broadcast meanwhile.
        wait_for: wait until at least this many joiners are admitted (or ``timeout`` passes,
            then admit those who came). 0: admit whoever waits now, wait for nobody.

    Returns:
        ``group`` when nobody joined; else the new default group: this group's ranks in their
        order (0..S-1), then the joiners (S..), generation one more than ``group``'s. The
        joiners then need the survivors' state: ``smddp.heal``.

    Raises:
        TypeError: ``group`` is not an smddp group made by smddp's creator.
        ValueError: ``group`` is not the default group, or ``wait_for`` is negative.
        SmddpBackendError: the store or the daemon failed; the message says which.
    """
    default = c10d._get_default_group()
    pg = group if group is not None else default
    if not isinstance(pg, SmddpProcessGroup) or pg.job is None:
        raise TypeError(
            f"smddp.grow grows groups made by smddp's creator; this group's backend is {dist.get_backend(pg)}"  # noqa: E501
        )
    if pg is not default:
        raise ValueError(
            f"smddp.grow grows the default group only (a joiner belongs to no other); group {pg.group_name} is not it"  # noqa: E501
        )
    if wait_for < 0:
        raise ValueError(f"wait_for is {wait_for}: a number of joiners, 0 or more")
    parent: Communicator = pg.comm
    job = pg.job
    rank, size = pg.rank(), pg.size()
    generation = parent.generation + 1
    comm_id = _shrunk_id(parent.session.comm_id, generation)
    where = f"job {job.job_id} comm {parent.session.comm_id} rank {rank}"
    store = _root(c10d._get_process_group_store(pg))
    word = torch.zeros(1, dtype=torch.int64)
    problem = ""
    if rank == 0:
        try:
            word[0] = _admit(store, pg, job, comm_id, generation, wait_for, timeout)
        except NotImplementedError:
            problem = f"{where}: grow meets joiners in the job's store, which must keep queues (a TCPStore); this group's is a {type(store).__name__}"  # noqa: E501
            word[0] = -1
        except (dist.DistError, OSError, ValueError) as exc:
            # The others wait in the broadcast: they learn that rank 0 failed, not a timeout.
            problem = f"{where}: grow could not read the job's store: {exc}"
            word[0] = -1
    dist.broadcast(word, group_src=0, group=pg)
    joined = int(word[0])
    if joined < 0:
        raise SmddpBackendError(
            problem or f"{where}: grow failed on rank 0 (its store); this rank keeps its group"
        )
    if joined == 0:
        return pg
    decision = json.loads(store.get(_decision_key(job.job_id, comm_id)))
    nodes: list[str] = decision["nodes"]
    new_job = dataclasses.replace(
        job, node_of_rank=tuple(nodes), peer_of_node=dict(decision["peers"])
    )
    reason = f"rank {rank} called grow; generation {generation} admits ranks {list(range(size, len(nodes)))}"  # noqa: E501
    try:
        comm = new_job.connect(
            rank=rank,
            comm_id=comm_id,
            member_nodes=nodes,
            global_rank=rank,
            timeout_s=parent.timeout_s,
            config=parent.config,  # the group's, built once by the backend
            parent_comm_id=parent.session.comm_id,
            generation=generation,
            joined_ranks=range(size, len(nodes)),
        )
    except SmddpError as exc:
        raise dist.DistBackendError(
            f"smddp: cannot grow group {pg.group_name} (rank {rank} of {size}, admitting {len(nodes) - size} joiners): {exc}"  # noqa: E501
        ) from None
    parent.session.shrink = reason  # the daemon does not count this rank's leave as a failure
    meta = _retire(pg, True)
    return _install(comm, rank, new_job, meta["store"], comm_id)


def _admit(
    store: Store,
    pg: SmddpProcessGroup,
    job: Job,
    comm_id: str,
    generation: int,
    wait_for: int,
    timeout: timedelta | float | None,
) -> int:
    """Rank 0's part: claims the waiting joiners, writes the decision and each joiner's
    admission; returns how many were admitted."""
    deadline = time.monotonic() + _seconds(timeout, DEFAULT_JOIN_TIMEOUT)
    tag = f"{job.job_id}/{comm_id}"
    admitted: list[dict[str, Any]] = []
    while True:
        for _ in range(store.queue_len(_waiting_key())):
            record = json.loads(store.queue_pop(_waiting_key(), block=False))
            uid = str(record["uid"])
            if store.compare_set(_fate_key(uid), "", tag) != tag.encode():
                continue  # it gave up at its timeout before this grow
            refusal = _refusal(record, pg, job, admitted)
            if refusal:
                store.set(_admit_key(uid), json.dumps({"refused": refusal}))
                continue
            admitted.append(record)
        if len(admitted) >= wait_for or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    if not admitted:
        return 0
    nodes = list(pg.rank_nodes) + [str(r["node"]) for r in admitted]
    peers = dict(job.peer_of_node)
    for r in admitted:
        if r["peer"]:
            peers[str(r["node"])] = str(r["peer"])  # a node that came back has a new daemon
    decision = {
        "job_id": job.job_id,
        "token": job.token.hex(),
        "comm_id": comm_id,
        "parent_comm_id": pg.comm.session.comm_id,
        "generation": generation,
        "survivors": pg.size(),
        "nodes": nodes,
        "peers": {n: peers[n] for n in set(nodes) if n in peers},
        "timeout_s": pg.comm.timeout_s,
        # torch names new_group's groups by a per-process count, which smddp's creator takes
        # as the communicator's id: the joiners must count on from the survivors' number.
        "group_count": c10d._world.group_count,
    }
    key = _decision_key(job.job_id, comm_id)
    store.set(key, json.dumps(decision))
    for i, r in enumerate(admitted):
        store.set(_admit_key(str(r["uid"])), json.dumps({"rank": pg.size() + i, "decision": key}))
    return len(admitted)


def _refusal(
    record: dict[str, Any], pg: SmddpProcessGroup, job: Job, admitted: list[dict[str, Any]]
) -> str:
    """Why a joiner cannot be admitted (its daemon cannot be reached from the others), or ''."""
    node = str(record["node"])
    nodes = set(pg.rank_nodes) | {str(r["node"]) for r in admitted} | {node}
    if len(nodes) == 1:
        return ""
    known = {**job.peer_of_node, **{str(r["node"]): str(r["peer"]) for r in admitted}}
    if record["peer"]:
        known[node] = str(record["peer"])
    lacking = sorted(n for n in nodes if not known.get(n))
    if lacking:
        return f"the group would span nodes {sorted(nodes)}, but the daemons of nodes {lacking} accept no peer connections (--peer-bind off, or an embedded daemon of a one-node job)"  # noqa: E501
    return ""


def _install(
    comm: Communicator, rank: int, job: Job, store: Store, comm_id: str
) -> SmddpProcessGroup:
    """Makes the grown group the default group in torch's tables (and the job's, for
    new_group), as shrink_group's _register does for a shrunk one."""
    world = len(job.node_of_rank)
    new_pg = SmddpProcessGroup(comm, rank, world)
    new_pg.job = job
    new_pg.rank_nodes = job.node_of_rank
    name = GroupName(f"{job.job_id}:{comm_id}")  # the same on every rank, survivor or joiner
    new_pg._set_group_name(name)
    new_pg._set_group_desc("default:grown")
    c10d._update_default_pg(new_pg)
    c10d._register_pg_in_world(
        pg=new_pg,
        backend_name=BACKEND_NAME,
        store=store,
        group_name=name,
        backend_config=str(c10d.BackendConfig(dist.Backend(BACKEND_NAME))),
        rank_mapping={r: r for r in range(world)},
    )
    with backend._job_lock:
        backend._job = job
    return new_pg


# -- the joiner's side -----------------------------------------------------------------------


def join(store: Store, timeout: timedelta | float | None = None) -> dist.ProcessGroup:
    """Waits for a running job's ``smddp.grow`` to admit this process; returns its group.

    The replacement process's ``init_process_group``: it finds (or starts) its node's daemon,
    queues itself in ``store`` and blocks until the survivors' next grow admits it. Then it is
    a rank of the job's new default group (``dist.get_rank()`` says which), holding no state
    yet: call ``smddp.heal`` with the survivors, who call it too.

    Args:
        store: the job's store: the launcher's ``TCPStore`` (a client of it), or under torchrun
            ``TCPStore(MASTER_ADDR, MASTER_PORT)``; a ``PrefixStore`` over it is looked through.
        timeout: how long to wait for a grow (default 30 min).

    Returns:
        The job's new default group, with this process as one of its last ranks.

    Raises:
        RuntimeError: this process already has a default group.
        SmddpJoinTimeoutError: no grow admitted it within ``timeout``; it is no longer queued.
        SmddpJoinError: the grow refused it (its daemon cannot be reached by the others) or
            admitted it and then never finished; or the daemon refused it.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "smddp.join makes this process's default group; this process has one already"
        )
    wait_s = _seconds(timeout, DEFAULT_JOIN_TIMEOUT)
    root = _root(store)
    config = ClientConfig.from_env()  # the joiner's one reading of the environment
    me = config.node_id
    try:
        path = find_or_start_daemon(peer_host(config), config)
        peer = daemon_info(path).peer_address
    except SmddpError as exc:
        raise SmddpJoinError(f"smddp.join on node {me} (pid {os.getpid()}): {exc}") from None
    uid = secrets.token_hex(8)
    host = socket.gethostname()
    record = {"uid": uid, "node": me, "peer": peer, "pid": os.getpid(), "host": host}
    try:
        root.queue_push(_waiting_key(), json.dumps(record))
    except NotImplementedError:
        raise SmddpJoinError(
            f"smddp.join on node {me}: the job's store must keep queues (a TCPStore); this one is a {type(root).__name__}"  # noqa: E501
        ) from None
    admission = _await_admission(root, uid, wait_s, f"node {me} (pid {os.getpid()})")
    if "refused" in admission:
        raise SmddpJoinError(
            f"smddp.join on node {me} (pid {os.getpid()}): grow refused it: {admission['refused']}"
        )
    rank = int(admission["rank"])
    decision = json.loads(root.get(str(admission["decision"])))
    nodes: list[str] = decision["nodes"]
    job = Job(
        job_id=decision["job_id"],
        token=bytes.fromhex(decision["token"]),
        node_id=me,
        socket_path=path,
        node_of_rank=tuple(nodes),
        peer_of_node=dict(decision["peers"]),
    )
    generation = int(decision["generation"])
    survivors = int(decision["survivors"])
    try:
        comm = job.connect(
            rank=rank,
            comm_id=decision["comm_id"],
            member_nodes=nodes,
            global_rank=rank,
            timeout_s=float(decision["timeout_s"]),
            config=config,
            parent_comm_id=decision["parent_comm_id"],
            generation=generation,
            joined_ranks=range(survivors, len(nodes)),
        )
    except SmddpError as exc:
        raise SmddpJoinError(
            f"smddp.join on node {me}: cannot register as rank {rank} of {len(nodes)} in job {job.job_id} (generation {generation}): {exc}"  # noqa: E501
        ) from None
    c10d._world.group_count = max(c10d._world.group_count, int(decision["group_count"]))
    return _install(comm, rank, job, PrefixStore("0/", root), decision["comm_id"])


def _await_admission(root: Store, uid: str, wait_s: float, who: str) -> dict[str, Any]:
    """Blocks until a grow writes this joiner's admission; at ``wait_s`` withdraws, unless a
    grow claimed it first (then its word is on the way)."""
    key = _admit_key(uid)
    try:
        root.wait([key], timedelta(seconds=wait_s))
    except dist.DistStoreError:
        claim = root.compare_set(_fate_key(uid), "", "withdrawn")
        if claim == b"withdrawn":
            raise SmddpJoinTimeoutError(
                f"smddp.join on {who}: no smddp.grow admitted it within {wait_s:.0f} s; it has left the queue (the survivors call grow at a step boundary: do they, and is this the job's store?)"  # noqa: E501
            ) from None
        try:
            root.wait([key], timedelta(seconds=_ADMIT_GRACE_S))
        except dist.DistStoreError:
            raise SmddpJoinError(
                f"smddp.join on {who}: grow {claim.decode(errors='replace')} admitted it but wrote no word within {_ADMIT_GRACE_S:.0f} s (its rank 0 died?)"  # noqa: E501
            ) from None
    admission: dict[str, Any] = json.loads(root.get(key))
    return admission
