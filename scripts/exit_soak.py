"""Exit soak: a script that never calls ``destroy_process_group`` must exit 0 every time.

Launches a small training script N times under ``torchrun --standalone --nproc-per-node 3``
(backend "smddp", CPU tensors): a few collectives, one DDP step, a large async all_reduce of a
non-contiguous tensor whose Future is taken, an async all_reduce left in flight on the
progress thread, a success line per rank, and no ``destroy_process_group``. Counts the runs
that exited non-zero or where a rank did not print its success line, and for each such run
prints torchrun's exit status and failure summary (each worker's exit code or signal), the
ranks that reached their success line, and the workers' stderr.

Before ``backend/exit_gate.py``, the completer thread could still be inside torch (copying a
result back, completing a Future: calls that release the GIL) when the interpreter began to
finalize, and the process aborted (SIGABRT, "terminate called without an active exception").

Usage::

    python scripts/exit_soak.py -n 100                    # embedded daemon (none answers)
    python scripts/exit_soak.py -n 100 --system-daemon    # one smddpd for every run

Exit status: 0 when every run exited 0 with every rank's success line, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

WORLD = 3
RUN_TIMEOUT_S = 240.0
SUCCESS = "exit-soak ok rank"

# The worker: torchrun runs it WORLD times. It leaves the group up on purpose, and an async
# all_reduce un-waited, so interpreter shutdown meets every piece of the backend still alive.
WORKER = """\
import os
import sys

import torch
import torch.distributed as dist

import smddp  # noqa: F401  (registers the "smddp" backend)

dist.init_process_group(backend="smddp")
rank = dist.get_rank()
world = dist.get_world_size()
t = torch.full((1024,), float(rank + 1))
dist.all_reduce(t)
assert t[0].item() == world * (world + 1) / 2, t[0].item()
b = torch.arange(8, dtype=torch.int64) if rank == 0 else torch.zeros(8, dtype=torch.int64)
dist.broadcast(b, src=0)
assert b.tolist() == list(range(8)), b.tolist()
out = [torch.empty(4) for _ in range(world)]
dist.all_gather(out, torch.full((4,), float(rank)))
assert [o[0].item() for o in out] == [float(r) for r in range(world)]
dist.barrier()

torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss = model(torch.randn(16, 64) * (rank + 1)).sum()
loss.backward()
opt.step()

# A large output that is not contiguous, whose Future is taken: the completer thread waits
# for the op, then copies the result back from a contiguous stand-in (a torch call that
# releases the GIL) and completes the Future. The small all_reduce after it completes only
# once it has, so the script ends while the completer copies back.
strided = torch.ones(1 << 23, 2)[:, 0]
copied_back = dist.all_reduce(strided, async_op=True).get_future()
dist.all_reduce(torch.ones(4))
# Larger than the control region's buffers: the progress thread runs it, and the script
# ends with it still in flight there; never waited on.
pending = dist.all_reduce(torch.ones(1 << 21), async_op=True)
# One write: print() may write the text and its newline apart (PYTHONUNBUFFERED), and the
# ranks share torchrun's stdout.
sys.stdout.write(f"{SUCCESS} {rank}\\n")
sys.stdout.flush()
# A second record of the same moment, beside the stdout line, to tell a lost line from a rank
# that never got here.
with open(os.path.join(os.environ["SOAK_MARKS"], f"rank{rank}"), "w") as mark:
    mark.write("printed")
""".replace("{SUCCESS}", SUCCESS)


@dataclass
class RunResult:
    """One torchrun run: its status, output and the workers' failures as torchrun saw them."""

    index: int
    returncode: int
    seconds: float
    stdout: str
    stderr: str
    succeeded_ranks: set[int] = field(default_factory=set)
    worker_failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.succeeded_ranks == set(range(WORLD))


def _worker_failures(log_dir: Path) -> list[str]:
    """Each failed worker's rank, exit code or signal, from torchrun's per-worker error
    files and its logs folder (torchrun writes ``error.json`` only for workers that raised;
    the exit code of the others is in its own stderr, which the caller keeps)."""
    found = []
    for error_file in sorted(log_dir.rglob("error.json")):
        try:
            body = json.loads(error_file.read_text())
        except (OSError, ValueError):
            continue
        message = body.get("message", body)
        found.append(f"{error_file.relative_to(log_dir)}: {json.dumps(message)[:2000]}")
    return found


def _worker_stderr(log_dir: Path) -> str:
    """Every worker's stderr that torchrun redirected to ``log_dir`` (``--redirects 2``)."""
    parts = []
    for path in sorted(log_dir.rglob("stderr.log")):
        text = path.read_text(errors="replace")
        parts.append(f"--- {path.relative_to(log_dir)} ({len(text)} chars)\n{text}")
    return "\n".join(parts)


