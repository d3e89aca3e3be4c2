#!/usr/bin/env bash
# The GPU check of smddp (issues 4, 15, 17): tests/gpu (with the measurements of the GPU
# path's hazards), then the GPU all_reduce benchmark, ending in ONE summary line. It fails (non-zero)
# unless CuPy imports with a working NVRTC, a GPU is seen, and the GPU tests ran and passed
# (they are counted: none skipped, none deselected by accident). Meant for a GPU machine with
# no network, such as the lent H200 (Python 3.12 at /opt/torch/.venv, torch 2.11.0+cu130,
# cupy-cuda13x 14.2.0): it never installs from the network and writes nothing outside $OUT.
#
#   bash scripts/gpu_wheels.sh              # first, where PyPI is reachable: fills .whl/
#   bash benchmarks/gpu_check.sh --quick    # on the GPU machine: worlds 2,4; 1, 16, 256 MiB
#   bash benchmarks/gpu_check.sh            # worlds 2,3,4; 1 MiB..1 GiB
#
# Environment:
#   PYTHON  the interpreter to use. Default: the first of .venv/bin/python, python3, python
#           whose torch is a CUDA build that sees a GPU.
#   OUT     where logs and results go (default: a new temp folder).
# What smddp needs that this interpreter lacks (or has older than smddp needs) comes from the
# wheels in .whl/ (scripts/gpu_wheels.sh), installed with pip --no-index into $OUT/deps, which
# goes first on PYTHONPATH. smddp itself is not installed: a folder of symlinks maps this
# checkout to the smddp.* packages.
#
# Time: the whole check is bounded by BUDGET_S (450 s: it must finish within 8 minutes on one
# H100/H200, the lent machine's slot): each stage runs under `timeout`, with the smaller of its
# own cap (below; `--plan` prints them) and what the budget has left once the later stages'
# shares are set aside. A stage cut short fails the check; the summary line still comes.
#
# Exit status: 0 all passed; 2 no usable torch/GPU, or a torch smddp's backend refuses; 3 CuPy,
# NVRTC or a dependency unusable; 4 the GPU tests failed, skipped or did not run; 5 the
# benchmark failed. The measurements of the GPU path's hazards (memory after del +
# empty_cache, a forced allocator retry (asserted to succeed: close before free), a killed rank, capture, a 2^31+17-element int8
# all_reduce) are GPU tests too: each prints a "measure:" line after the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
QUICK=0
PLAN=0
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=1 ;;
    --plan) PLAN=1 ;;
    *) echo "usage: $0 [--quick] [--plan]" >&2; exit 64 ;;
  esac
done

# -- the time budget -----------------------------------------------------------------------------
BUDGET_S=450
KILL_GRACE_S=10  # after SIGINT at a stage's limit, SIGKILL this much later
# Caps of the stages, in seconds: setup (dependencies, environment, kernel cache warmed, the
# hook's cold build), the GPU tests, the benchmark. They sum, with a grace each, to BUDGET_S.
SETUP_CAP_S=100
if [ "$QUICK" = 1 ]; then TESTS_CAP_S=240; BENCH_CAP_S=80; else TESTS_CAP_S=220; BENCH_CAP_S=100; fi
if [ "$PLAN" = 1 ]; then
  echo "budget $BUDGET_S s: setup $SETUP_CAP_S s, tests $TESTS_CAP_S s, benchmark $BENCH_CAP_S s, kill grace $KILL_GRACE_S s per stage"
  exit 0
fi
OUT=${OUT:-$(mktemp -d -t smddp-gpu-check.XXXXXX)}
mkdir -p "$OUT"
say() { echo "gpu_check: $*" | tee -a "$OUT/check.log"; }
T0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }
# limit CAP RESERVE: seconds a stage may run: CAP, or less where the budget, after RESERVE
# seconds kept for the stages after it (and this stage's kill grace), has less left.
limit() {
  local left=$(( BUDGET_S - ($(date +%s) - T0) - $2 - KILL_GRACE_S ))
  if [ "$left" -lt "$1" ]; then echo $(( left > 1 ? left : 1 )); else echo "$1"; fi
}

# -- an interpreter whose torch sees a GPU --------------------------------------------------------
has_cuda_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for candidate in "$REPO/.venv/bin/python" "$(command -v python3 || true)" "$(command -v python || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && has_cuda_torch "$candidate"; then PY=$candidate; break; fi
  done
fi
if [ -z "$PY" ] || ! has_cuda_torch "$PY"; then
  say "no Python here has a torch that sees a GPU (set PYTHON=...); this script installs no torch (it never uses the network)"
  nvidia-smi -L 2>&1 | tee -a "$OUT/check.log" || true
  say "SUMMARY FAIL: no GPU usable from torch; nothing ran"
  exit 2
