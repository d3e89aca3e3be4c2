#!/usr/bin/env bash
# The GPU check of smddp (issues 4, 15, 17): tests/gpu, then the GPU all_reduce benchmark,
# ending in ONE summary line. It fails (non-zero) unless CuPy imports with a working NVRTC,
# a GPU is seen, and the GPU tests ran and passed (they are counted: none skipped, none
# deselected by accident). Meant for a fresh H100/H200 with only this checkout on it.
#
#   bash benchmarks/gpu_check.sh            # about 4-5 minutes: worlds 2,3,4; 1 MiB..1 GiB
#   bash benchmarks/gpu_check.sh --quick    # about 2-3 minutes: worlds 2,4; 1, 16, 256 MiB
#
# Environment:
#   PYTHON  the interpreter to use. Default: the first of .venv/bin/python, python3, python
#           whose torch is a CUDA build that sees a GPU; with none, a new .venv-gpu with
#           torch==2.13.0 when the network allows (nothing else is ever upgraded).
#   OUT     where logs and results go (default: a new temp folder).
# Installed where missing, pinned, into that interpreter (user site unless a virtualenv):
# the CuPy build matching torch's CUDA major (cupy-cuda12x or cupy-cuda13x 14.2.0) with the
# NVRTC of the same major, the daemon's dependencies, pytest and pytest-timeout. smddp itself
# is not installed: a folder of symlinks maps this checkout to the smddp.* packages.
#
# Exit status: 0 all passed; 2 no usable torch/GPU; 3 CuPy or NVRTC unusable; 4 the GPU tests
# failed, skipped or did not run; 5 the benchmark failed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
QUICK=0
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=1 ;;
    *) echo "usage: $0 [--quick]" >&2; exit 64 ;;
  esac
done
OUT=${OUT:-$(mktemp -d -t smddp-gpu-check.XXXXXX)}
mkdir -p "$OUT"
say() { echo "gpu_check: $*" | tee -a "$OUT/check.log"; }
T0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - T0 )) s"; }

# -- an interpreter whose torch sees a GPU --------------------------------------------------------
has_cuda_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for candidate in "$REPO/.venv/bin/python" "$REPO/.venv-gpu/bin/python" "$(command -v python3 || true)" "$(command -v python || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && has_cuda_torch "$candidate"; then PY=$candidate; break; fi
  done
fi
if [ -z "$PY" ] && [ -z "${PYTHON:-}" ] && nvidia-smi -L >/dev/null 2>&1; then
  # A bare GPU machine: a virtualenv that still sees the system's packages, plus torch pinned.
  BASE_PY=$(command -v python3 || true)
  if [ -n "$BASE_PY" ]; then
    say "no torch sees a GPU: installing torch==2.13.0 into $REPO/.venv-gpu"
    "$BASE_PY" -m venv --system-site-packages "$REPO/.venv-gpu" >>"$OUT/check.log" 2>&1 \
      && timeout 600 "$REPO/.venv-gpu/bin/python" -m pip install --quiet --disable-pip-version-check \
        "torch==2.13.0" >>"$OUT/check.log" 2>&1 \
      && has_cuda_torch "$REPO/.venv-gpu/bin/python" && PY="$REPO/.venv-gpu/bin/python"
  fi
fi
if [ -z "$PY" ] || ! has_cuda_torch "$PY"; then
  say "no Python here has a torch that sees a GPU (set PYTHON=...); smddp installs torch only on a machine whose nvidia-smi sees a GPU"
  nvidia-smi -L 2>&1 | tee -a "$OUT/check.log" || true
  say "SUMMARY FAIL: no GPU usable from torch; nothing ran"
  exit 2
fi
TORCH_CUDA=$("$PY" -c 'import torch; print(torch.version.cuda)')
CUDA_MAJOR=${TORCH_CUDA%%.*}

