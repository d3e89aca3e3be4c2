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
    log = (tmp_path / "check.log").read_text()
    assert "this script installs no torch (it never uses the network)" in log
    assert log.splitlines()[-1] == "gpu_check: SUMMARY FAIL: no GPU usable from torch; nothing ran"


def test_the_script_refuses_unknown_arguments() -> None:
    done = subprocess.run(
        ["bash", str(SCRIPT), "--fast"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 64 and "usage:" in done.stderr


@pytest.mark.timeout(120)
def test_required_gpu_tests_fail_instead_of_skipping(tmp_path: Path) -> None:
    """What gpu_check.sh sets: SMDDP_REQUIRE_GPU=1 turns each GPU test's skip into a
    failure naming why it cannot run, so a check with no GPU (or no CuPy) cannot pass."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the GPU tests would run")
    env = dict(os.environ, SMDDP_REQUIRE_GPU="1")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            str(REPO / "tests" / "gpu" / "test_cuda_ordering.py"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        cwd=REPO,
    )
    assert done.returncode == 1, done.stdout
    assert "2 errors" in done.stdout and "skipped" not in done.stdout  # failed in setup
    assert "SMDDP_REQUIRE_GPU=1, but the GPU tests cannot run here: no CUDA GPU" in done.stdout
    plain = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            str(REPO / "tests" / "gpu" / "test_cuda_ordering.py"),
        ],
        env={k: v for k, v in os.environ.items() if k != "SMDDP_REQUIRE_GPU"},
        capture_output=True,
        text=True,
        timeout=100,
        cwd=REPO,
    )
    assert plain.returncode == 0 and "2 skipped" in plain.stdout, plain.stdout


def test_benchmark_iterations_are_bounded() -> None:
    import importlib.util

    # By path: tests/benchmarks shadows the repository's benchmarks package on sys.path.
    spec = importlib.util.spec_from_file_location(
        "gpu_allreduce", REPO / "benchmarks" / "gpu_allreduce.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    iterations = module.iterations

    budget = 4 << 30
    assert iterations(1 << 20, budget) == 100
    assert iterations(256 << 20, budget) == 16
    assert iterations(1 << 30, budget) == 5


def test_the_script_never_installs_from_the_network() -> None:
    """The lent GPU machine reaches no network: every pip install of the script is --no-index
    (from .whl/), and the wheels it takes are the ones scripts/gpu_wheels.sh downloads."""
    import re

    text = SCRIPT.read_text()
    joined = text.replace("\\\n", " ")  # continued lines as one
    installs = [line for line in joined.splitlines() if re.search(r"-m pip install", line)]
    assert installs, "the script installs nothing: then the .whl/ path is gone"
    for line in installs:
        assert "--no-index" in line and "--target" in line, line
    wheels = REPO / "scripts" / "gpu_wheels.sh"
    subprocess.run(["bash", "-n", str(wheels)], check=True)
    pinned = re.findall(r"^\s+([a-z][a-z0-9-]*)==[0-9.]+", wheels.read_text(), re.M)
    checked = re.findall(r"^(?:DEPS=\")?([a-z][a-z0-9-]*) [0-9.]+\"?$", text, re.M)
    # What the script checks and may need from .whl/ is what gets downloaded, except what the
    # GPU image has in versions smddp takes (numpy, ml-dtypes, pytest, pytest-timeout).
    assert set(checked) - set(pinned) == {"numpy", "ml-dtypes", "pytest", "pytest-timeout"}, (
        checked,
        pinned,
    )
    assert set(pinned) <= set(checked), (checked, pinned)


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_the_check_s_stages_fit_in_eight_minutes(quick: bool) -> None:
    """The stages' caps (what ``--plan`` prints, the values the run uses), each with its kill
    grace, fit in the budget, and the budget in 8 minutes with a last grace to spare; every
    stage that can run long (pip, the environment and warm-up, pytest, the benchmark) runs
    under ``timeout`` with a limit the budget sets."""
    import re

    args = ["bash", str(SCRIPT), "--plan", *(["--quick"] if quick else [])]
    done = subprocess.run(args, capture_output=True, text=True, timeout=30, check=True)
    plan = re.fullmatch(
        r"budget (\d+) s: setup (\d+) s, tests (\d+) s, benchmark (\d+) s, "
        r"kill grace (\d+) s per stage\n",
        done.stdout,
    )
    assert plan, done.stdout
    budget, setup, tests, bench, grace = map(int, plan.groups())
    assert setup + tests + bench + 3 * grace <= budget
    assert budget + grace < 8 * 60
    assert tests >= 200 and bench >= 60 and setup >= 60  # each stage can still do its work
    joined = SCRIPT.read_text().replace("\\\n", " ")
    long_running = [
        line
        for line in joined.splitlines()
        if re.search(r'"\$PY" (-m (pip|pytest|benchmarks)|- <<)', line)
    ]
    assert len(long_running) == 4, long_running
    bounded = r'\btimeout (?:-s INT )?-k "\$KILL_GRACE_S" "\$\(?(\w+)'
    for line in long_running:
        assert re.search(bounded, line), line
    commands = re.findall(r"\btimeout -", joined)
    limits = re.findall(bounded, joined)
    assert len(limits) == len(commands) == 4, (limits, commands)
    assert set(limits) == {"limit", "SETUP_S", "TESTS_TIMEOUT", "BENCH_TIMEOUT"}, limits
    for name in ("SETUP_S", "TESTS_TIMEOUT", "BENCH_TIMEOUT"):
        assert re.search(rf"^{name}=\$\(limit ", joined, re.M), name
