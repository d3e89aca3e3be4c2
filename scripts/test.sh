#!/usr/bin/env bash
# Sets up .venv with what the tests need (scripts/setup_dev.sh) and runs the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_dev.sh
.venv/bin/python scripts/gen_protos.py --check
.venv/bin/ruff check .
# Every file keeps to ruff's format (the generated protos excepted, pyproject.toml).
.venv/bin/ruff format --check .
bash scripts/typecheck.sh
# The wheel, installed into a clean venv and smoke-tested there (about 2 minutes).
bash scripts/wheel_test.sh
.venv/bin/python -m pytest -q -ra --durations=40 "$@"
# --- frameworks: torch's own distributed test suite with smddp standing in for gloo
# (tests/frameworks/torch_suite.py), a step of its own as it takes several minutes; only in
# the full run, not when arguments pick tests. CI=false: its ~200 skips are the suite's own
# (CUDA tensors, 4 or 8 ranks, NCCL- or MPI-only features) and the reasoned ones in
# torch_suite.py, not something CI failed to install (what tests/ci_skips.py guards against).
# Twice, as torch's CI runs it for gloo: rendezvous through env:// (the suite's default), then
# through file:// (which alone runs the barrier-timeout tests on the default group).
if [ $# -eq 0 ]; then
    CI=false .venv/bin/python -m pytest -q -ra -p no:cacheprovider tests/frameworks/torch_suite.py --timeout 300
    init_dir=$(mktemp -d)
    INIT_METHOD="file://$init_dir/init" CI=false .venv/bin/python -m pytest -q -ra -p no:cacheprovider \
        tests/frameworks/torch_suite.py --timeout 300
    rm -rf "$init_dir"
fi
# --- end frameworks
