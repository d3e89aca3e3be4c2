"""Fuzzing the control region: one job's ranks write anything into it beside a steady job.

A real smddpd (its own process, private socket, HTTP on loopback, as a system daemon runs)
serves two kinds of job at once:

- the **victim**: two ranks that all_reduce without pause (sizes in the region and past
  it), checking every result;
- a stream of **attacker** jobs, two ranks each, one after another: each maps its control
  region with a few real ops, then writes random extreme values over the whole region (the
  header, its own slot, the other rank's slot, the data buffers), runs ops between writes
  and leaves in a random way: ``close()``, ``os._exit`` without it, or SIGKILL.

Meanwhile the daemon's health, ``Status`` and HTTP ``/metrics`` are asked every moment. At
the end, with the attackers gone and the victim still running, the daemon's descriptors,
memfds and shared memory must be back to what they were once the victim ran alone, and its
threads no more than then (gRPC's pools keep threads they made, up to their bound: those
are told apart by the name the daemon gives them and not counted; a warm-up of attacker jobs
runs before that baseline too); the node's Shmem may differ by the
victim's own pages (``SHMEM_SLACK_KIB``).

It fails (exit 1) when the victim saw one wrong result or any error, the daemon died, a
health check, Status or scrape failed, an attacker rank raised anything but a named smddp
error or hung past its timeout, or the daemon did not give back what it held. It prints
one JSON summary. ``tests/failures/test_region_fuzz.py`` runs it for a short while in CI;
run it longer by hand::

    .venv/bin/python tests/failures/region_fuzz.py --seconds 300
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

# Each attacker rank's own bound on one op, and how long past it the parent lets it run
# before it counts the rank as hung and kills it.
ATTACKER_TIMEOUT_S = 5.0
HUNG_AFTER_S = 45.0
# How long the daemon may take to give back what the attackers made it hold.
SETTLE_S = 60.0
WARM_UP_JOBS = 4
# What the node's Shmem may grow by while the victim runs on (its own pages; see _given_back).
SHMEM_SLACK_KIB = 16 << 10
# Extreme words the attackers write (as int64).
EXTREMES = (0, 1, -1, 2, 7, 255, 2**31, 2**32 + 1, 2**40, 2**62, -(2**63), 2**63 - 1)


def _node_shmem_kib() -> int:
    """The node's shared memory in use (/proc/meminfo's Shmem: every memfd and /dev/shm page)."""
    found = re.search(r"^Shmem:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    return int(found[1]) if found else 0


# gRPC's servers keep the threads their pools made, up to each pool's bound, whatever the jobs:
# the daemon names them so (server/supervise.py named_pool), and they are not counted here.
POOLS = ("smddp-grpc", "smddp-peer-rpc", "smddp-probe")


def _threads(pid: int) -> int:
    """The daemon's threads but those of its gRPC pools."""
    count = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue  # ended while we looked
        count += not name.startswith(POOLS)
    return count


def _daemon_numbers(pid: int) -> dict[str, int]:
    """The daemon's open descriptors, the memfds among them and their bytes, its threads,
    and the node's shared memory."""
    fds = memfds = memfd_bytes = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            target = os.readlink(path)
            size = os.stat(path).st_size if target.startswith("/memfd:") else 0
        except OSError:
            continue
        fds += 1
        if target.startswith("/memfd:"):
            memfds += 1
            memfd_bytes += size
    return {
        "fds": fds,
        "memfds": memfds,
        "memfd_bytes": memfd_bytes,
        "threads": _threads(pid),
        "node_shmem_kib": _node_shmem_kib(),
    }


def _given_back(start: dict[str, int], end: dict[str, int]) -> bool:
    """Whether the daemon holds no more than at the start. The node's Shmem may differ by
    SHMEM_SLACK_KIB: the victim, still running, touches pages of its own arenas and region
    as it goes (its pages are the node's, not what the daemon keeps)."""
    exact = all(end[k] <= start[k] for k in ("fds", "memfds", "memfd_bytes", "threads"))
    return exact and end["node_shmem_kib"] <= start["node_shmem_kib"] + SHMEM_SLACK_KIB


# -- the ranks (this file run with --role) -------------------------------------------------


def _victim(args: argparse.Namespace) -> int:
    from smddp.client import connect
    from smddp.v1 import smddp_pb2 as pb

    comm = connect(args.job, bytes.fromhex(args.token), args.rank, 2, socket_path=args.socket)
    stop = Path(args.stop)
    done = wrong = 0
    sizes = (4, 1000, 70_000, 600_000)  # the region's buffers and past them (direct)
    try:
        while True:
            if done % 20 == 0:
                # Both ranks stop at the same op: they agree on it (MAX of "the file is there").
                flag = np.array([stop.exists()], dtype=np.int32)
                comm.all_reduce(flag, pb.MAX).wait()
                if flag[0]:
                    break
            n = sizes[done % len(sizes)]
            x = np.arange(n, dtype=np.float32) * (args.rank + 1) + done
            comm.all_reduce(x, pb.SUM).wait()
            expected = np.arange(n, dtype=np.float32) * 3 + 2 * done
            wrong += int(not np.array_equal(x, expected))
            done += 1
            if done % 50 == 0:
                Path(args.progress).write_text(str(done))
    except Exception:
        print(json.dumps({"ops": done, "wrong": wrong, "error": traceback.format_exc()}))
        return 3
    comm.close()
    print(json.dumps({"ops": done, "wrong": wrong, "error": ""}))
    return 0 if wrong == 0 else 2


