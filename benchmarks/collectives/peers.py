"""The paired benchmark's peers beside smddp and gloo: Open MPI and DeepSpeed's SHM op.

Both run in the benchmark's own rank processes, on the same buffers as the torch groups:

- **Open MPI** through mpi4py on numpy views of the tensors, when the benchmark runs under
  ``mpirun`` (``OMPI_COMM_WORLD_SIZE`` set) and mpi4py imports. MPI is initialised with
  ``MPI_THREAD_FUNNELED``: only the main thread calls MPI (smddp's and gloo's threads never do),
  and Open MPI takes no locks on its fast path at that level, as a plain MPI program would run.
- **DeepSpeed's SHM all_reduce** (``torch.ops.deepspeed.inference_all_reduce_``, the op
  DeepSpeed uses for tensor-parallel inference on CPUs), where DeepSpeed is installed and its op
  builds. It needs ``LOCAL_SIZE`` equal to the number of ranks on the node (only DeepSpeed's
  launcher sets it) and ``DS_ACCELERATOR=cpu``. It is an anchor for speed only: it returns
  float64 and int32 tensors unreduced and sums for MAX, so only float32 SUM all_reduce is timed
  with it (other cells say "–"). It leaves a shared-memory file of about 66 MiB per rank in
  /dev/shm, which ``close`` removes.

A peer that cannot run says why in its column: "not installed", "not under mpirun", or
"not built: ..." with the error's first line.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MPI = "Open MPI"
DEEPSPEED = "DeepSpeed SHM"
PEERS = (MPI, DEEPSPEED)
NOT_INSTALLED = "not installed"
NOT_UNDER_MPIRUN = "not under mpirun"
NOT_ASKED = "not asked for"
# --peers' names of the peers, in PEERS' order.
PEER_FLAGS = ("mpi", "deepspeed")

# DeepSpeed's SHM op names its file /dev/shm/<prefix>_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>
# (deepspeed/ops/csrc/cpu/comm/shm.cpp); the benchmark gives it names of its own.
_DS_PREFIX = "deepspeed_allreduce_buffer"
_DS_ADDR = "smddpbench"


def under_mpirun() -> bool:
    """True in a rank that Open MPI's mpirun started."""
    return bool(os.environ.get("OMPI_COMM_WORLD_SIZE"))


def mpi_world() -> tuple[int, int, int] | None:
    """(rank, size, local size) from Open MPI's variables, or None outside mpirun."""
    if not under_mpirun():
        return None
    env = os.environ
    size = int(env["OMPI_COMM_WORLD_SIZE"])
    return (
        int(env.get("OMPI_COMM_WORLD_RANK", "0")),
        size,
        int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", str(size))),
    )


def mpi4py_installed() -> bool:
    """True where mpi4py imports (without initialising MPI)."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class Peers:
    """This rank's peers: the ones that run, and why the others do not.

    Attributes:
        comm: MPI_COMM_WORLD (mpi4py) where Open MPI runs, else None.
        ds_op: DeepSpeed's in-place all_reduce where it runs, else None.
        status: per peer in ``PEERS``, None where it runs, else why not.
    """

    comm: Any = None
    ds_op: Callable[[Any], Any] | None = None
    status: dict[str, str | None] = field(default_factory=dict)
    _ds_file: str | None = None

    def close(self) -> None:
        """Removes DeepSpeed's shared-memory file of this rank (once every rank has mapped it:
        call after a barrier); MPI is finalised by mpi4py at exit."""
        if self._ds_file is not None:
            try:
                os.unlink(self._ds_file)
            except FileNotFoundError:
                pass
            self._ds_file = None


def start_mpi(peers: Peers) -> None:
    """Initialises MPI where the rank runs under mpirun and mpi4py imports."""
    if not mpi4py_installed():
        peers.status[MPI] = NOT_INSTALLED
        return
    if not under_mpirun():
        peers.status[MPI] = NOT_UNDER_MPIRUN
        return
    import mpi4py

    mpi4py.rc.thread_level = "funneled"
    from mpi4py import MPI as mpi

    peers.comm = mpi.COMM_WORLD
    peers.status[MPI] = None


def start_deepspeed(
    peers: Peers, rank: int, world: int, token: str, barrier: Callable[[], None]
) -> None:
    """Builds (or loads, once built) DeepSpeed's SHM op and maps every rank's buffer.

    Args:
        peers: where the op and its status go.
        rank: this rank.
        world: the number of ranks, all on this node.
        token: the same string on every rank, unique to this run: the shared-memory file's name.
        barrier: waits for every rank (rank 0 builds the op before the others load it, so that
            they do not all compile it at once).
    """
    os.environ["DS_ACCELERATOR"] = "cpu"  # before DeepSpeed looks for a GPU
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        peers.status[DEEPSPEED] = NOT_INSTALLED
        barrier()
        barrier()
        return
    except Exception as exc:  # an installed DeepSpeed that fails on import
        peers.status[DEEPSPEED] = f"not importable: {_first_line(exc)}"
        barrier()
        barrier()
        return
    module: Any = None
    error: str | None = None
    for turn in (0, 1):  # rank 0 first; the others then load what it built
        if (rank == 0) == (turn == 0):
            try:
                module = _build_shm_op()
            except Exception as exc:
                error = f"not built: {_first_line(exc)}"
        barrier()
    if module is None:
        peers.status[DEEPSPEED] = error or "not built: DeepSpeed says its SHM op is incompatible"
        return
    # DeepSpeed reads these when it maps the ranks' buffers: LOCAL_SIZE must equal the world
    # (else it falls back to nothing and the op does not reduce); the address and port only
    # name the files. Set for the call, then restored.
    saved = {k: os.environ.get(k) for k in ("LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    os.environ.update(LOCAL_SIZE=str(world), MASTER_ADDR=_DS_ADDR, MASTER_PORT=token)
    try:
        module.initialize(world, rank)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    peers._ds_file = f"/dev/shm/{_DS_PREFIX}_{os.getuid()}_{_DS_ADDR}_{token}_{rank}"
    import torch

    peers.ds_op = torch.ops.deepspeed.inference_all_reduce_
    peers.status[DEEPSPEED] = None


def _build_shm_op() -> Any:
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        raise RuntimeError("DeepSpeed's CPU accelerator has no ShareMemCommBuilder")
    return builder.load(verbose=False)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def run_token() -> str:
    """A name unique to this run on this machine (rank 0 makes it; every rank uses it)."""
    return f"{os.getpid()}{time.monotonic_ns() % 1_000_000}"
