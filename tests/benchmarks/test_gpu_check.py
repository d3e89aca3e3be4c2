"""The GPU check where there is no GPU: benchmarks/gpu_check.sh is valid bash and refuses
clearly when no torch sees a GPU; its caps fit the lent machine's time; the prepared kernel
cache covers every module the check can ask for; and the whole check runs on the fake GPU
(``--fake-gpu``), every stage with a real verdict, its results at most 8 plain files in OUT."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
CHECK = REPO / "benchmarks" / "gpu_check.py"


def _kernel_cache():
    """benchmarks/gpu_kernel_cache.py, by path: tests/benchmarks shadows the repository's
    benchmarks package on sys.path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gpu_kernel_cache", REPO / "benchmarks" / "gpu_kernel_cache.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_the_check_never_installs_from_the_network() -> None:
    """The lent GPU machine reaches no network: the check's one pip install is --no-index
    (from .whl/), and the wheels it takes are the ones scripts/gpu_wheels.sh downloads."""
    import re

    text = CHECK.read_text()
    installs = [line for line in text.splitlines() if '"pip", "install"' in line]
    assert len(installs) == 1, "the check installs nothing: then the .whl/ path is gone"
    assert '"--no-index"' in installs[0] and '"--target"' in installs[0], installs[0]
    wheels = REPO / "scripts" / "gpu_wheels.sh"
    subprocess.run(["bash", "-n", str(wheels)], check=True)
    pinned = re.findall(r"^\s+([a-z][a-z0-9-]*)==[0-9.]+", wheels.read_text(), re.M)
    deps = re.search(r'^DEPS = """(.*?)"""', text, re.M | re.S)
    assert deps, "no DEPS in gpu_check.py"
    checked = [line.split()[0] for line in deps[1].splitlines()]
    # What the check may need from .whl/ is what gets downloaded, except what the GPU image
    # has in versions smddp takes (numpy, ml-dtypes, pytest, pytest-timeout).
    assert set(checked) - set(pinned) == {"numpy", "ml-dtypes", "pytest", "pytest-timeout"}, (
        checked,
        pinned,
    )
    assert set(pinned) <= set(checked), (checked, pinned)
    # The carry list the session must pass is written where the session reads it.
    for doc in (SCRIPT, CHECK, REPO / "docs" / "gpu-check.md"):
        assert 'carry:   [".whl"]' in doc.read_text() or '[".whl"]' in doc.read_text(), doc


def _plan(quick: bool) -> dict[str, int]:
    import re

    args = ["bash", str(SCRIPT), "--plan", *(["--quick"] if quick else [])]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True)
    head = re.fullmatch(
        r"budget (\d+) s: (.*); kill grace (\d+) s per stage; caps with graces (\d+) s; "
        r"per test (\d+) s\n",
        done.stdout,
    )
    assert head, done.stdout
    caps = {name: int(v) for name, v in re.findall(r"(\w+) (\d+) s", head[2])}
    return {
        "budget": int(head[1]),
        "grace": int(head[3]),
        "total": int(head[4]),
        "per_test": int(head[5]),
        **caps,
    }


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_the_stages_caps_sum_to_at_most_540_s(quick: bool) -> None:
    """What --plan prints (the values the run uses): every stage's cap with its kill grace
    sums to <= 540 s, one command's 600 s limit with a margin; the quick run leaves a first
    run of 540 s and a machine's start room in 15 minutes; a test's cap is below the stage's."""
    p = _plan(quick)
    stages = ("env", "smoke", "probes", "tests", "seed", "speed")
    assert set(stages) <= set(p), p
    assert sum(p[s] for s in stages) + len(stages) * p["grace"] == p["total"]
    assert p["total"] <= p["budget"] == 540
    assert p["per_test"] < p["tests"]
    if quick:
        assert p["total"] <= 240, p  # 540 s + ~90 s of start + 240 s < 15 min
    else:
        assert p["tests"] >= 150 and p["speed"] >= 100 and p["smoke"] >= 30, p


