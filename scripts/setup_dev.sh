#!/usr/bin/env bash
# .venv as scripts/setup.sh makes it, plus what the test suite needs: the test, ucx and
# nvrtc-check extras (ucx: the optional UCX transport, so that its tests run; nvrtc-check: CuPy
# and NVRTC, no GPU needed, compile the daemon's kernels), the frameworks the tests train with,
# and the system tools they run. scripts/test.sh runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pip install --quiet -e ".[torch,examples,test,ucx,nvrtc-check]"
# --- frameworks (tests/frameworks/): Open MPI for the mpirun tests (and mpi4py, for the
# paired benchmark's Open MPI column); Lightning, transformers,
# DeepSpeed, torchft and torch's test utilities, with torch held at its pin (constraints.txt) so that
# none of them pulls another torch. DeepSpeed builds nothing at install (DS_BUILD_OPS=0) and
# needs the installed torch (--no-build-isolation); its own dependencies are listed in
# requirements.txt (--no-deps keeps it from resolving torch).
# libopenmpi-dev: mpi4py (the paired benchmark's Open MPI column) builds against its mpicc.
if { ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1; } \
    && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin \
        libopenmpi-dev >/dev/null
fi
.venv/bin/python -m pip install --quiet -c tests/frameworks/constraints.txt -r tests/frameworks/requirements.txt
DS_BUILD_OPS=0 .venv/bin/python -m pip install --quiet --no-build-isolation --no-deps "deepspeed==0.19.8"
# torchft (tests/frameworks/test_torchft.py: ProcessGroupSmddp under its Manager and lighthouse):
# --no-deps keeps it from resolving torch; its dependencies are in requirements.txt.
.venv/bin/python -m pip install --quiet --no-deps "torchft==0.2.0"
.venv/bin/python -m pip install --quiet "mpi4py==4.1.2"
# DeepSpeed's SHM all_reduce (a peer in the paired benchmark) is built on first use, which takes
# minutes; built here once (into torch's extension cache) so that no test waits for it.
DS_ACCELERATOR=cpu .venv/bin/python -c "
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder('ShareMemCommBuilder').load(verbose=False)" >/dev/null 2>&1 \
    || echo "setup_dev.sh: DeepSpeed's SHM op did not build; the paired benchmark says so" >&2
# --- end frameworks
# -- What the tests need, so that none of them skips in CI (tests/ci_skips.py fails a skip
# under CI=true). Python packages the tests import plainly, pinned (they are also in the test
# extra): the deploy tests parse the manifests with PyYAML and check them with jsonschema.
.venv/bin/python -m pip install --quiet "PyYAML==6.0.4" "jsonschema==4.26.0"
# Tools the tests run; as root on Debian (CI), the packages of any that is missing.
missing=()
for need in systemd-analyze:systemd systemd-sysusers:systemd setpriv:util-linux ip:iproute2 \
    tc:iproute2 gcc:gcc g++:g++; do
    command -v "${need%%:*}" >/dev/null || missing+=("${need#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            $(printf '%s\n' "${missing[@]}" | sort -u)
    else
        echo "setup.sh: the tests need the Debian packages ${missing[*]}; without them CI fails" >&2
    fi
fi
# tests/failures/test_security.py runs smddp's client as uid 65534 with this venv's Python.
chmod -R a+rX .venv
# -- end of what the tests need.
echo "smddp and what its tests need are installed in $(pwd)/.venv"
