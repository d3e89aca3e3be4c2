"""torchrun's environment from MPI and Slurm launchers, so ``env://`` works under them.

``init_process_group()`` with ``env://`` reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT,
which torchrun sets and ``mpirun`` / ``srun`` do not. SageMaker's library starts its jobs with
``mpirun``, and so do mmengine and others (``--launcher mpi``); ``import smddp`` therefore
fills the missing variables from the launcher's own:

launcher: rank, size, local rank, local size; job id (for the port)

- Open MPI: OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE; PMIX_NAMESPACE,
  OMPI_MCA_ess_base_jobid
- MPICH, Intel MPI (PMI): PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS; PMI_KVSNAME
- Slurm (srun): SLURM_PROCID, SLURM_STEP_NUM_TASKS or SLURM_NTASKS, SLURM_LOCALID,
  SLURM_STEP_TASKS_PER_NODE; SLURM_JOB_ID.SLURM_STEP_ID

MASTER_ADDR: on one node 127.0.0.1; across nodes the user's MASTER_ADDR, else SageMaker's
SM_MASTER_ADDR or the first of SM_HOSTS, else the first node of the Slurm step's node list.
MASTER_PORT: the user's, else one derived from the job id (every rank derives the same).
Variables already set are never changed, and nothing happens when RANK or WORLD_SIZE is set
(torchrun, or a script that sets them itself).

This module does not import torch: the daemon imports ``smddp`` too.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import MutableMapping
from dataclasses import dataclass

ENV_RANK = "RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"

# Derived ports fall below Linux's ephemeral range (32768-60999), so that a port the kernel
# hands out to some client socket is not taken for the rendezvous.
PORT_BASE = 20000
PORT_SPAN = 12000
# Where no job id exists across nodes: torchrun's default.
DEFAULT_PORT = 29500

HOW_TO_START = (
    "start the script with a launcher: "
    "torchrun --nproc-per-node N script.py, mpirun -np N python script.py, or srun -n N python script.py; "  # noqa: E501
    "or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself"
)


@dataclass(frozen=True)
class Launch:
    """What a launcher says about this process."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    single_node: bool
    job_id: str


