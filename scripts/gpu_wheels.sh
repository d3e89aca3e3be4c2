#!/usr/bin/env bash
# Downloads into .whl/ the wheels that smddp needs and the lent GPU machine's image lacks, so that
# benchmarks/gpu_check.py can install them there offline (that machine reaches no network).
#
#   bash scripts/gpu_wheels.sh     # here, where PyPI is reachable
#
# .whl/ is git-ignored: it reaches the GPU machine only when the device tool's run names it:
#   carry:   [".whl"]
#   command: bash benchmarks/gpu_check.sh
# (The kernel cache, benchmarks/kernel_cache/, is committed and travels with the tree.)
#
# The image ('cuda': Python 3.12 at /opt/torch/.venv, torch 2.11.0+cu130, cupy-cuda13x 14.2.0,
# nvidia-cuda-nvrtc 13, grpcio, protobuf, numpy, ml-dtypes, prometheus-client, pytest,
# pytest-timeout) has no grpcio-health-checking or grpcio-reflection. grpcio, protobuf and
# prometheus-client are there in versions nobody has read off it yet, while smddp's generated
# code needs grpcio>=1.85.1 and protobuf>=7.35: gpu_check.sh installs a carried wheel only where
# the image's module is missing or older than smddp needs, so these three travel as well.
# The versions are the ones CI tests with (scripts/setup.sh's resolution); one version of each,
# since two of one package stop the whole offline install. All of them together are about 8 MiB
# of the 64 MiB that travels with a device call.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
WHEELS=(
  grpcio==1.85.3
  grpcio-health-checking==1.85.1
  grpcio-reflection==1.85.1
  protobuf==7.36.2
  prometheus-client==0.26.0
  typing-extensions==4.16.0  # grpcio's one requirement
)
rm -rf .whl
mkdir -p .whl
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"
n=$(find .whl -type f -name '*.whl' | wc -l)
if [ "$n" != "${#WHEELS[@]}" ]; then
  echo "gpu_wheels: expected ${#WHEELS[@]} wheels in .whl, found $n" >&2
  exit 1
fi
echo "gpu_wheels: $n wheels, $(du -sh .whl | cut -f1), in $(pwd)/.whl:"
ls -1 .whl
