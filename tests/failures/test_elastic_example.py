"""examples/train_elastic.py as docs/failures.md runs it: a rank SIGKILLed, the others go on.

Four workers train DDP; one is killed (by itself at a given step, as the demo does, or by the
test at no particular point, rank 0 included). The three survivors must shrink, redo the step
that failed and finish every step; their parameters and optimizer state must end bitwise equal
to a run that trains the same steps on three ranks from the state they shrank with (the same
reduction order: smddp both times). Also measured, for the note: the time from the kill to the
survivors' first step on the shrunk group, and torchrun's full restart of the same job.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_elastic.py"
RUN_TIMEOUT_S = 240
# Generous for a loaded 2-core CI machine; the target is 1 s.
KILL_TO_STEP_BOUND_S = 10.0
KILL_TO_STEP = re.compile(r"^launcher: kill -> first step on the shrunk group: ([\d.]+) s", re.M)
FIRST_SHRUNK = re.compile(
    r"^rank \d+ -> \d+: first step on the shrunk group done at ([\d.]+)", re.M
)


def _env(tmp_path: Path) -> dict[str, str]:
    # No daemon answers here: the launcher starts the job's embedded one.
    env = dict(os.environ, SMDDP_SOCKET=str(tmp_path / "none.sock"))
    env.pop("SMDDP_EMBEDDED", None)
    return env


def _run(tmp_path: Path, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        env=_env(tmp_path),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, (
        f"train_elastic.py {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-8000:]}"
    )
    return proc.stdout


def _load(path: Path) -> dict[str, Any]:
    import torch

    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state


def _assert_bitwise_equal(got: Any, want: Any, where: str) -> None:
    import torch

    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got, key=str) == sorted(want, key=str), where
        for k in want:
            _assert_bitwise_equal(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_bitwise_equal(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def _check_against_reference(tmp_path: Path, dumps: Path, steps: int, min_after: int) -> int:
    """Trains three ranks from the survivors' state at the shrink to ``steps``; the result must
    be bitwise what the survivors reached. Returns the step the survivors shrank at."""
    shrink = _load(dumps / "shrink.pt")
    assert steps - shrink["step"] >= min_after, shrink["step"]
    ref = tmp_path / "reference"
    out = _run(
        tmp_path,
        "--nproc=3",
        f"--resume={dumps / 'shrink.pt'}",
        f"--steps={steps}",
        f"--dump-dir={ref}",
    )
    assert "launcher: ranks [] were killed; ranks [] failed" in out, out
    survivors, reference = _load(dumps / "final.pt"), _load(ref / "final.pt")
    assert survivors["step"] == reference["step"] == steps
    # Not trivially equal: training went on after the shrink.
    assert any(not survivors["model"][k].equal(shrink["model"][k]) for k in shrink["model"]), (
        "the parameters did not change after the shrink"
    )
    _assert_bitwise_equal(survivors["model"], reference["model"], "model")
    _assert_bitwise_equal(survivors["optimizer"], reference["optimizer"], "optimizer")
    return int(shrink["step"])


def _check_survivors(out: str, steps: int, killed: int) -> list[float]:
    """Every survivor trained every step on three ranks; returns when each one completed its
    first step on the shrunk group (seconds since the epoch)."""
    assert f"launcher: ranks [{killed}] were killed; ranks [] failed; the others finished" in out, (
        out
    )
    for r in range(3):
        assert f"rank {r}: trained {steps} steps on 3 ranks" in out, out
    firsts = [float(t) for t in FIRST_SHRUNK.findall(out)]
    assert len(firsts) == 3, out
    return firsts


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_demo_goes_on_after_a_kill(tmp_path: Path) -> None:
    """The demo command: rank 2 SIGKILLs itself at step 20; 20 more steps on three ranks."""
    dumps = tmp_path / "dumps"
    out = _run(
        tmp_path,
        "--nproc=4",
        "--kill-rank=2",
        "--kill-at-step=20",
        "--steps=40",
        f"--dump-dir={dumps}",
    )
    _check_survivors(out, 40, killed=2)
    found = KILL_TO_STEP.findall(out)
    assert len(found) == 1, out
    took = float(found[0])
    print(f"kill -> first step on the shrunk group: {took:.3f} s (slowest of 3 survivors)")
    assert took < KILL_TO_STEP_BOUND_S, out
    # The step the kill interrupted is redone, not skipped.
    assert _check_against_reference(tmp_path, dumps, 40, min_after=20) == 20


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_rank_0_killed_anywhere(tmp_path: Path) -> None:
    """The test SIGKILLs rank 0 (whatever it is doing) once training runs; the three others
    go on, from a state that is the same on all of them."""
    steps = 300
    dumps = tmp_path / "dumps"
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--nproc=4", f"--steps={steps}", f"--dump-dir={dumps}"],
        env=_env(tmp_path),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    stepping = threading.Event()
    pid: list[int] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if m := re.match(r"rank 0 pid (\d+)$", line):
                pid.append(int(m[1]))
            if line.startswith("rank 0: step 20 loss"):
                stepping.set()
        stepping.set()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        assert stepping.wait(RUN_TIMEOUT_S) and proc.poll() is None and pid, "".join(lines)
        killed_at = time.time()
        os.kill(pid[0], signal.SIGKILL)
        rc = proc.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=30)
    out = "".join(lines)
    assert rc == 0, out[-8000:]
    took = max(_check_survivors(out, steps, killed=0)) - killed_at
    print(f"kill (rank 0, anywhere) -> first step on the shrunk group: {took:.3f} s")
    assert took < KILL_TO_STEP_BOUND_S, out
    _check_against_reference(tmp_path, dumps, steps, min_after=20)


@pytest.mark.slow
@pytest.mark.timeout(3 * RUN_TIMEOUT_S)
def test_torchrun_restart_for_comparison(tmp_path: Path) -> None:
    """The same job under torchrun --max-restarts 1: the kill ends every worker, and the
    restarted job starts again from step 0. Measured from the kill to the restarted workers'
    first step, beside the shrink's figure."""
    logs = tmp_path / "torchrun-logs"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=4",
            "--max-restarts=1",
            f"--log-dir={logs}",
            "--tee=3",
            str(EXAMPLE),
            "--kill-rank=2",
            "--kill-at-step=20",
            "--steps=40",
        ],
        env=_env(tmp_path),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-8000:]

    def printed(attempt: int, rank: int) -> str:
        files = sorted(logs.glob(f"*/attempt_{attempt}/{rank}/stdout.log"))
        assert len(files) == 1, files
        return files[0].read_text()

    kills = re.findall(r"^rank 2: SIGKILL to itself at step 20, at ([\d.]+)$", printed(0, 2), re.M)
    assert len(kills) == 1, printed(0, 2)
    firsts = []
    for r in range(4):
        text = printed(1, r)
        assert f"rank {r}: trained 40 steps on 4 ranks" in text, text
        firsts += [
            float(t)
            for t in re.findall(
                r"^rank \d+: first step done at ([\d.]+) \(attempt 1\)$", text, re.M
            )
        ]
    assert len(firsts) == 4, firsts
    took = max(firsts) - float(kills[0])
    print(
        f"torchrun --max-restarts 1: kill -> the restarted job's first step: {took:.3f} s (from step 0)"  # noqa: E501
    )
    assert took < 120.0