def test_the_kernel_cache_covers_every_module_the_check_can_ask_for() -> None:
    """benchmarks/kernel_cache holds, for sm_90 and CUDA 13, the current cubin (by source
    digest) of every module of worlds 2, 3, 4 and 8 that gpu_kernels.module_keys lists, which
    is the key the daemon's _prepare asks for (gpu_kernels.op_module_key); a changed kernel
    generator fails this until ``python -m benchmarks.gpu_kernel_cache`` rebuilds it."""
    kc = _kernel_cache()
    from smddp.server import gpu_kernels
    from smddp.server.gpu_runtime import PreparedKernels
    from smddp.v1 import smddp_pb2 as pb

    keys = gpu_kernels.module_keys(kc.WORLDS)
    # Every reducing kind x dtype x applicable op x world, fan-out W (all_reduce) or 1.
    assert (pb.BFLOAT16, pb.AVG, 8, 8) in keys and (pb.INT8, pb.BXOR, 3, 1) in keys
    assert (pb.FLOAT32, pb.BXOR, 2, 2) not in keys
    assert len(keys) > 400
    lacking = kc.missing()
    assert not lacking, (
        f"{len(lacking)} modules missing or stale in {kc.archive_path()} "
        f"(e.g. {gpu_kernels.kernel_name(*lacking[0], False)}): run python -m "
        "benchmarks.gpu_kernel_cache"
    )
    prepared = PreparedKernels([str(kc.FOLDER)])
    for key in keys[:: max(1, len(keys) // 25)]:
        cubin = prepared.get(key, kc.ARCH, kc.CUDA_MAJOR)
        assert cubin is not None and cubin.startswith(b"\x7fELF"), key
    assert prepared.get(keys[0], "sm_80", kc.CUDA_MAJOR) is None  # no archive for sm_80
    size = kc.archive_path().stat().st_size
    assert size < 2 << 20, f"the committed archive grew to {size} bytes"


def test_a_prepared_cubin_is_what_the_daemon_would_compile() -> None:
    """Where NVRTC is installed (the nvrtc-check extra), the prepared cubin of a module is
    byte for byte what the daemon's own compile gives."""
    try:
        import cupy

        cupy.cuda.nvrtc.getVersion()
    except Exception as exc:  # no CuPy or no NVRTC library here
        pytest.skip(f"no NVRTC here: {exc}")
    kc = _kernel_cache()
    from smddp.server.gpu_runtime import PreparedKernels, compile_module
    from smddp.v1 import smddp_pb2 as pb

    key = (pb.BFLOAT16, pb.SUM, 4, 4)
    prepared = PreparedKernels([str(kc.FOLDER)]).get(key, kc.ARCH, kc.CUDA_MAJOR)
    assert prepared == compile_module(cupy, *key, arch=kc.ARCH)


@pytest.mark.slow
@pytest.mark.timeout(1100)
def test_the_dry_run_runs_every_stage_on_the_fake_gpu(tmp_path: Path) -> None:
    """``gpu_check.sh --fake-gpu``: every stage runs on the fake GPU and says PASS, except
    the seed on 2 nodes, whose verdict is there either way (GPU tensors across nodes are
    being built: today it fails with the refusal's message); the daemons found every module
    they were asked for in the prepared cache; OUT holds at most 8 plain files, the summary
    last on stdout, and the scratch folder is gone."""
    import re

    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", str(SCRIPT), "--fake-gpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1080,
    )
    text = done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert "SUMMARY" in last, text[-3000:]
    verdicts = dict(re.findall(r"(\w+) (PASS|FAIL|SKIP)", last.split("SUMMARY", 1)[1]))
    assert set(verdicts) == {"env", "smoke", "tests", "seed", "speed", "kernels"}, last
    for stage in ("env", "smoke", "tests", "speed", "kernels"):
        assert verdicts[stage] == "PASS", f"{stage}: {text[-4000:]}"
    summary = (out / "summary.txt").read_text()
    assert "tests: PASS" in summary and "1 run, 1 passed, 0 skipped" in summary, summary
    assert "1 node: PASS (2 ranks trained" in summary and "parameters identical" in summary
    two = re.search(r"2 nodes: (PASS|FAIL) \((.+?)\)", summary)
    assert two, summary
    if two[1] == "FAIL":  # it names why
        assert "Error" in two[2], summary
    assert re.search(r"kernels: PASS .*\d+ modules asked for, all in the prepared cache", summary)
    assert done.returncode == (0 if verdicts["seed"] == "PASS" else 1), text[-2000:]
    speed = (out / "speed.md").read_text()
    ops = [("all_reduce", "float32"), ("all_reduce", "bfloat16"), ("broadcast", "float32")]
    ops += [("all_gather", "float32"), ("reduce_scatter", "float32")]
    for op, dtype in ops:
        assert re.search(rf"\| 2 \| {op} \| {dtype} \| 4 B \| .+ \| ok \|", speed), speed
    assert "## DDP step" in speed and "spends its time" in speed, speed
    assert (
        "kernel cache 496/496" in (out / "env.txt").read_text()
        or "496 of 496" in (out / "env.txt").read_text()
    )
    files = list(out.iterdir())
    assert len(files) <= 8, files
    for f in files:
        assert f.is_file() and not f.is_symlink(), f
    assert {f.name for f in files} <= {
        "summary.txt", "check.log", "env.txt", "probes.txt", "tests.txt", "seed.txt",
        "speed.md", "speed.json",
    }  # fmt: skip
    scratch = re.search(r"scratch (\S+);", text)
    assert scratch and not Path(scratch[1]).exists(), "the scratch folder was left behind"


@pytest.mark.timeout(300)
def test_the_probes_run_on_the_fake_gpu(tmp_path: Path) -> None:
    """``--stages probes`` (what runs after a failed smoke op): IPC mapping across
    processes, a cross-process event and the host-flag wait, each in a child process of its
    own, on the fake GPU."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", str(SCRIPT), "--fake-gpu", "--stages", "probes"],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    probes = (out / "probes.txt").read_text()
    for name in ("IPC mapping across processes: ok", "cross-process event: ok", "host-flag wait"):
        assert name in probes, probes + done.stdout[-2000:]
    assert "probes PASS" in done.stdout.strip().splitlines()[-1], done.stdout[-2000:]