fi
TORCH_CUDA=$("$PY" -c 'import torch; print(torch.version.cuda)')
CUDA_MAJOR=${TORCH_CUDA%%.*}

# -- what the daemon and the tests need: this interpreter's, else a wheel from .whl/ (offline) -----
# DIST MINIMUM: what smddp's generated code (grpcio, protobuf) and its use of the others need.
DEPS="grpcio 1.85.1
grpcio-health-checking 1.85.1
grpcio-reflection 1.85.1
protobuf 7.35
numpy 1.26
ml-dtypes 0.5
prometheus-client 0.20
pytest 8.0
pytest-timeout 2.3
typing-extensions 4.12"
MISSING=$("$PY" - "$DEPS" <<'EOF'
import importlib.metadata as md, re, sys
def release(v):
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])
for line in sys.argv[1].splitlines():
    dist, minimum = line.split()
    try:
        have = md.version(dist)
    except md.PackageNotFoundError:
        have = None
    if have is None or release(have) < release(minimum):
        print(dist, have or "none", minimum)
EOF
)
DEPS_DIR="$OUT/deps"
if [ -n "$MISSING" ]; then
  WHEELS=()
  UNMET=()
  while read -r dist have minimum; do
    # A wheel's file name spells the project with underscores (PEP 427).
    hit=$(ls "$REPO/.whl/${dist//-/_}"-*.whl 2>/dev/null | head -n 1)
    if [ -n "$hit" ]; then
      WHEELS+=("$hit")
      say "$dist: $have here, smddp needs >= $minimum: installing $(basename "$hit") from .whl/"
    else
      UNMET+=("$dist>=$minimum (here: $have)")
    fi
  done <<<"$MISSING"
  if [ "${#UNMET[@]}" != 0 ]; then
    say "missing, with no wheel in $REPO/.whl: ${UNMET[*]}; run scripts/gpu_wheels.sh where PyPI is reachable and bring .whl along"
    say "SUMMARY FAIL: smddp's dependencies are not all here; nothing ran"
    exit 3
  fi
  if ! timeout -k "$KILL_GRACE_S" "$(limit "$SETUP_CAP_S" $(( TESTS_CAP_S + BENCH_CAP_S + 2 * KILL_GRACE_S )))" \
      "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target "$DEPS_DIR" "${WHEELS[@]}" >>"$OUT/check.log" 2>&1; then
    say "SUMMARY FAIL: the wheels in .whl/ did not install (see $OUT/check.log); nothing ran"
    exit 3
  fi
fi

# CuPy of torch's CUDA major: the daemon compiles with CuPy's NVRTC, which must be of the job's
# CUDA major (a cu13 torch brings libnvrtc.so.13 and a driver that may be too old for cu12's).
case "$CUDA_MAJOR" in
  12) CUPY_PKG=cupy-cuda12x ;;
  13) CUPY_PKG=cupy-cuda13x ;;
  *) say "SUMMARY FAIL: torch's CUDA is $TORCH_CUDA; smddp's daemon supports CUDA 12 and 13 builds"; exit 2 ;;
esac
installed() { "$PY" -c "import importlib.metadata as m; m.version('$1')" >/dev/null 2>&1; }
if ! installed "$CUPY_PKG"; then
  say "torch here is CUDA $TORCH_CUDA and $CUPY_PKG is not installed (pip install '$CUPY_PKG==14.2.0' where PyPI is reachable)"
  say "SUMMARY FAIL: no CuPy of torch's CUDA major; nothing ran"
  exit 3
fi

# NVRTC of torch's CUDA major, where the daemon (this interpreter) finds it: CuPy 14 looks in
# the nvidia-* wheels itself; LD_LIBRARY_PATH covers a daemon started from another environment.
NVRTC_DIR=$("$PY" - "$CUDA_MAJOR" <<'EOF' 2>/dev/null
import glob, os, site, sys
major = sys.argv[1]
roots = site.getsitepackages() + [site.getusersitepackages()]
for root in roots:
    for pattern in (f"nvidia/cuda_nvrtc/lib/libnvrtc.so.{major}*", f"nvidia/cu{major}/lib/libnvrtc.so.{major}*"):
        hits = glob.glob(os.path.join(root, pattern))
        if hits:
            print(os.path.dirname(hits[0]))
            sys.exit(0)
EOF
)
if [ -n "$NVRTC_DIR" ]; then export LD_LIBRARY_PATH="$NVRTC_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi

