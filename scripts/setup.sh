#!/usr/bin/env bash
# Creates .venv with smddp installed (editable) and its torch, test and ucx extras (ucx: the optional UCX transport, so that its tests run).
# torch is pinned to 2.13.0 and installed first: an unpinned torch would pull a multi-GB
# CUDA build on a CPU-only machine.
set -euo pipefail
cd "$(dirname "$0")/.."
# /usr/bin/python3 when present, so that the venv also works for non-root users.
PY=${SMDDP_PYTHON:-$(command -v /usr/bin/python3 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
# nvrtc-check: CuPy and NVRTC (no GPU needed) compile the daemon's kernels in the tests.
.venv/bin/python -m pip install --quiet -e ".[torch,test,ucx,nvrtc-check]"
echo "smddp is installed in $(pwd)/.venv"