def _int(env: MutableMapping[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value:  # neither unset nor empty
            try:
                return int(value)
            except ValueError:
                return None
    return None


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compact host list in full: ``"gpu[01-03,07],login1"`` -> gpu01, gpu02, gpu03,
    gpu07, login1 (zero padding kept; several bracket groups in one name expand as a product)."""
    hosts: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        names = [""]
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            choices = [text]
            if ranges:
                choices = []
                for part in ranges.split(","):
                    lo, _, hi = part.partition("-")
                    if hi:
                        width = len(lo)
                        choices += [text + str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
                    else:
                        choices.append(text + lo)
            names = [n + c for n in names for c in choices]
        hosts += [n for n in names if n]
    return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
    """Slurm's ``"2(x3),1"`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            return []
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _open_mpi(env: MutableMapping[str, str]) -> Launch | None:
    rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
    if rank is None or size is None:
        return None
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
    local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    job = (
        env.get("PMIX_NAMESPACE")
        or env.get("OMPI_MCA_ess_base_jobid")
        or env.get("OMPI_MCA_orte_ess_jobid")
        or ""
    )
    return _launch("Open MPI", rank, size, local_rank, local_size, job)


def _pmi(env: MutableMapping[str, str]) -> Launch | None:
    rank, size = _int(env, "PMI_RANK", "PMIX_RANK"), _int(env, "PMI_SIZE")
    if rank is None or size is None:
        return None
    local_rank = _int(env, "MPI_LOCALRANKID")
    local_size = _int(env, "MPI_LOCALNRANKS")
    return _launch("MPICH/PMI", rank, size, local_rank, local_size, env.get("PMI_KVSNAME", ""))


def _slurm(env: MutableMapping[str, str]) -> Launch | None:
    rank = _int(env, "SLURM_PROCID")
    size = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    if rank is None or size is None:
        return None
    local_rank = _int(env, "SLURM_LOCALID")
    per_node = expand_tasks_per_node(
        env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    )
    node = _int(env, "SLURM_NODEID") or 0
    local_size = per_node[node] if node < len(per_node) else _int(env, "SLURM_NTASKS_PER_NODE")
    nodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    job = ".".join(x for x in (env.get("SLURM_JOB_ID", ""), env.get("SLURM_STEP_ID", "")) if x)
    launch = _launch("Slurm", rank, size, local_rank, local_size, job)
    if launch is not None and nodes is not None:
        launch = Launch(**{**launch.__dict__, "single_node": nodes == 1})
    return launch


def _launch(
    launcher: str, rank: int, size: int, local_rank: int | None, local_size: int | None, job: str
) -> Launch | None:
    if not 0 <= rank < size:
        return None
    if local_size is None:
        local_size = size  # no word of the layout: one node is the common case
    if local_rank is None:
        local_rank = rank % local_size
    return Launch(launcher, rank, size, local_rank, local_size, local_size == size, job)


def detect(env: MutableMapping[str, str] | None = None) -> Launch | None:
    """The launcher that started this process, or None (Open MPI, then PMI, then Slurm:
    ``mpirun`` inside a Slurm allocation sees the allocation's variables too)."""
    env = os.environ if env is None else env
    for probe in (_open_mpi, _pmi, _slurm):
        launch = probe(env)
        if launch is not None:
            return launch
    return None


def _master_host(env: MutableMapping[str, str]) -> str | None:
    if env.get("SM_MASTER_ADDR"):
        return env["SM_MASTER_ADDR"]
    if env.get("SM_HOSTS"):
        try:
            hosts = json.loads(env["SM_HOSTS"])
        except ValueError:
            hosts = []
        if hosts:
            return str(hosts[0])
    nodelist = (
        env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    )
    if nodelist:
        nodes = expand_nodelist(nodelist)
        if nodes:
            return nodes[0]
    return None


def port_for(job_id: str) -> int:
    """The rendezvous port for a job id: the same on every rank, different across jobs."""
    return PORT_BASE + zlib.crc32(job_id.encode()) % PORT_SPAN


def fill(env: MutableMapping[str, str] | None = None) -> str | None:
    """Sets torchrun's variables from the launcher's where RANK / WORLD_SIZE are absent.

    Returns:
        None when nothing is missing or everything could be filled; else a message saying
        what to set (a job across nodes with no known rendezvous host), for the caller to
        raise when the rendezvous needs it.
    """
    env = os.environ if env is None else env
    if ENV_RANK in env or ENV_WORLD_SIZE in env:
        return None
    launch = detect(env)
    if launch is None:
        return None
    env[ENV_RANK] = str(launch.rank)
    env[ENV_WORLD_SIZE] = str(launch.world_size)
    env.setdefault(ENV_LOCAL_RANK, str(launch.local_rank))
    env.setdefault(ENV_LOCAL_WORLD_SIZE, str(launch.local_world_size))
    if ENV_MASTER_ADDR not in env:
        host = "127.0.0.1" if launch.single_node else _master_host(env)
        if host is None:
            return (
                "smddp: "
                f"this job was started by {launch.launcher} across nodes ({launch.world_size} ranks, {launch.local_world_size} on this node) and no rendezvous host is known: "  # noqa: E501
                "set MASTER_ADDR to the host name or address of rank 0's node (and MASTER_PORT to a free port there) for every rank, e.g. mpirun -x MASTER_ADDR=node1 -x MASTER_PORT=29500 ..."  # noqa: E501
            )
        env[ENV_MASTER_ADDR] = host
    if ENV_MASTER_PORT not in env:
        job = launch.job_id
        if not job and launch.single_node:
            # The ranks of one node share their launcher process (orted, hydra_pmi_proxy, srun's
            # slurmstepd) as parent: its pid names the job well enough here.
            job = f"ppid{os.getppid()}"
        env[ENV_MASTER_PORT] = str(port_for(job) if job else DEFAULT_PORT)
    return None
