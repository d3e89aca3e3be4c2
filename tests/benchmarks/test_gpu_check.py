"""benchmarks/gpu_check.sh and benchmarks/gpu_allreduce.py where there is no GPU: the script
is valid bash and refuses clearly when no torch sees a GPU; the benchmark's sizing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def test_the_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert os.access(SCRIPT, os.X_OK)


@pytest.mark.timeout(120)
def test_without_a_gpu_the_script_says_so(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would run the whole check")
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path))
    done = subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no Python here has a torch that sees a GPU" in done.stdout
    assert "smddp does not install torch" in (tmp_path / "check.log").read_text()


def test_benchmark_iterations_are_bounded() -> None:
    from benchmarks.gpu_allreduce import iterations

    budget = 4 << 30
    assert iterations(1 << 20, budget) == 100
    assert iterations(256 << 20, budget) == 16
    assert iterations(1 << 30, budget) == 5
