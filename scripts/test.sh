#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/gen_protos.py --check
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -ra "$@"
# --- frameworks: torch's own distributed test suite with smddp standing in for gloo
# (tests/frameworks/torch_suite.py), a step of its own as it takes several minutes; only in
# the full run, not when arguments pick tests.
if [ $# -eq 0 ]; then
    .venv/bin/python -m pytest -q -ra -p no:cacheprovider tests/frameworks/torch_suite.py --timeout 300
fi
# --- end frameworks
