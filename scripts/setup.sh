#!/usr/bin/env bash
# Creates .venv with smddp installed (editable) and what the quick start's example needs: the
# torch and examples extras. scripts/setup_dev.sh adds what the tests need.
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
.venv/bin/python -m pip install --quiet -e ".[torch,examples]"
echo "smddp is installed in $(pwd)/.venv"
