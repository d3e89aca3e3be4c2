"""Starting smddp jobs without torchrun: Open MPI's mpirun, a Slurm step (its variables set by
hand for 3 processes), the pre-1.4 SageMaker API, the torch.backends entry point, and the
message a script started with no launcher gets."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from smddp_world import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
EXAMPLE = REPO / "examples" / "train_digits.py"
WORLD = 3
RUN_TIMEOUT_S = 400

# Not torchrun's: a launcher's processes start with none of these.
TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
)


def _clean_env(tmp_path: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in TORCHRUN_VARS and not k.startswith(("SLURM_", "OMPI_", "PMI"))
    }
    # No daemon answers here: rank 0 starts the job's embedded one.
    env["SMDDP_SOCKET"] = str(tmp_path / "absent.sock")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _mpirun(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun (Open MPI) is not installed; scripts/setup.sh installs openmpi-bin")
    env = _clean_env(tmp_path)
    # CI runs as root; --oversubscribe: more ranks than this machine's cores.
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # --tag-output: mpirun puts "[job,rank]<stdout>:" before each piece of a rank's output it
    # forwards. A piece is what one read returned, not a line (print() can write its text and its
    # newline apart), so the pieces are put back together rank by rank, each rank's stream whole.
    cmd = [
        mpirun,
        "--oversubscribe",
        "--bind-to",
        "none",
        "--tag-output",
        "-np",
        str(WORLD),
        sys.executable,
        *args,
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    return subprocess.CompletedProcess(
        cmd, proc.returncode, _by_rank(proc.stdout), _by_rank(proc.stderr)
    )


_TAG = re.compile(r"\[\d+,(\d+)\]<std(?:out|err)>:")


def _by_rank(tagged: str) -> str:
    """mpirun's tagged output as each rank's whole stream, rank 0's first; untagged text
    (mpirun's own) comes before them."""
    pieces = _TAG.split(tagged)
    streams: dict[int, list[str]] = {}
    for rank, piece in zip(pieces[1::2], pieces[2::2], strict=True):
        streams.setdefault(int(rank), []).append(piece)
    return pieces[0] + "".join("".join(streams[rank]) for rank in sorted(streams))


def _slurm_step(args: list[str], tmp_path: Path) -> list[subprocess.CompletedProcess[str]]:
    """3 processes with the variables srun gives the tasks of a one-node step."""
    env = _clean_env(tmp_path)
    env.update(
        SLURM_JOB_ID=str(free_port()),
        SLURM_STEP_ID="0",
        SLURM_NTASKS=str(WORLD),
        SLURM_STEP_NUM_TASKS=str(WORLD),
        SLURM_NNODES="1",
        SLURM_STEP_NUM_NODES="1",
        SLURM_NODEID="0",
        SLURM_JOB_NODELIST="node[01]",
        SLURM_STEP_NODELIST="node01",
        SLURM_TASKS_PER_NODE=str(WORLD),
        SLURM_STEP_TASKS_PER_NODE=str(WORLD),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            cwd=tmp_path,
            env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
    ]
    done = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=RUN_TIMEOUT_S)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return done


def _example_args(tmp_path: Path) -> list[str]:
    return [str(EXAMPLE), "--epochs", "2", "--model-dir", str(tmp_path / "model")]


def _check_example(out: str) -> None:
    assert re.search(rf"^backend=smddp world_size={WORLD} ", out, re.MULTILINE), out
    assert len(re.findall(r"^final accuracy: ([0-9.]+)$", out, re.MULTILINE)) == 1, (
        out
    )  # rank 0 only


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_sagemaker_example_under_mpirun(tmp_path: Path) -> None:
    proc = _mpirun(_example_args(tmp_path), tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    _check_example(out)
    assert (tmp_path / "model" / "model.pt").exists()


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_sagemaker_example_under_slurm_step(tmp_path: Path) -> None:
    procs = _slurm_step(_example_args(tmp_path), tmp_path)
    out = "".join(p.stdout for p in procs)
    assert [p.returncode for p in procs] == [0] * WORLD, out
    _check_example(out)
    assert (tmp_path / "model" / "model.pt").exists()


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_pre14_api_script_under_mpirun(tmp_path: Path) -> None:
    proc = _mpirun([str(HERE / "pre14_api_script.py")], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = sorted(re.findall(r"^pre14 ok .*$", out, re.MULTILINE))
    assert lines == [
        f"pre14 ok rank={r} world={WORLD} local_rank={r} local_size={WORLD}" for r in range(WORLD)
    ], out


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_backend_without_import_through_entry_point(tmp_path: Path) -> None:
    procs = _slurm_step([str(HERE / "no_import_script.py")], tmp_path)
    out = "".join(p.stdout for p in procs)
    assert [p.returncode for p in procs] == [0] * WORLD, out
    lines = sorted(re.findall(r"^no-import ok .*$", out, re.MULTILINE))
    assert lines == [
        f"no-import ok rank={r} sum=6 backend_loaded_with_torch=False" for r in range(WORLD)
    ], out


@pytest.mark.timeout(120)
def test_no_launcher_says_how_to_start(tmp_path: Path) -> None:
    script = "import torch.distributed as dist\ndist.init_process_group(backend='smddp')\n"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=_clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode != 0
    assert "environment variable RANK expected, but not set" in proc.stderr, proc.stderr
    assert (
        "start the script with a launcher: torchrun --nproc-per-node N script.py, mpirun -np N"
        in proc.stderr
    ), proc.stderr