# -- what the daemon and the tests need, installed only where missing ----------------------------
PIP_FLAGS=(--quiet --disable-pip-version-check)
"$PY" -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)' || PIP_FLAGS+=(--user)
install() {  # install PIP-SPEC...
  say "installing $*"
  timeout 240 "$PY" -m pip install "${PIP_FLAGS[@]}" "$@" >>"$OUT/check.log" 2>&1 || say "could not install $* (offline?)"
}
need() {  # need MODULE PIP-SPEC...
  local module=$1; shift
  "$PY" -c "import $module" >/dev/null 2>&1 || install "$@"
}
case "$CUDA_MAJOR" in
  12) CUPY_PKG=cupy-cuda12x; NVRTC_PKG="nvidia-cuda-nvrtc-cu12==12.*" ;;
  13) CUPY_PKG=cupy-cuda13x; NVRTC_PKG="nvidia-cuda-nvrtc==13.*" ;;
  *) say "torch's CUDA is $TORCH_CUDA: smddp's daemon supports CUDA 12 and 13 builds"; exit 2 ;;
esac
# A CuPy of the other CUDA major would load an NVRTC the daemon cannot find next to torch's
# (and two CuPy builds in one environment overwrite each other's files): replace it.
installed() { "$PY" -c "import importlib.metadata as m; m.version('$1')" >/dev/null 2>&1; }
for other in cupy-cuda12x cupy-cuda13x; do
  if [ "$other" != "$CUPY_PKG" ] && installed "$other"; then
    say "removing $other: torch here is CUDA $TORCH_CUDA"
    "$PY" -m pip uninstall --quiet -y "$other" >>"$OUT/check.log" 2>&1
  fi
done
installed "$CUPY_PKG" || install "$CUPY_PKG==14.2.0" "$NVRTC_PKG"
need grpc "grpcio==1.85.1"
need grpc_health "grpcio-health-checking==1.85.1"
need grpc_reflection "grpcio-reflection==1.85.1"
need google.protobuf "protobuf>=7.35,<8"
need ml_dtypes "ml-dtypes==0.5.*"
need prometheus_client "prometheus-client==0.21.*"
need pytest "pytest==8.*"
need pytest_timeout "pytest-timeout==2.*"

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
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export CUPY_CACHE_DIR="$OUT/cupy-cache"
# Run from $OUT: in the checkout, its smddp/ folder would shadow the mapped package.
cd "$OUT"

# -- the environment, and a warm kernel cache (the daemon's compile path, timed) ---------------
say "environment ($(elapsed)):"
nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_mode --format=csv,noheader 2>&1 | tee -a "$OUT/check.log" || true
if ! "$PY" - <<'EOF' 2>&1 | tee -a "$OUT/check.log"; then
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
import smddp
from smddp.server import gpu_runtime
print("smddp from", smddp.__file__)
rt = gpu_runtime.CupyRuntime()
start = time.monotonic()
first = rt.warm(0, gpu_runtime.COMMON_KERNELS[:1])
one = time.monotonic() - start
rt.warm(0, gpu_runtime.COMMON_KERNELS)
print(f"first kernel compile {one:.2f} s; {len(gpu_runtime.COMMON_KERNELS)} common kernels warm in {time.monotonic() - start:.1f} s (cache {__import__('os').environ['CUPY_CACHE_DIR']})")
EOF
  say "SUMMARY FAIL: CuPy/NVRTC cannot compile the daemon's kernels here (see $OUT/check.log); the GPU tests did not run"
  exit 3
fi

# -- the GPU tests (counted) ------------------------------------------------------------------------
TESTS_TIMEOUT=300
[ "$QUICK" = 1 ] && TESTS_TIMEOUT=180
say "tests/gpu (log: $OUT/gpu-tests.log) at $(elapsed)"
SMDDP_REQUIRE_GPU=1 SMDDP_GPU_QUICK=$QUICK timeout "$TESTS_TIMEOUT" "$PY" -m pytest -q -rs -p no:cacheprovider \
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

# -- the benchmark ----------------------------------------------------------------------------------
if [ "$QUICK" = 1 ]; then BENCH=(--worlds 2,4 --sizes-mib 1,16,256 --budget-mib 1024); BENCH_TIMEOUT=120
else BENCH=(--worlds 2,4 --sizes-mib 1,4,16,64,256,1024 --budget-mib 4096); BENCH_TIMEOUT=200; fi
say "GPU all_reduce benchmark (log: $OUT/gpu-bench.log, rows: $OUT/gpu_allreduce.json)"
rm -f "$OUT/gpu_allreduce.json"
timeout "$BENCH_TIMEOUT" "$PY" -m benchmarks.gpu_allreduce "${BENCH[@]}" --timeout-s "$BENCH_TIMEOUT" \
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
