"""End-to-end run of examples/train_digits.py under torchrun with 2 processes."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_digits.py"
RUN_TIMEOUT_S = 180
# What a rank prints when gloo's C++ aborts (std::terminate in one of its threads).
GLOO_ABORT = "terminate called without an active exception"


def _torchrun():
    exe = Path(sys.executable).with_name("torchrun")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def _rank_stdout(log_dir: Path, local_rank: int) -> str:
    """What one rank printed, from its own file under torchrun's ``--log-dir``.

    Not from torchrun's output: there the ranks' tee'd lines pass through torchrun's
    block-buffered stdout, which can be flushed in the middle of a line, and its line-buffered
    stderr (the ranks' stderr) shares the pipe, so a stderr line can land inside a stdout line.
    """
    files = sorted(log_dir.glob(f"*/attempt_0/{local_rank}/stdout.log"))
    assert len(files) == 1, files
    return files[0].read_text()


def _load_example(monkeypatch):
    # With SMDDP_EXAMPLE_BACKEND set the module skips the smddp import, so
    # this works whether or not the backend is installed.
    monkeypatch.setenv("SMDDP_EXAMPLE_BACKEND", "gloo")
    spec = importlib.util.spec_from_file_location("train_digits_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
@pytest.mark.parametrize("backend", ["gloo", "smddp"])
def test_train_digits(backend, tmp_path, monkeypatch):
    model_dir = tmp_path / "model"
    env = dict(os.environ)
    if backend == "smddp":
        env.pop("SMDDP_EXAMPLE_BACKEND", None)  # the script's default: import smddp
    else:
        env["SMDDP_EXAMPLE_BACKEND"] = backend

    def run(logs: Path) -> subprocess.CompletedProcess:
        cmd = _torchrun() + [
            "--standalone",
            "--nproc-per-node",
            "2",
            "--tee",
            "3",  # every rank's output also on torchrun's, "[default0]:" before each line
            "--log-dir",  # and in a file per rank, which the checks read
            str(logs),
            str(SCRIPT),
            "--model-dir",
            str(model_dir),
        ]
        return subprocess.run(
            cmd,
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )

    logs = tmp_path / "torchrun-logs"
    proc = run(logs)
    if backend == "gloo" and proc.returncode != 0 and GLOO_ABORT in proc.stdout:
        # gloo itself (this run never imports smddp) sometimes aborts in C++ on a loaded
        # 2-core machine; the gloo run is only the reference, so it gets one more try.
        shutil.rmtree(model_dir, ignore_errors=True)
        logs = tmp_path / "torchrun-logs-again"
        proc = run(logs)
    out = proc.stdout
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{out}"

    printed = [_rank_stdout(logs, r) for r in range(2)]

    # Per-epoch all-reduced losses are printed by rank 0 only.
    epoch_lines = [
        [line for line in text.splitlines() if "average training loss" in line] for text in printed
    ]
    assert [len(lines) for lines in epoch_lines] == [15, 0], out

    # Final accuracy, printed by rank 0 only.
    acc = [re.findall(r"^final accuracy: ([0-9.]+)$", text, re.MULTILINE) for text in printed]
    assert [len(found) for found in acc] == [1, 0], out
    accuracy = float(acc[0][0])
    assert accuracy > 0.90, out

    # Exactly one checkpoint, written by rank 0; no other rank claims a save.
    ckpt = model_dir / "model.pt"
    assert sorted(p.name for p in model_dir.iterdir()) == ["model.pt"]
    saves = [[line for line in text.splitlines() if "saved checkpoint" in line] for text in printed]
    assert saves == [[f"rank 0 saved checkpoint to {ckpt}"], []], out

    # The checkpoint loads into the example's model and reproduces the accuracy.
    example = _load_example(monkeypatch)
    model = example.Net()
    model.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=True))
    model.eval()
    _, test_dataset = example.load_datasets(seed=1)
    x, y = test_dataset.tensors
    with torch.no_grad():
        reloaded = (model(x).argmax(dim=1) == y).float().mean().item()
    assert reloaded == pytest.approx(accuracy, abs=1e-3)


@pytest.mark.parametrize(
    ("gpus", "local_rank", "want"),
    [(0, 1, "cpu"), (1, 0, "cuda:0"), (1, 3, "cuda:0"), (2, 3, "cuda:1"), (8, 3, "cuda:3")],
)
def test_ranks_share_the_node_s_gpus_round_robin(gpus, local_rank, want, monkeypatch):
    """With fewer GPUs than local ranks (one GPU, local rank 1 and up) the ranks share them,
    rather than fail in set_device; without GPUs the CPU (issue 27)."""
    example = _load_example(monkeypatch)
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    device = example.pick_device(local_rank)
    assert str(device) == want
    assert chosen == ([] if want == "cpu" else [device.index])
