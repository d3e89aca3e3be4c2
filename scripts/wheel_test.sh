#!/usr/bin/env bash
# Builds smddp's sdist and wheel (python -m build), installs the wheel into a clean venv outside
# the checkout and smoke-tests it there, as a user who installs the wheel would run it:
#   - smddpd --help and smddpctl --help (the entry points),
#   - smddpd from the wheel, a 2-rank numpy job (examples/numpy_allreduce.py) on it, and
#     smddpctl status/metrics against it,
#   - a 2-rank torch job (torch==2.13.0, then the wheel's torch extra) on the embedded daemon.
# Uses .venv (scripts/setup.sh) for the build; about 1-2 minutes, most of it installing torch.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${SMDDP_PYTHON:-$(command -v /usr/bin/python3 || command -v python3)}
WORK=$(mktemp -d /tmp/smddp-wheel-XXXXXX)
DAEMON_PID=""
cleanup() {
    if [ -n "$DAEMON_PID" ] && kill -0 "$DAEMON_PID" 2>/dev/null; then kill "$DAEMON_PID"; fi
    rm -rf "$WORK"
}
trap cleanup EXIT
step() { echo "wheel_test [${SECONDS} s]: $*"; }

step "building (python -m build)"
.venv/bin/python -m build --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
WHEEL=$(ls "$WORK"/dist/smddp-*.whl)  # cp3x-linux: it carries smddp.core._fastregion
step "built $(basename "$WHEEL") and $(basename "$(ls "$WORK"/dist/smddp-*.tar.gz)")"

# A clean venv, used from a folder outside the checkout so that nothing of it is importable.
# No pip inside it: .venv's pip installs into it (--python), which saves bootstrapping one;
# --no-compile skips byte-compiling torch's thousands of files, most of this script's CPU time.
"$PY" -m venv --without-pip "$WORK/venv"
V="$WORK/venv/bin"
PIP=("$ROOT/.venv/bin/python" -m pip --python "$V/python" install -qq --no-compile)
"${PIP[@]}" "$WHEEL"
cd "$WORK"
"$V/python" - "$ROOT" <<'PY'
import sys, smddp, smddp.server, smddp.client, smddp.v1.smddp_pb2
import smddp.core._fastregion  # the region path's C part, built into the wheel
root = sys.argv[1]
assert not smddp.__file__.startswith(root), f"smddp imported from the checkout: {smddp.__file__}"
import importlib.util, pathlib
backend = pathlib.Path(importlib.util.find_spec("smddp.backend").origin).parent
hook = sorted(p.name for p in (backend / "csrc").iterdir())
assert hook == ["free_channel.cpp", "free_channel.h", "segment_hook.cpp"], f"the wheel's allocator hook sources: {hook}"
try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("the daemon's install pulled in torch")
print("wheel_test: smddp", smddp.__version__, "from", smddp.__file__.rsplit("/smddp/", 1)[0], "(no torch)")
PY
# From the checkout's root too, where a user runs the README's commands: the folders there
# (server/, client/, core/, compat/...) must not shadow the installed package (a root folder
# called smddp once did: "No module named 'smddp.server'").
(cd "$ROOT" && "$V/python" -c '
import importlib.util, sys, smddp, smddp.server.main, smddp.client, smddp.core.region
root = sys.argv[1]
backend = importlib.util.find_spec("smddp.backend").origin  # it imports torch, not here
for name, path in [(m.__name__, m.__file__) for m in (smddp, smddp.server.main, smddp.core.region)] + [("smddp.backend", backend)]:
    assert not path.startswith(root + "/"), f"{name} imported from the checkout: {path}"
print("wheel_test: from the checkout root, smddp is the installed one:", smddp.__file__)
' "$ROOT")
"$V/smddpd" --help | grep -q -- "--chunk-bytes"
"$V/smddpctl" --help | grep -q "metrics"
step "smddpd --help and smddpctl --help ok"

step "numpy job on a smddpd started from the wheel"
SOCK="$WORK/run/smddpd.sock"
"$V/smddpd" --socket "$SOCK" --http-bind off --peer-bind off 2>"$WORK/smddpd.log" &
DAEMON_PID=$!
for _ in $(seq 1 300); do
    if "$V/smddpctl" --socket "$SOCK" health >/dev/null 2>&1; then break; fi
    kill -0 "$DAEMON_PID" 2>/dev/null || { cat "$WORK/smddpd.log"; exit 1; }
    sleep 0.1
done
"$V/smddpctl" --socket "$SOCK" health
TOKEN=$("$V/python" -c 'import secrets; print(secrets.token_hex(16))')
pids=()
for r in 0 1; do
    SMDDP_SOCKET="$SOCK" timeout 120 "$V/python" "$ROOT/examples/numpy_allreduce.py" \
        --rank "$r" --world-size 2 --job-token "$TOKEN" >"$WORK/rank$r.log" 2>&1 &
    pids+=($!)
done
for r in 0 1; do
    wait "${pids[$r]}" || { cat "$WORK/rank$r.log"; exit 1; }
    grep -q "rank $r: all_gather and barrier ok" "$WORK/rank$r.log" || { cat "$WORK/rank$r.log"; exit 1; }
done
"$V/smddpctl" metrics --socket "$SOCK" | tee "$WORK/metrics.txt"
grep -Eq "^barrier +none +1 " "$WORK/metrics.txt"
kill -TERM "$DAEMON_PID"
wait "$DAEMON_PID" || { echo "smddpd exited with $?"; cat "$WORK/smddpd.log"; exit 1; }
DAEMON_PID=""
step "numpy job ok; smddpd stopped cleanly"

step "torch job on the embedded daemon (torch==2.13.0 and the wheel's torch extra)"
"${PIP[@]}" "torch==2.13.0"  # first and pinned, as scripts/setup.sh does
"${PIP[@]}" "$WHEEL[torch]"
cat >"$WORK/tiny_job.py" <<'PY'
import torch
import torch.distributed as dist
import smddp  # noqa: F401  (registers backend "smddp")

dist.init_process_group(backend="smddp")
t = torch.full((1000,), float(dist.get_rank() + 1))
dist.all_reduce(t)
assert torch.equal(t, torch.full((1000,), 3.0)), t[:4]
dist.barrier()
print(f"rank {dist.get_rank()}: all_reduce ok")
dist.destroy_process_group()
PY
# SMDDP_SOCKET names a socket nobody serves, so the job starts its own (embedded) daemon.
SMDDP_SOCKET="$WORK/none.sock" timeout 180 "$V/torchrun" --standalone --nproc-per-node 2 \
    "$WORK/tiny_job.py" >"$WORK/torch.log" 2>&1 || { cat "$WORK/torch.log"; exit 1; }
cat "$WORK/torch.log"
grep -q "started an embedded daemon for this job" "$WORK/torch.log"
# Count matches, not lines: the two ranks' prints can land on one line.
[ "$(grep -o ': all_reduce ok' "$WORK/torch.log" | wc -l)" = 2 ]
step "all passed"