def run_once(index: int, script: Path, env: dict[str, str], work: Path) -> RunResult:
    """One torchrun run of ``script``; its workers' stderr is kept under ``work``."""
    log_dir = work / f"run{index}"
    marks_dir = work / f"marks{index}"
    marks_dir.mkdir()
    env = dict(env, SOAK_MARKS=str(marks_dir))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(WORLD),
        "--log-dir",
        str(log_dir),
        "--redirects",
        "2",  # each worker's stderr to a file of its own, its stdout to ours
        str(script),
    ]
    started = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, env=env, cwd=work, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        returncode = -999
        stdout = exc.stdout if isinstance(exc.stdout, str) else ""
        stderr = (exc.stderr if isinstance(exc.stderr, str) else "") + (
            f"\n[exit_soak] run {index} did not end within {RUN_TIMEOUT_S:.0f} s"
        )
    seconds = time.monotonic() - started
    result = RunResult(index, returncode, seconds, stdout, stderr)
    result.succeeded_ranks = {int(m) for m in re.findall(rf"{SUCCESS} (\d+)", stdout)}
    if not result.ok:
        result.worker_failures = _worker_failures(log_dir)
        marks = sorted(p.name for p in marks_dir.iterdir())
        result.stderr += f"\n[exit_soak] ranks that reached their success line (marks): {marks}"
        result.stderr += "\n--- torchrun stdout\n" + stdout
        result.stderr += "\n" + _worker_stderr(log_dir)
    return result


def write_worker(work: Path) -> Path:
    """Writes the worker script into ``work`` and returns its path."""
    compile(WORKER, "worker.py", "exec")  # a typo here would fail every run alike
    script = work / "worker.py"
    script.write_text(WORKER)
    return script


def soak_env(socket_path: str) -> dict[str, str]:
    """The runs' environment: this one without a launcher's variables, the daemon at
    ``socket_path`` (where none answers, each run's local rank 0 starts an embedded one)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", SMDDP_SOCKET=socket_path)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def report(result: RunResult) -> str:
    """What a failed run left: torchrun's status and summary, the ranks that reached their
    success line, the workers' stderr."""
    lines = [
        f"run {result.index}: FAILED: torchrun exit status {result.returncode}, ranks with "
        f"their success line {sorted(result.succeeded_ranks)}, {result.seconds:.1f} s",
        *(f"  worker failure: {line}" for line in result.worker_failures),
        "  torchrun stderr and the workers' stderr:",
        *("    " + s for s in result.stderr.splitlines()[-400:]),
    ]
    return "\n".join(lines)


def _start_system_daemon(work: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    from smddp.client.embedded import daemon_answers

    path = str(work / "system" / "smddpd.sock")
    os.makedirs(os.path.dirname(path), mode=0o700)
    with open(work / "system" / "smddpd.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "smddp.server", "--socket", path, "--http-bind", "off"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while not daemon_answers(path, timeout_s=1.0):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the system smddpd at {path} did not serve within 60 s")
        time.sleep(0.1)
    return proc, path


def main(argv: list[str] | None = None) -> int:
    """Runs the soak; prints a line per run (and a failed run's details) and a summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--runs", type=int, default=100, help="torchrun runs (100)")
    parser.add_argument(
        "--system-daemon",
        action="store_true",
        help="start one smddpd and point every run at it (default: each run's local rank 0 "
        "starts an embedded daemon, none answering)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the work folder (the workers' logs)"
    )
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="smddp-exit-soak-"))
    script = write_worker(work)
    env = soak_env(str(work / "absent.sock"))
    daemon = None
    if args.system_daemon:
        daemon, env["SMDDP_SOCKET"] = _start_system_daemon(work, env)
    failed: list[RunResult] = []
    started = time.monotonic()
    try:
        for i in range(args.runs):
            result = run_once(i, script, env, work)
            if result.ok:
                print(f"run {i}: ok ({result.seconds:.1f} s); {len(failed)} failed so far")
            else:
                failed.append(result)
                print(report(result))
            sys.stdout.flush()
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(30)
    elapsed = time.monotonic() - started
    mode = "system daemon" if args.system_daemon else "embedded daemon"
    print(
        f"exit soak ({mode}): {args.runs} runs, {len(failed)} non-zero or incomplete "
        f"({', '.join(str(r.index) for r in failed) or 'none'}), {elapsed:.0f} s in all",
        flush=True,
    )
    if args.keep or failed:
        print(f"workers' logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
