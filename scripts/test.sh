#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/gen_protos.py --check
.venv/bin/ruff check .
# The wheel, installed into a clean venv and smoke-tested there (about 2 minutes).
bash scripts/wheel_test.sh
exec .venv/bin/python -m pytest -q -ra "$@"
