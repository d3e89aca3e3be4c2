#!/usr/bin/env bash
# The GPU check of smddp (issue 27): ONE command, bounded to 540 s, whose last line is the
# summary with every stage's verdict. The work is benchmarks/gpu_check.py's (read its
# docstring, or docs/gpu-check.md); this script only finds the interpreter.
#
# Before a GPU session, where PyPI is reachable:   bash scripts/gpu_wheels.sh   (fills .whl/)
# The device tool's run, on the lent H200:
#   carry:   [".whl"]
#   command: bash benchmarks/gpu_check.sh                  (timeout_s 600)
#   then, if time is left:  bash benchmarks/gpu_check.sh --quick [--stages smoke,speed]
# Here, without a GPU (the dry run on the fake GPU):  bash benchmarks/gpu_check.sh --fake-gpu
#   bash benchmarks/gpu_check.sh --plan [--quick]      # the stages' caps
#
# Environment: PYTHON, the interpreter (default: the first of /opt/torch/.venv/bin/python,
# .venv/bin/python, python3 whose torch sees a GPU; .venv/bin/python for --fake-gpu); OUT,
# the results folder (at most 8 plain files; default a new temporary folder). Exit status:
# 0 passed, 1 a stage failed, 2 no usable torch/GPU or dependency, 64 a bad argument.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
FAKE=0
for arg in "$@"; do
  case "$arg" in
    --fake-gpu) FAKE=1 ;;
    --quick|--plan|--stages=*|--out=*) ;;
    --stages|--out) ;;  # their value follows
    -*) echo "usage: $0 [--quick] [--plan] [--fake-gpu] [--stages LIST] [--out DIR]" >&2; exit 64 ;;
  esac
done
has_cuda_torch() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
PY=${PYTHON:-}
if [ -z "$PY" ] && [ "$FAKE" = 1 ]; then
  PY="$REPO/.venv/bin/python"; [ -x "$PY" ] || PY=$(command -v python3)
fi
if [ -z "$PY" ]; then
  for candidate in /opt/torch/.venv/bin/python "$REPO/.venv/bin/python" "$(command -v python3 || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && has_cuda_torch "$candidate"; then PY=$candidate; break; fi
  done
fi
case " $* " in *" --plan "*) exec "${PY:-python3}" "$REPO/benchmarks/gpu_check.py" "$@" ;; esac
if [ "$FAKE" = 0 ] && { [ -z "$PY" ] || ! has_cuda_torch "$PY"; }; then
  OUT=${OUT:-$(mktemp -d -t smddp-gpu-out.XXXXXX)}
  mkdir -p "$OUT"
  say() { echo "gpu_check: $*" | tee -a "$OUT/check.log"; }
  say "no Python here has a torch that sees a GPU (set PYTHON=...); this script installs no torch (it never uses the network)"
  nvidia-smi -L 2>&1 | tee -a "$OUT/check.log" || true
  say "SUMMARY FAIL: no GPU usable from torch; nothing ran"
  exit 2
fi
exec "$PY" "$REPO/benchmarks/gpu_check.py" "$@"