def _attacker(args: argparse.Namespace) -> int:
    from smddp.client import connect
    from smddp.client.errors import SmddpError
    from smddp.v1 import smddp_pb2 as pb

    rng = random.Random(args.seed)
    named: list[str] = []
    unnamed: list[str] = []

    def op() -> None:
        x = np.ones(rng.choice((1, 4, 300)), dtype=np.float32)
        try:
            comm.all_reduce(x, pb.SUM).wait()
        except SmddpError as exc:
            named.append(type(exc).__name__)
        except Exception:
            unnamed.append(traceback.format_exc(limit=6))

    comm = connect(
        args.job,
        bytes.fromhex(args.token),
        args.rank,
        2,
        socket_path=args.socket,
        timeout_s=ATTACKER_TIMEOUT_S,
    )
    for _ in range(3):
        op()
    region = comm._region._shm  # mapped by the ops above, unless they failed
    if region is not None and rng.random() < 0.9:
        words = region.view.buf.view(np.int64)
        for _ in range(rng.randint(1, 12)):
            for _ in range(rng.randint(1, 6)):
                # Half the writes land in the header and the first slot words, where every
                # field the daemon reads lives; the rest anywhere.
                if rng.random() < 0.5:
                    i = rng.randrange(min(words.size, 2048))
                else:
                    i = rng.randrange(words.size)
                if rng.random() < 0.8:
                    words[i] = rng.choice(EXTREMES)
                else:
                    words[i] = rng.randrange(-(2**63), 2**63)
            op()
    summary = {"named": named, "unnamed": unnamed}
    print(json.dumps(summary), flush=True)
    leave = rng.random()
    if leave < 0.4:
        comm.close()
    elif leave < 0.7:
        os._exit(0)
    else:
        os.kill(os.getpid(), signal.SIGKILL)
    return 0


# -- the parent -----------------------------------------------------------------------------


