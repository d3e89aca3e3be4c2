"""DeepSpeed ZeRO 1-3, Lightning DDP and the Hugging Face Trainer (DDP on CPU) on backend
"smddp", each a script started by torchrun with 3 processes and its own embedded daemon."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
WORLD = 3
# DeepSpeed's first run builds a small C++ op (about 2.5 minutes alone on 2 cores).
RUN_TIMEOUT_S = 900


def _torchrun(script: str, tmp_path: Path, extra_env: dict[str, str] | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM_"))}
    env.update(SMDDP_SOCKET=str(tmp_path / "absent.sock"), OMP_NUM_THREADS="1", **(extra_env or {}))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(WORLD),
        # Else torchrun makes /tmp/torchelastic_* for its logs and never removes it.
        "--log-dir",
        str(tmp_path / "torchrun-logs"),
        str(HERE / script),
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def _need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(
            f"{module} is not installed (scripts/setup.sh installs "
            "tests/frameworks/requirements.txt)"
        )


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_deepspeed_zero_1_2_3(tmp_path: Path) -> None:
    _need("deepspeed")
    losses = {}
    for backend in ("gloo", "smddp"):
        out = _torchrun(
            "deepspeed_script.py", tmp_path, {"DS_ACCELERATOR": "cpu", "DS_TEST_BACKEND": backend}
        )
        # Not anchored at the line's start: the ranks share torchrun's pipe, and another rank's
        # unflushed text (no newline yet) can come just before rank 0's one-write line.
        found = re.findall(r"deepspeed ok (\{[^{}\n]*\})", out)
        assert len(found) == 1, out
        losses[backend] = json.loads(found[0])
    # The same training on both backends: sums in another order round differently, no more.
    assert losses["smddp"].keys() == losses["gloo"].keys() == {"zero1", "zero2", "zero3"}
    for stage, got in losses["smddp"].items():
        assert got == pytest.approx(losses["gloo"][stage], rel=1e-5), (stage, losses)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_lightning_ddp(tmp_path: Path) -> None:
    _need("lightning")
    out = _torchrun("lightning_script.py", tmp_path)
    assert f"lightning ok world={WORLD} steps=8" in out, out


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_hf_trainer_ddp_cpu(tmp_path: Path) -> None:
    _need("transformers")
    out = _torchrun("hf_trainer_script.py", tmp_path)
    assert f"hf trainer ok world={WORLD} steps=4" in out, out
