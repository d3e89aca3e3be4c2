"""The torch.distributed backend "smddp": registration and the process group's creator.

``import smddp`` (or ``import smddp.backend``, or SageMaker's
``import smdistributed.dataparallel.torch.torch_smddp``) registers it; then
``dist.init_process_group(backend="smddp")`` and ``dist.new_group(..., backend="smddp")``
create SmddpProcessGroups whose collectives the node daemon carries out.
"""

from __future__ import annotations

import threading
from typing import Any

import torch.distributed as dist

from smddp.backend import version  # noqa: F401  (first: refuses a torch outside the supported range)
from smddp.backend.job import Job, rendezvous
from smddp.backend.process_group import BACKEND_NAME, SmddpProcessGroup
from smddp.client.config import ClientConfig
from smddp.client.errors import SmddpError

__all__ = ["BACKEND_NAME", "SmddpProcessGroup", "register"]

_job: Job | None = None
_job_lock = threading.Lock()


def _create(dist_opts: Any, pg_options: Any) -> SmddpProcessGroup:
    """torch's extended-API creator: called once per process group, on its members only."""
    global _job
    store, rank, size = dist_opts.store, dist_opts.group_rank, dist_opts.group_size
    group_id = str(dist_opts.group_id)
    global_ranks = list(dist_opts.global_ranks_in_group) or list(range(size))
    timeout_s = dist_opts.timeout.total_seconds()
    try:
        # The group's one reading of the environment: the rendezvous, the embedded daemon,
        # connect and the GPU path take their settings from it.
        config = ClientConfig.from_env()
        with _job_lock:
            # The default group (id "0") starts a job; new groups join the running one.
            if _job is None or group_id == "0":
                _job = rendezvous(store, rank, size, dist_opts.timeout, config)
            job = _job
        comm = job.connect(
            rank=rank,
            comm_id=group_id,
            member_nodes=[job.node_of_rank[g] for g in global_ranks],
            global_rank=global_ranks[rank],
            timeout_s=timeout_s,
            config=config,
        )
    except SmddpError as exc:
        raise dist.DistBackendError(
            f"smddp: cannot create process group {group_id} (rank {rank} of {size}): {exc}"
        ) from None
    group = SmddpProcessGroup(comm, rank, size)
    group.job = job
    group.rank_nodes = tuple(job.node_of_rank[g] for g in global_ranks)
    return group


def register() -> None:
    """Registers backend "smddp" with torch.distributed (idempotent)."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


register()