# -- smddp from this checkout, without installing it ---------------------------------------------
SITE="$OUT/site"
rm -rf "$SITE" && mkdir -p "$SITE/smddp"
for f in "$REPO"/smddp/*.py; do ln -s "$f" "$SITE/smddp/"; done
ln -s "$REPO/server" "$SITE/smddp/server"
ln -s "$REPO/client" "$SITE/smddp/client"
ln -s "$REPO/backend" "$SITE/smddp/backend"
ln -s "$REPO/protos/smddp/v1" "$SITE/smddp/v1"
ln -s "$REPO/compat/smdistributed" "$SITE/smdistributed"
# The carried wheels first: they stand in for what this interpreter lacks or has too old.
export PYTHONPATH="$SITE:$DEPS_DIR:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export CUPY_CACHE_DIR="$OUT/cupy-cache"
# The ranks' close-before-free hook is cached here too: its build below is a cold one, timed,
# and nothing is written outside $OUT (the ranks of the tests inherit it).
export TORCH_EXTENSIONS_DIR="$OUT/torch-extensions"
# Run from $OUT: in the checkout, its smddp/ folder would shadow the mapped package.
cd "$OUT"

# -- the environment, and a warm kernel cache (the daemon's compile path, timed) ---------------
# smddp's backend checks torch's version when it is imported: say up front whether it takes this one.
if ! TORCH_OK=$("$PY" -c 'import torch
from smddp.backend.version import SUPPORTED, check_torch
check_torch()
print(f"torch {torch.__version__}: smddp backend supports it ({SUPPORTED})")' 2>&1 | tail -n 1); then
  say "torch here is refused by smddp's backend: $TORCH_OK"
  say "SUMMARY FAIL: smddp's backend does not support this torch; nothing ran"
  exit 2
fi
say "$TORCH_OK"
say "environment ($(elapsed)):"
nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_mode --format=csv,noheader 2>&1 | tee -a "$OUT/check.log" || true
SETUP_S=$(limit "$SETUP_CAP_S" $(( TESTS_CAP_S + BENCH_CAP_S + 2 * KILL_GRACE_S )))
if ! timeout -k "$KILL_GRACE_S" "$SETUP_S" "$PY" - <<'EOF' 2>&1 | tee -a "$OUT/check.log"; then
import sys, time
import torch
print(f"python {sys.version.split()[0]} at {sys.executable}")
print(f"torch {torch.__version__} CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")
import cupy
print(f"cupy {cupy.__version__} (CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}), sees {cupy.cuda.runtime.getDeviceCount()} GPU(s)")
print(f"nvrtc {cupy.cuda.nvrtc.getVersion()}", end=" ")
with open("/proc/self/maps") as maps:
    libs = sorted({line.split()[-1] for line in maps if "libnvrtc" in line})
print("from", ", ".join(libs) or "?")
# The CuPy that imports, and its NVRTC, must be of torch's CUDA major (both CuPy builds
# installed share the cupy package: the one installed last wins).
want = int(torch.version.cuda.split(".")[0])
got = {"CuPy's CUDA runtime": cupy.cuda.runtime.runtimeGetVersion() // 1000, "NVRTC": cupy.cuda.nvrtc.getVersion()[0]}
wrong = [f"{what} is CUDA {major}" for what, major in got.items() if major != want]
if wrong:
    print(f"torch is CUDA {torch.version.cuda} but {', '.join(wrong)}: the daemon's kernels would not match the job's CUDA")
    sys.exit(3)
import importlib.metadata as md
for dist in ("grpcio", "grpcio-health-checking", "protobuf", "numpy", "ml-dtypes", "cupy-cuda12x", "cupy-cuda13x"):
    try:
        print(f"{dist} {md.version(dist)}", end="; ")
    except md.PackageNotFoundError:
        pass
print()
import smddp
from smddp.server import gpu_runtime
print("smddp from", smddp.__file__)
rt = gpu_runtime.CupyRuntime()
start = time.monotonic()
first = rt.warm(0, gpu_runtime.COMMON_KERNELS[:1])
one = time.monotonic() - start
rt.warm(0, gpu_runtime.COMMON_KERNELS)
print(f"first kernel compile {one:.2f} s; {len(gpu_runtime.COMMON_KERNELS)} common kernels warm in {time.monotonic() - start:.1f} s (cache {__import__('os').environ['CUPY_CACHE_DIR']})")
# Close before free: the ranks' allocator hook (backend/csrc/), built here once so the tests find it
# cached; a failure is printed, and tests/gpu/test_cuda_memory.py then fails on it.
from smddp.backend import cuda_free_hook
start = time.monotonic()
try:
    lib = cuda_free_hook.build_hook()
    cold = time.monotonic() - start
    start = time.monotonic()
    cuda_free_hook.build_hook()  # what every later rank of the node does: a cache hit
    warm = time.monotonic() - start
    print(f"close-before-free hook: cold build {cold:.1f} s, warm load {warm * 1e3:.0f} ms: {lib._name}")
except Exception as exc:
    print(f"close-before-free hook NOT built ({type(exc).__name__}: {str(getattr(exc, 'stderr', '') or exc)[-400:]})")
EOF
  say "SUMMARY FAIL: CuPy/NVRTC of torch's CUDA cannot compile the daemon's kernels here, or the setup took more than $SETUP_S s (see $OUT/check.log); the GPU tests did not run"
  exit 3
fi

# -- the GPU tests (counted) ------------------------------------------------------------------------
TESTS_TIMEOUT=$(limit "$TESTS_CAP_S" $(( BENCH_CAP_S + KILL_GRACE_S )))
# SIGINT first: pytest then stops, still writing its summary and the junit counts read below.
say "tests/gpu (log: $OUT/gpu-tests.log) at $(elapsed), at most $TESTS_TIMEOUT s"
MEASURED="$OUT/measurements.txt"
rm -f "$MEASURED"
SMDDP_GPU_MEASURE_FILE="$MEASURED" SMDDP_REQUIRE_GPU=1 SMDDP_GPU_QUICK=$QUICK timeout -s INT -k "$KILL_GRACE_S" "$TESTS_TIMEOUT" "$PY" -m pytest -q -rs -p no:cacheprovider \
  --rootdir "$REPO" -c "$REPO/pyproject.toml" --junitxml="$OUT/gpu-tests.xml" -m gpu \
  "$REPO/tests/gpu" 2>&1 | tee "$OUT/gpu-tests.log"
TESTS_RC=${PIPESTATUS[0]}
COUNTS=$("$PY" - "$OUT/gpu-tests.xml" <<'EOF' 2>/dev/null
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
n = sum(int(s.get("tests", 0)) for s in suites)
bad = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
skipped = sum(int(s.get("skipped", 0)) for s in suites)
print(n, n - bad - skipped, skipped)
EOF
)
read -r N_RUN N_PASSED N_SKIPPED <<<"${COUNTS:-0 0 0}"
say "tests/gpu: exit status $TESTS_RC, $N_RUN run, $N_PASSED passed, $N_SKIPPED skipped ($(elapsed))"
if [ -s "$MEASURED" ]; then
  while IFS= read -r line; do say "measure: $line"; done <"$MEASURED"
else
  say "measure: none recorded (the tests that measure did not get that far)"
fi

# -- the benchmark ----------------------------------------------------------------------------------
if [ "$QUICK" = 1 ]; then BENCH=(--worlds 2,4 --sizes-mib 1,16,256 --budget-mib 1024)
else BENCH=(--worlds 2,4 --sizes-mib 1,4,16,64,256,1024 --budget-mib 4096); fi
BENCH_TIMEOUT=$(limit "$BENCH_CAP_S" 0)
say "GPU all_reduce benchmark (log: $OUT/gpu-bench.log, rows: $OUT/gpu_allreduce.json)"
rm -f "$OUT/gpu_allreduce.json"
timeout -k "$KILL_GRACE_S" "$BENCH_TIMEOUT" "$PY" -m benchmarks.gpu_allreduce "${BENCH[@]}" --timeout-s "$BENCH_TIMEOUT" \
  --out "$OUT/gpu_allreduce.json" 2>&1 | tee "$OUT/gpu-bench.log"
BENCH_RC=${PIPESTATUS[0]}
BENCH_LINE=$("$PY" - "$OUT/gpu_allreduce.json" <<'EOF' 2>/dev/null
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
parts = []
for w in sorted({r["world"] for r in rows}):
    mine = [r for r in rows if r["world"] == w]
    parts.append(f"W{w} busbw " + " ".join(f"{r['bytes'] >> 20}MiB:{r['busbw_GBps']:.1f}" for r in mine) + " GB/s")
    big = max(mine, key=lambda r: r["bytes"])
    if big.get("kernel_vs_copy"):
        parts.append(f"W{w} kernel {big['kernel_bw_GBps']:.0f} GB/s vs d2d copy {big['copy_bw_GBps']:.0f} GB/s ({big['kernel_vs_copy']:.2f}x at {big['bytes'] >> 20} MiB)")
print("; ".join(parts))
EOF
)
say "benchmark exit status $BENCH_RC ($(elapsed))"

STATUS=PASS; RC=0
if [ "$TESTS_RC" != 0 ] || [ "${N_RUN:-0}" = 0 ] || [ "$N_PASSED" != "$N_RUN" ] || [ "${N_SKIPPED:-0}" != 0 ]; then STATUS=FAIL; RC=4
elif [ "$BENCH_RC" != 0 ] || [ -z "$BENCH_LINE" ]; then STATUS=FAIL; RC=5; fi
say "SUMMARY $STATUS: tests $N_RUN run, $N_PASSED passed, $N_SKIPPED skipped; ${BENCH_LINE:-no benchmark figures}; $(elapsed) in all; results in $OUT"
exit "$RC"
