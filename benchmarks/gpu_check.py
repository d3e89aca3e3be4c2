"""The GPU check of smddp: ONE command, bounded to 540 s, that says what works on a GPU machine.

    bash benchmarks/gpu_check.sh [--quick] [--stages env,smoke,...] [--plan] [--fake-gpu]

Before a GPU session, where PyPI is reachable (no GPU needed):

    bash scripts/gpu_wheels.sh     # the wheels the lent machine's image lacks, into .whl/

The kernels need no step: benchmarks/kernel_cache/sm_90-cuda13.zip (committed) holds every
reduction module the check's worlds (2, 3, 4, 8) can ask for, compiled for the H100/H200 by
``python -m benchmarks.gpu_kernel_cache``; the daemons read it (SMDDP_KERNEL_CACHE) before
compiling anything. Then the device tool's ``run`` with:

    carry:   [".whl"]
    command: bash benchmarks/gpu_check.sh         (timeout_s 600; --quick for a second run)

Stages, each a process (group) of its own under its own cap, killed (SIGINT, then SIGKILL
after the grace) at the cap, and always followed by the summary:

- ``env``: the dependencies (this interpreter's, else the carried wheels installed with pip
  --no-index into the scratch folder), versions, NVRTC, the kernel cache's coverage, a fresh
  tensor exported by CUDA IPC;
- ``smoke``: 2 ranks, a checked all_reduce and broadcast; if it fails, ``probes`` (IPC
  mapping across processes, a cross-process event, the host-flag wait) run and the check
  goes to the summary;
- ``tests``: tests/gpu under pytest, every test's timeout capped below the stage's
  (pytest-timeout; ``gpu_check_pytest``), each test's start and end logged as it happens;
- ``seed``: the SageMaker-style script (benchmarks/gpu_seed.py) on 1 node and on 2 "nodes";
- ``speed``: smddp against gloo on the same CUDA tensors (benchmarks/gpu_speed.py).

Results: at most 8 plain files directly in OUT ($OUT, or ``--out``, else a new temporary
folder): summary.txt, check.log, env.txt, probes.txt, tests.txt, seed.txt, speed.md,
speed.json. Everything else (installed wheels, the smddp package links, caches, daemons'
sockets and logs, pytest's folders) goes to a scratch folder outside OUT. The summary line
comes last on stdout, with each stage's verdict. Exit status: 0 when every stage that ran
passed, 1 otherwise, 2 when no interpreter or dependency was usable, 64 for a bad argument.

``--fake-gpu`` is the dry run for a machine without a GPU: every stage runs the same code on
the fake GPU of the tests (tests/gpu/fake_device.py for the ranks, benchmarks/gpu_check_fake.py
for the daemons), with small sizes; the tests stage runs the fake-GPU tests of tests/gpu.
This module uses the standard library only: it runs before the dependencies are in place.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 540
GRACE_S = 5  # after SIGINT at a stage's cap, SIGKILL this much later
# Caps of the stages in seconds, in their order; each with its grace, they sum to <= BUDGET_S.
CAPS = {"env": 40, "smoke": 30, "probes": 40, "tests": 190, "seed": 80, "speed": 130}
# --quick: a second run in what a session has left after the first (about 4 minutes).
QUICK_CAPS = {"env": 25, "smoke": 25, "probes": 25, "tests": 40, "seed": 30, "speed": 40}
# The dry run (--fake-gpu) runs where no GPU is, often a small shared CI machine on which one
# import of torch takes seconds: its caps are these times the GPU run's (which --plan prints).
FAKE_SCALE = 3
# Per-test limit inside the tests stage (a hung test costs this, not the stage).
TEST_CAP_S = {False: 100, True: 35}
OUT_FILES = (
    "summary.txt",
    "check.log",
    "env.txt",
    "probes.txt",
    "tests.txt",
    "seed.txt",
    "speed.md",
    "speed.json",
)
# DIST MINIMUM: what smddp's generated code (grpcio, protobuf) and its use of the others need;
# what this interpreter lacks comes from the wheels of scripts/gpu_wheels.sh in .whl/.
DEPS = """grpcio 1.85.1
grpcio-health-checking 1.85.1
grpcio-reflection 1.85.1
protobuf 7.35
numpy 1.26
ml-dtypes 0.5
prometheus-client 0.20
pytest 8.0
pytest-timeout 2.3
typing-extensions 4.12"""
# The fake GPU's tests (no GPU needed), for the dry run's tests stage.
FAKE_TESTS = [
    "tests/gpu/test_cuda_on_fake_gpu.py::test_a_freed_allocation_is_unmapped_by_the_rank_s_next_op",
]


def _release(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def link_packages(site: Path) -> None:
    """Under ``site``, a package tree of links that mirrors pyproject.toml's package-dir."""
    import tomllib

    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    for package, source in package_dir.items():
        target = site.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for entry in sorted((REPO / source).iterdir()):
            # A sub-folder that package-dir maps itself gets its own links.
            if entry.name == "__pycache__" or f"{package}.{entry.name}" in package_dir:
                continue
            if entry.is_dir() or entry.suffix in (".py", ".pyi", ".so"):
                (target / entry.name).symlink_to(entry)