class Daemon:
    """The smddpd under test: started, asked, stopped."""

    def __init__(self, folder: Path) -> None:
        self.socket = str(folder / "smddpd.sock")
        self.log_path = folder / "smddpd.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "smddp.server",
                    "--socket",
                    self.socket,
                    "--http-bind",
                    "127.0.0.1:0",
                    "--peer-bind",
                    "127.0.0.1:0",
                    "--data-port",
                    "0",
                    "--ucx-port",
                    "0",
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        deadline = time.monotonic() + 60
        line = None
        while line is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"smddpd did not start:\n{self.log()}")
            line = next((x for x in self.log().splitlines() if "smddpd serving" in x), None)
            time.sleep(0.05)
        found = re.search(r"listening: .*\bHTTP [^,\s]*:(\d+)", line)
        if not found:
            raise SystemExit(f"smddpd names no HTTP listener: {line}")
        self.http = f"http://127.0.0.1:{found[1]}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel("unix:" + self.socket) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def status(self) -> int:
        import grpc

        from smddp.v1 import smddp_pb2 as pb
        from smddp.v1 import smddp_pb2_grpc as pb_grpc

        with grpc.insecure_channel("unix:" + self.socket) as channel:
            reply = pb_grpc.NodeStub(channel).Status(pb.StatusRequest(), timeout=5)
        return len(reply.comms)

    def scrape(self) -> str:
        with urllib.request.urlopen(self.http + "/metrics", timeout=5) as r:
            return r.read().decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _spawn(
    role: str, rank: int, job: str, token: str, daemon: Daemon, **extra: Any
) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--role", role, "--rank", str(rank), "--job", job]
    cmd += ["--token", token, "--socket", daemon.socket]
    for k, v in extra.items():
        cmd += [f"--{k}", str(v)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _attack_once(daemon: Daemon, rng: random.Random, tally: dict[str, Any]) -> None:
    job, token = f"attacker-{secrets.token_hex(4)}", secrets.token_hex(16)
    ranks = [_spawn("attacker", r, job, token, daemon, seed=rng.randrange(2**32)) for r in range(2)]
    deadline = time.monotonic() + HUNG_AFTER_S
    for p in ranks:
        try:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            tally["hung"].append(f"{job}: a rank ran past {HUNG_AFTER_S} s:\n{err[-2000:]}")
            continue
        lines = [x for x in out.splitlines() if x.startswith("{")]
        if not lines:
            if p.returncode not in (0, -signal.SIGKILL):
                tally["unnamed"].append(f"{job}: exit {p.returncode}:\n{err[-2000:]}")
            continue
        got = json.loads(lines[-1])
        for name in got["named"]:
            tally["named"][name] = tally["named"].get(name, 0) + 1
        tally["unnamed"] += [f"{job}: {u}" for u in got["unnamed"]]
    tally["jobs"] += 1


def _watch(daemon: Daemon, stop: threading.Event, tally: dict[str, Any]) -> None:
    while not stop.wait(0.5):
        for what, ask in (("health", daemon.health), ("status", daemon.status)):
            try:
                ok = ask()
                if what == "health" and not ok:
                    tally["failed_checks"].append("health: NOT_SERVING")
            except Exception as exc:
                tally["failed_checks"].append(f"{what}: {exc!r}"[:500])
        try:
            daemon.scrape()
        except Exception as exc:
            tally["failed_checks"].append(f"metrics: {exc!r}"[:500])
        tally["checks"] += 1


def _run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    folder = Path(tempfile.mkdtemp(prefix="smddp-fuzz-"))
    daemon = Daemon(folder)
    tally: dict[str, Any] = {
        "jobs": 0,
        "named": {},
        "unnamed": [],
        "hung": [],
        "checks": 0,
        "failed_checks": [],
    }
    stop_file, progress = folder / "stop", folder / "progress"
    victims: list[subprocess.Popen] = []
    try:
        token = secrets.token_hex(16)
        victims = [
            _spawn("victim", r, "victim", token, daemon, stop=stop_file, progress=progress)
            for r in range(2)
        ]
        while not progress.exists() or int(progress.read_text() or 0) < 100:
            if any(v.poll() is not None for v in victims):
                break
            time.sleep(0.1)
        watching = threading.Event()
        watcher = threading.Thread(target=_watch, args=(daemon, watching, tally), daemon=True)
        watcher.start()
        # Warm-up, with the watcher asking: gRPC's pools make the threads they keep.
        for _ in range(WARM_UP_JOBS):
            _attack_once(daemon, rng, tally)
        time.sleep(2)
        start = _daemon_numbers(daemon.proc.pid)
        until = time.monotonic() + args.seconds
        while time.monotonic() < until and daemon.proc.poll() is None:
            _attack_once(daemon, rng, tally)
        watching.set()
        watcher.join()
        end = _daemon_numbers(daemon.proc.pid) if daemon.proc.poll() is None else {}
        settle = time.monotonic() + SETTLE_S
        while daemon.proc.poll() is None and time.monotonic() < settle:
            end = _daemon_numbers(daemon.proc.pid)
            if _given_back(start, end):
                break
            time.sleep(0.5)
        alive = daemon.proc.poll() is None
        healthy = alive and daemon.health()
        stop_file.write_text("stop")
        victim_out = []
        for v in victims:
            try:
                out, err = v.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                v.kill()
                out, err = v.communicate()
            lines = [x for x in out.splitlines() if x.startswith("{")]
            victim_out.append(
                json.loads(lines[-1]) if lines else {"error": f"exit {v.returncode}: {err[-2000:]}"}
            )
    finally:
        for v in victims:
            if v.poll() is None:
                v.kill()
        log = daemon.log()
        daemon.stop()
        shutil.rmtree(folder, ignore_errors=True)
    given_back = bool(end) and _given_back(start, end)
    summary = {
        "seconds": args.seconds,
        "attacker_jobs": tally["jobs"],
        "attacker_named_errors": tally["named"],
        "attacker_unnamed_errors": tally["unnamed"][:5],
        "attacker_unnamed_count": len(tally["unnamed"]),
        "attacker_hung": tally["hung"][:5],
        "victim": victim_out,
        "daemon_alive": alive,
        "health_serving_at_end": healthy,
        "checks": tally["checks"],
        "failed_checks": tally["failed_checks"][:10],
        "failed_check_count": len(tally["failed_checks"]),
        "daemon_start": start,
        "daemon_end": end,
        "given_back": given_back,
    }
    ok = (
        alive
        and healthy
        and given_back
        and not tally["unnamed"]
        and not tally["hung"]
        and not tally["failed_checks"]
        and all(
            v.get("error") == "" and v.get("wrong") == 0 and v.get("ops", 0) > 0 for v in victim_out
        )
    )
    summary["ok"] = ok
    print(json.dumps(summary, indent=1))
    if not ok:
        print("--- smddpd's log (last 4000 characters) ---\n" + log[-4000:], file=sys.stderr)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """The parent (no --role) or one rank."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=300.0, help="how long the attack goes on")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--role", choices=("victim", "attacker"), default=None)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--job", default="")
    p.add_argument("--token", default="")
    p.add_argument("--socket", default="")
    p.add_argument("--stop", default="")
    p.add_argument("--progress", default="")
    args = p.parse_args(argv)
    if args.seed is None:
        args.seed = secrets.randbelow(2**32)
    if args.role == "victim":
        return _victim(args)
    if args.role == "attacker":
        return _attacker(args)
    print(f"region fuzz: seed {args.seed}", file=sys.stderr)
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
