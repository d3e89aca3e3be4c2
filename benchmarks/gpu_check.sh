#!/usr/bin/env bash
# The GPU check of smddp (issue 4): tests/gpu, then the GPU all_reduce benchmark
# (1 MiB to 1 GiB, 2 and 4 ranks on one GPU, busbw, the reduction kernel's memory bandwidth
# against a device-to-device copy). About 2-4 minutes on one H100/H200.
#
#   bash benchmarks/gpu_check.sh            # results and logs in $OUT (default: a new temp folder)
#
# It uses the torch and CuPy the GPU machine provides; it never installs or upgrades torch.
#   PYTHON  the interpreter to use. Default: the first of .venv/bin/python, python3, python
#           whose torch is a CUDA build that sees a GPU.
#   OUT     where logs and results go.
# Missing pieces are installed with pip into that interpreter (user site when it is not a
# virtualenv), only if the network allows: cupy-cuda12x (the daemon's kernels), the daemon's
# own dependencies (grpcio, protobuf, numpy, ml-dtypes, prometheus-client), pytest and
# pytest-timeout. smddp itself is not installed: a folder of symlinks maps this checkout to
# the smddp.* packages on PYTHONPATH. Exit status: that of the GPU tests (0: all passed).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT=${OUT:-$(mktemp -d -t smddp-gpu-check.XXXXXX)}
mkdir -p "$OUT"
say() { echo "gpu_check: $*" | tee -a "$OUT/check.log"; }

# -- an interpreter whose torch sees a GPU --------------------------------------------------------
has_cuda_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for candidate in "$REPO/.venv/bin/python" "$(command -v python3 || true)" "$(command -v python || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && has_cuda_torch "$candidate"; then PY=$candidate; break; fi
  done
fi
if [ -z "$PY" ] || ! has_cuda_torch "$PY"; then
  say "no Python here has a torch that sees a GPU (set PYTHON=...); smddp does not install torch"
  nvidia-smi -L 2>&1 | tee -a "$OUT/check.log" || true
  exit 2
fi
say "python: $PY ($("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))'))"
nvidia-smi -L 2>&1 | tee -a "$OUT/check.log" || true

# -- what the daemon and the tests need, installed only where missing ----------------------------
PIP_FLAGS=(--quiet --disable-pip-version-check)
"$PY" -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)' || PIP_FLAGS+=(--user)
need() {  # need MODULE PIP-SPEC...
  local module=$1; shift
  if "$PY" -c "import $module" >/dev/null 2>&1; then return 0; fi
  say "installing $* (no $module)"
  timeout 180 "$PY" -m pip install "${PIP_FLAGS[@]}" "$@" >>"$OUT/check.log" 2>&1 || say "could not install $* (offline?)"
}
need cupy "cupy-cuda12x>=13"
need grpc "grpcio>=1.60"
need grpc_health "grpcio-health-checking>=1.60"
need grpc_reflection "grpcio-reflection>=1.60"
need google.protobuf "protobuf>=5"
need ml_dtypes "ml-dtypes>=0.5"
need prometheus_client "prometheus-client>=0.20"
need pytest "pytest>=8"
need pytest_timeout "pytest-timeout>=2.3"
"$PY" -c 'import cupy; print("cupy", cupy.__version__, "devices", cupy.cuda.runtime.getDeviceCount())' 2>&1 | tee -a "$OUT/check.log" \
  || say "CuPy does not work here: the GPU tests will be skipped"

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
"$PY" -c 'import smddp.server.gpu, smddp.backend; print("smddp from", smddp.__file__)' 2>&1 | tee -a "$OUT/check.log"

# -- the GPU tests ----------------------------------------------------------------------------------
say "tests/gpu (log: $OUT/gpu-tests.log)"
timeout 420 "$PY" -m pytest -q -rs -p no:cacheprovider --rootdir "$REPO" -c "$REPO/pyproject.toml" \
  -m gpu "$REPO/tests/gpu" 2>&1 | tee "$OUT/gpu-tests.log"
TESTS_RC=${PIPESTATUS[0]}
say "tests/gpu exit status $TESTS_RC"

# -- the benchmark ----------------------------------------------------------------------------------
say "GPU all_reduce benchmark (log: $OUT/gpu-bench.log, rows: $OUT/gpu_allreduce.json)"
timeout 300 "$PY" -m benchmarks.gpu_allreduce --worlds 2,4 --sizes-mib 1,4,16,64,256,1024 \
  --out "$OUT/gpu_allreduce.json" 2>&1 | tee "$OUT/gpu-bench.log"
say "benchmark exit status ${PIPESTATUS[0]}"
say "results in $OUT"
exit "$TESTS_RC"