class Check:
    """One run of the check: its folders, log, stages and verdicts."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        caps = QUICK_CAPS if args.quick else CAPS
        scale = FAKE_SCALE if args.fake_gpu else 1
        self.caps = {k: v * scale for k, v in caps.items()}
        self.out = Path(
            args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="smddp-gpu-out-")
        )
        self.out.mkdir(parents=True, exist_ok=True)
        # Scratch outside OUT: only plain result files may be in OUT.
        self.scratch = Path(tempfile.mkdtemp(prefix="smddp-gpu-check-"))
        # Open for the whole run (closed by summary()): each line lands as it is written.
        self.log: IO[str] = open(self.out / "check.log", "a", buffering=1)  # noqa: SIM115
        self.t0 = time.monotonic()
        self.verdicts: dict[str, dict[str, Any]] = {}
        self.env = dict(os.environ)
        self.prepare_s = 0.0  # taken from the env stage's cap (the wheels' install)

    def say(self, line: str) -> None:
        """A line to stdout and check.log, as it happens."""
        text = f"gpu_check [{time.monotonic() - self.t0:5.0f} s]: {line}"
        print(text, flush=True)
        self.log.write(text + "\n")

    # -- the stages' environment -------------------------------------------------------------

    def prepare(self) -> str | None:
        """Dependencies, the smddp package links and the stages' environment; None when ready,
        else why not (the env stage's verdict)."""
        missing = []
        for line in DEPS.splitlines():
            dist, minimum = line.split()
            try:
                have = md.version(dist)
            except md.PackageNotFoundError:
                have = ""
            if not have or _release(have) < _release(minimum):
                missing.append((dist, have or "none", minimum))
        deps = self.scratch / "deps"
        if missing:
            wheels, unmet = [], []
            for dist, have, minimum in missing:
                hits = sorted((REPO / ".whl").glob(dist.replace("-", "_") + "-*.whl"))
                if hits:
                    wheels.append(str(hits[0]))
                    self.say(f"{dist}: {have} here, smddp needs >= {minimum}: {hits[0].name}")
                else:
                    unmet.append(f"{dist}>={minimum} (here: {have})")
            if unmet:
                return (
                    f"missing, with no wheel in {REPO / '.whl'}: {', '.join(unmet)}; run "
                    "scripts/gpu_wheels.sh where PyPI is reachable and carry .whl"
                )
            cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(deps), *wheels]  # fmt: skip  # noqa: E501
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=self.caps["env"] - 10
            )
            self.log.write(done.stdout + done.stderr)
            if done.returncode != 0:
                return f"the wheels in .whl/ did not install: {done.stderr.strip()[-300:]}"
        # smddp from this checkout without installing it: links that mirror pyproject.toml's
        # package-dir, as scripts/typecheck.sh builds them.
        site = self.scratch / "site"
        link_packages(site)
        env = self.env
        path = [str(site), str(deps), str(REPO), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        env.update(
            SMDDP_CHECK_SCRATCH=str(self.scratch),
            SMDDP_CHECK_OUT=str(self.out),
            SMDDP_CHECK_QUICK="1" if self.args.quick else "0",
            SMDDP_KERNEL_CACHE=str(REPO / "benchmarks" / "kernel_cache"),
            CUPY_CACHE_DIR=str(self.scratch / "cupy-cache"),
            TORCH_EXTENSIONS_DIR=str(self.scratch / "torch-extensions"),
            PYTHONUNBUFFERED="1",
            PYTHONDONTWRITEBYTECODE="1",
        )
        env.pop("SMDDP_SOCKET", None)
        if self.args.fake_gpu:
            env.update(
                SMDDP_CHECK_FAKE_GPU="1",
                SMDDP_CHECK_KERNEL_LEDGER=str(self.scratch / "kernels.ledger"),
            )
        return None

    # -- one stage ---------------------------------------------------------------------------

    def run(self, stage: str, cmd: list[str], tee: Path | None = None) -> dict[str, Any]:
        """Runs ``cmd`` for ``stage`` in a process group of its own under the stage's cap;
        every line goes to stdout and check.log (and ``tee``); returns the stage's verdict."""
        cap = self.caps[stage]
        if stage == "env":
            cap = max(5, int(cap - self.prepare_s))
        self.say(f"stage {stage} (cap {cap} s)")
        env = dict(self.env, SMDDP_CHECK_DEADLINE=str(time.time() + cap - 2))
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            cwd=self.scratch,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        last: list[str] = [""]
        tee_file = open(tee, "a", buffering=1) if tee else None  # noqa: SIM115  (the reader's)

        def pump() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                if line.strip():
                    last[0] = line
                print(f"  [{stage}] {line}", flush=True)
                self.log.write(f"  [{stage}] {line}\n")
                if tee_file:
                    tee_file.write(line + "\n")

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(cap)
        except subprocess.TimeoutExpired:
            timed_out = True
            self._signal(proc, signal.SIGINT)
            try:
                proc.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                self._signal(proc, signal.SIGKILL)
                proc.wait()
        # Whatever the stage left running in its group (ranks, daemons) goes with it.
        self._signal(proc, signal.SIGKILL)
        reader.join(5)
        if tee_file:
            tee_file.close()
        took = time.monotonic() - start
        verdict_path = self.scratch / f"verdict.{stage}.json"
        if stage == "tests":  # judged from pytest's counts by stage_tests
            verdict_path.write_text(json.dumps({"verdict": "FAIL", "detail": "(counted below)"}))
        if verdict_path.exists():
            verdict = json.loads(verdict_path.read_text())
        else:
            verdict = {"verdict": "FAIL", "detail": f"exit status {proc.returncode}, no verdict"}
        if timed_out:
            verdict = {
                "verdict": "FAIL",
                "detail": f"TIMEOUT at its {cap} s cap; last line: {last[0].strip()[:200]}",
            }
        verdict["seconds"] = round(took, 1)
        self.verdicts[stage] = verdict
        if stage != "tests":
            self.say(f"stage {stage}: {verdict['verdict']} in {took:.0f} s: {verdict['detail']}")
        return verdict

    @staticmethod
    def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stage_py(self, stage: str) -> dict[str, Any]:
        return self.run(stage, [sys.executable, "-m", "benchmarks.gpu_check_stages", stage])

    def stage_tests(self) -> dict[str, Any]:
        """pytest over tests/gpu (the fake GPU's tests in the dry run), counted from junit."""
        scale = FAKE_SCALE if self.args.fake_gpu else 1
        per_test = min(TEST_CAP_S[self.args.quick] * scale, self.caps["tests"] - 15)
        junit = self.scratch / "tests.xml"
        measure = self.scratch / "measurements.txt"
        tests_txt = self.out / "tests.txt"
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
        cmd += ["-p", "benchmarks.gpu_check_pytest", "--rootdir", str(REPO)]
        cmd += ["-c", str(REPO / "pyproject.toml"), f"--junitxml={junit}"]
        cmd += [f"--basetemp={self.scratch / 'pytest'}", f"--timeout={per_test}"]
        if self.args.fake_gpu:
            cmd += ["-m", "not gpu", *(str(REPO / t) for t in FAKE_TESTS)]
        else:
            cmd += ["-m", "gpu", str(REPO / "tests" / "gpu")]
        self.env.update(
            SMDDP_CHECK_TEST_CAP=str(per_test),
            SMDDP_GPU_MEASURE_FILE=str(measure),
            SMDDP_GPU_QUICK="1" if self.args.quick else "0",
        )
        if not self.args.fake_gpu:
            self.env["SMDDP_REQUIRE_GPU"] = "1"
        tests_txt.write_text(f"pytest, each test capped at {per_test} s: {' '.join(cmd)}\n")
        verdict = self.run("tests", cmd, tee=tests_txt)
        n = passed = skipped = 0
        try:
            root = ET.parse(junit).getroot()
            suites = [root] if root.tag == "testsuite" else list(root)
            n = sum(int(s.get("tests", 0)) for s in suites)
            bad = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
            skipped = sum(int(s.get("skipped", 0)) for s in suites)
            passed = n - bad - skipped
        except (OSError, ET.ParseError):
            pass
        extra = measure.read_text() if measure.exists() else ""
        with open(tests_txt, "a") as f:
            f.write(f"\n{n} run, {passed} passed, {skipped} skipped\n")
            if extra:
                f.write("measurements:\n" + extra)
        ok = n > 0 and passed == n and "TIMEOUT" not in verdict["detail"]
        detail = f"{n} run, {passed} passed, {skipped} skipped"
        if "TIMEOUT" in verdict["detail"]:
            detail += f"; {verdict['detail']}"
        verdict.update(verdict="PASS" if ok else "FAIL", detail=detail)
        self.say(f"stage tests: {verdict['verdict']} in {verdict['seconds']:.0f} s: {detail}")
        return verdict

    # -- the whole check ---------------------------------------------------------------------

    def main(self) -> int:
        stages = self.args.stages
        self.say(
            f"{'dry run on the FAKE GPU' if self.args.fake_gpu else 'GPU check'}"
            f"{' (quick)' if self.args.quick else ''}: stages {','.join(stages)}; OUT {self.out}; "
            f"scratch {self.scratch}; python {sys.executable}"
        )
        start = time.monotonic()
        problem = self.prepare()
        self.prepare_s = time.monotonic() - start
        if problem:
            self.verdicts["env"] = {"verdict": "FAIL", "detail": problem}
            self.say(f"stage env: FAIL: {problem}")
            return self.summary(2)
        go_on = True
        if "env" in stages:
            go_on = self.stage_py("env")["verdict"] == "PASS"
        if go_on and "smoke" in stages:
            go_on = self.stage_py("smoke")["verdict"] == "PASS"
        if not go_on or "probes" in stages:
            self.stage_py("probes")
        for stage in ("tests", "seed", "speed"):
            if stage not in stages:
                continue
            if not go_on:
                self.verdicts[stage] = {"verdict": "SKIP", "detail": "an earlier stage failed"}
                continue
            if stage == "tests":
                self.stage_tests()
            else:
                self.stage_py(stage)
        if self.args.fake_gpu:
            self.ledger()
        return self.summary(0 if all(v["verdict"] != "FAIL" for v in self.verdicts.values()) else 1)

    def ledger(self) -> None:
        """The dry run's daemons' kernel lookups in the prepared cache (gpu_check_fake.py)."""
        path = self.scratch / "kernels.ledger"
        lines = path.read_text().splitlines() if path.exists() else []
        hits = {x.split()[1] for x in lines if x.startswith("hit ")}
        misses = sorted({x.split()[1] for x in lines if x.startswith("miss ")})
        verdict = "PASS" if hits and not misses else "FAIL"
        detail = f"{len(hits)} modules asked for, all in the prepared cache"
        if misses:
            detail = f"{len(misses)} modules NOT in the prepared cache: {', '.join(misses[:5])}"
        elif not hits:
            detail = "no module was asked for"
        self.verdicts["kernels"] = {"verdict": verdict, "detail": detail}
        self.say(f"kernel cache lookups of the daemons: {verdict}: {detail}")

    def summary(self, rc: int) -> int:
        took = time.monotonic() - self.t0
        parts = [f"{k} {v['verdict']}" for k, v in self.verdicts.items()]
        status = "PASS" if rc == 0 else "FAIL"
        line = f"SUMMARY {status}: {'; '.join(parts)}; {took:.0f} s in all"
        with open(self.out / "summary.txt", "w") as f:
            for k, v in self.verdicts.items():
                f.write(f"{k}: {v['verdict']} ({v.get('seconds', 0)} s): {v['detail']}\n")
            f.write(line + "\n")
        json_line = json.dumps(self.verdicts)
        self.log.write(json_line + "\n")
        self.say(line)
        self.log.close()
        # Nothing but plain files directly in OUT (the device tool brings back 8, no folders).
        strays = [p.name for p in self.out.iterdir() if p.name not in OUT_FILES]
        if strays:
            print(f"gpu_check: WARNING: OUT holds more than its result files: {strays}")
        shutil.rmtree(self.scratch, ignore_errors=True)
        return rc


def plan(quick: bool) -> str:
    """The caps ``--plan`` prints: each stage's, the grace, and their sum against the budget."""
    caps = QUICK_CAPS if quick else CAPS
    total = sum(caps.values()) + GRACE_S * len(caps)
    stages = ", ".join(f"{k} {v} s" for k, v in caps.items())
    return (
        f"budget {BUDGET_S} s: {stages}; kill grace {GRACE_S} s per stage; "
        f"caps with graces {total} s; per test {TEST_CAP_S[quick]} s"
    )


def main(argv: list[str] | None = None) -> int:
    """Runs the check (see the module's docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a shorter second run")
    parser.add_argument(
        "--stages",
        default="env,smoke,tests,seed,speed",
        help="comma-separated, of env,smoke,probes,tests,seed,speed (probes run anyway after "
        "a failed smoke)",
    )
    parser.add_argument("--plan", action="store_true", help="print the caps and exit")
    parser.add_argument("--fake-gpu", action="store_true", help="the dry run without a GPU")
    parser.add_argument("--out", help="the results folder (default $OUT, else a new temp folder)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 64 if exc.code else 0
    args.stages = [s for s in args.stages.split(",") if s]
    unknown = set(args.stages) - set(CAPS)
    if unknown:
        print(f"usage: unknown stages {sorted(unknown)}; of {','.join(CAPS)}", file=sys.stderr)
        return 64
    if args.plan:
        print(plan(args.quick))
        return 0
    return Check(args).main()


if __name__ == "__main__":
    sys.exit(main())
