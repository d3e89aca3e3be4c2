"""Fixtures shared by smddp's tests: a real smddpd per test, and ranks as real processes.

- ``daemon``: smddpd started as its own process on a private socket, ready once its
  grpc.health.v1 service says SERVING (no sleeping), stopped with SIGTERM afterwards, which
  must make it exit 0.
- ``start_daemon``: the same for tests that need their own command line, environment or
  several daemons; every daemon it started and left running is stopped at teardown.
- ``torch_free_python``: a Python command line under which torch is not installed, for the
  daemon and numpy clients that must run without it.
- ``spawn_ranks``: runs a module-level function of a test module in fresh Python processes,
  one per rank, and fails the test with a rank's traceback, or its exit signal (a segfault),
  when a rank does not finish cleanly.
- Under ``CI=true``, a skip outside ``tests/gpu`` fails the test (``ci_skips``: the hooks
  imported below).
- A run that leaves files in /tmp or /dev/shm fails, naming each one and the test it appeared
  during (``leftovers``: the hooks imported below).
"""

from __future__ import annotations

import os
import pickle
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from ci_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401
from daemon_log import http_port, serving_line
from grpc_health.v1 import health_pb2, health_pb2_grpc
from leftovers import (  # noqa: F401
    pytest_runtest_protocol,
    pytest_sessionfinish,
    pytest_sessionstart,
    pytest_terminal_summary,
)

DAEMON_COMMAND = (sys.executable, "-m", "smddp.server")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
RANK_TIMEOUT_S = 120.0
FAILED_RANK_GRACE_S = 15.0


# -- the daemon -------------------------------------------------------------------------------


@dataclass
class DaemonProcess:
    """A running smddpd: its socket, its process and the file its log goes to."""

    socket: str
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        """Everything the daemon wrote to stderr so far."""
        return self.log_path.read_text(errors="replace")

    def serving_line(self) -> str:
        """Its "smddpd serving" line, which follows SERVING by a moment: waited for."""
        return serving_line(self.log, lambda: self.proc.poll() is None, START_TIMEOUT_S)

    def http_port(self) -> int:
        """The port its HTTP server took, from its "smddpd serving" line (``daemon_log``)."""
        return http_port(self.serving_line())

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Sends ``sig`` and returns the exit status; fails the test if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(
                f"smddpd did not exit within {timeout_s} s of "
                f"{signal.Signals(sig).name}:\n{self.log()}"
            )


def health_status(socket_path: str, timeout_s: float = 1.0) -> int | None:
    """The daemon's overall grpc.health.v1 status, or None while nothing answers."""
    options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 200)]
    with grpc.insecure_channel("unix:" + socket_path, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s, wait_for_ready=True
            )
        except grpc.RpcError:
            return None
    return reply.status


def _launch(
    socket_path: str,
    args: Sequence[str],
    command: Sequence[str],
    env: dict[str, str] | None,
    log_path: Path,
) -> DaemonProcess:
    full_env = dict(os.environ if env is None else env)
    cmd = [
        *command,
        "--socket",
        socket_path,
        "--http-bind",
        "off",
        "--peer-bind",
        "127.0.0.1:0",
        "--data-port",
        "0",
        "--ucx-port",
        "0",
        *args,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log
        )
    daemon = DaemonProcess(socket_path, proc, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    # Check() with wait_for_ready blocks until the socket accepts, so this loop waits on the
    # daemon rather than on a clock; it only turns to notice a daemon that died.
    while health_status(socket_path) != health_pb2.HealthCheckResponse.SERVING:
        if proc.poll() is not None:
            pytest.fail(
                f"smddpd exited with status {proc.returncode} before serving:\n{daemon.log()}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(
                f"smddpd did not report SERVING within {START_TIMEOUT_S} s:\n{daemon.log()}"
            )
    # Its "smddpd serving" line (every listener) comes a moment after SERVING: tests read it.
    try:
        daemon.serving_line()
    except AssertionError as exc:
        pytest.fail(str(exc))
    return daemon


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A private folder for sockets, short enough for a unix socket path (108 bytes)."""
    folder = Path(tempfile.mkdtemp(prefix="smddp-test-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def start_daemon(socket_dir: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """Starts smddpds: ``start_daemon(args=(), command=DAEMON_COMMAND, env=None, name="smddpd")``.

    ``env`` replaces the environment;
    ``command`` is the program before ``--socket PATH --http-bind off --peer-bind
    127.0.0.1:0 --data-port 0 --ucx-port 0`` (private socket, no HTTP, free ports for peers)
    and ``args``.
    """
    started: list[DaemonProcess] = []

    def start(
        args: Sequence[str] = (),
        command: Sequence[str] = DAEMON_COMMAND,
        env: dict[str, str] | None = None,
        name: str = "smddpd",
    ) -> DaemonProcess:
        d = _launch(
            str(socket_dir / f"{name}.sock"), args, command, env, socket_dir / f"{name}.log"
        )
        started.append(d)
        return d

    yield start
    for d in started:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
        if d.proc.stdout is not None:
            d.proc.stdout.close()


@pytest.fixture
def daemon(start_daemon: Callable[..., DaemonProcess]) -> Iterator[DaemonProcess]:
    """A running smddpd (``.socket``, ``.proc``); SIGTERM afterwards must make it exit 0."""
    d = start_daemon()
    yield d
    rc = d.stop(signal.SIGTERM)
    assert rc == 0, f"smddpd exited with status {rc} after SIGTERM:\n{d.log()}"


# -- an interpreter without torch -------------------------------------------------------------

# Makes the path-based importer (importlib.machinery.PathFinder, which every finder that
# looks at sys.path ends in) blind to torch and its sibling packages, exactly as where they
# are not installed, and records every lookup of them. Then runs ``-m MODULE ARGS`` or
# ``SCRIPT ARGS`` as __main__. At exit, it writes {"lookups": [...], "loaded": [...]} to the
# file named by SMDDP_TEST_TORCH_REPORT, if set.
_TORCH_FREE = """
import atexit, importlib.machinery, json, os, runpy, sys
HIDDEN = {"torch", "functorch", "torchgen"}
lookups = []
find_on_path = importlib.machinery.PathFinder.find_spec
def find_spec(name, path=None, target=None):
    if name.partition(".")[0] in HIDDEN:
        lookups.append(name)
        return None
    return find_on_path(name, path, target)
importlib.machinery.PathFinder.find_spec = staticmethod(find_spec)
report = os.environ.get("SMDDP_TEST_TORCH_REPORT")
def write_report():
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in HIDDEN)
    with open(report, "w") as f:
        json.dump({"lookups": lookups, "loaded": loaded}, f)
if report:
    atexit.register(write_report)
if sys.argv[1] == "-m":
    sys.argv = sys.argv[2:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="session")
def torch_free_python() -> tuple[str, ...]:
    """The start of a command line (add ``-m MODULE`` or a script) that runs without torch."""
    return (sys.executable, "-c", _TORCH_FREE)


# -- ranks as processes -----------------------------------------------------------------------

# Runs in each rank's process: loads the test module from its file, calls the function, and
# leaves its return value or its traceback in files the parent reads.
_BOOTSTRAP = """
import importlib.util, pickle, sys, traceback
path, module_name, func_name, args_file, result_file, error_file, tests = sys.argv[1:8]
# What pytest's "prepend" import mode puts on sys.path: the module's folder and tests/.
sys.path[:0] = [path.rpartition("/")[0], tests]
try:
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    with open(args_file, "rb") as f:
        args, kwargs = pickle.load(f)
    result = getattr(module, func_name)(*args, **kwargs)
    with open(result_file, "wb") as f:
        pickle.dump(result, f)
except BaseException:
    with open(error_file, "w") as f:
        f.write(traceback.format_exc())
    sys.exit(1)
"""


@dataclass
class Rank:
    """One rank's process and what it printed."""

    rank: int
    proc: subprocess.Popen
    folder: Path
    lines: queue.Queue[str | None] = field(default_factory=queue.Queue)
    stdout: list[str] = field(default_factory=list)

    def pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout.append(line)
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def stderr(self) -> str:
        return (self.folder / "stderr").read_text(errors="replace")

    def printed_pid(self) -> int:
        """The pid from the rank's "pid N" line (its program prints it, e.g. before it is
        killed: the process the test started may be a wrapper)."""
        for line in self.stdout:
            m = re.fullmatch(r"pid (\d+)\n?", line)
            if m:
                return int(m.group(1))
        raise AssertionError(f"rank {self.rank} printed no pid: {self.stdout}")

    def failure(self) -> str:
        """Why this rank did not finish cleanly, for the test's failure message."""
        rc = self.proc.returncode
        why = f"exit status {rc}" if rc >= 0 else f"killed by {signal.Signals(-rc).name}"
        error = self.folder / "error"
        trace = error.read_text() if error.exists() else "(no Python traceback)"
        return (
            f"rank {self.rank}: {why}\n{trace}\n--- stderr (last 4000 chars) ---\n"
            f"{self.stderr()[-4000:]}"
        )


class Ranks:
    """The processes of one ``spawn_ranks`` call."""

    def __init__(self, ranks: list[Rank], timeout_s: float) -> None:
        self.ranks = ranks
        self.deadline = time.monotonic() + timeout_s
        self._exited: queue.Queue[int] = queue.Queue()
        for r in ranks:
            threading.Thread(target=self._reap, args=(r,), daemon=True).start()

    def _reap(self, r: Rank) -> None:
        r.proc.wait()
        self._exited.put(r.rank)

    def wait_for(self, marker: str) -> None:
        """Blocks until every rank has printed the line ``marker``; fails if one exits first."""
        for r in self.ranks:
            while True:
                try:
                    line = r.lines.get(timeout=max(0.0, self.deadline - time.monotonic()))
                except queue.Empty:
                    self.kill()
                    pytest.fail(
                        f"rank {r.rank} did not print {marker!r} in time:\n{r.stderr()[-4000:]}"
                    )
                if line is None:
                    r.proc.wait()
                    self.kill()
                    pytest.fail(f"rank {r.rank} ended before printing {marker!r}:\n{r.failure()}")
                if line == marker:
                    break

    def send(self, line: str) -> None:
        """Writes ``line`` to every rank's stdin (a rank reads it with ``sys.stdin.readline()``)."""
        for r in self.ranks:
            assert r.proc.stdin is not None
            r.proc.stdin.write(line + "\n")
            r.proc.stdin.flush()

    def join(self) -> list[Any]:
        """Waits for every rank; returns their return values or fails with their tracebacks.

        Once a rank has failed, the others get FAILED_RANK_GRACE_S to end (smddp must fail
        their ops within seconds, not leave them hanging) before they are killed.
        """
        running = {r.rank for r in self.ranks}
        deadline = self.deadline
        while running:
            try:
                rank = self._exited.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            running.discard(rank)
            if self.ranks[rank].proc.returncode != 0:
                deadline = min(deadline, time.monotonic() + FAILED_RANK_GRACE_S)
        self.kill()
        failures = []
        for r in self.ranks:
            if r.rank in running:
                failures.append(f"rank {r.rank}: did not finish in time\n{r.stderr()[-4000:]}")
            elif r.proc.returncode != 0:
                failures.append(r.failure())
        if failures:
            pytest.fail("\n\n".join(failures), pytrace=False)
        results = []
        for r in self.ranks:
            with open(r.folder / "result", "rb") as f:
                results.append(pickle.load(f))
        return results

    def kill(self) -> None:
        """Kills the ranks still running."""
        for r in self.ranks:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()


@pytest.fixture
def spawn_ranks(tmp_path: Path) -> Iterator[Callable[..., Ranks]]:
    """Starts ``fn(rank, *args, **kwargs)`` in one fresh process per rank.

    ``spawn_ranks(fn, world_size, *args, env=None, timeout_s=120, **kwargs)`` returns a
    Ranks whose ``join()`` gives the return values in rank order. ``fn`` must be a
    module-level function of a test module; arguments and results travel pickled.
    """
    spawned: list[Ranks] = []
    calls = iter(range(1 << 30))

    def spawn(
        fn: Callable[..., Any],
        world_size: int,
        *args: Any,
        env: dict[str, str] | None = None,
        timeout_s: float = RANK_TIMEOUT_S,
        **kwargs: Any,
    ) -> Ranks:
        call = next(calls)
        ranks = []
        for rank in range(world_size):
            folder = tmp_path / f"spawn{call}-rank{rank}"
            folder.mkdir()
            with open(folder / "args", "wb") as f:
                pickle.dump(((rank, *args), kwargs), f)
            argv = [
                sys.executable,
                "-c",
                _BOOTSTRAP,
                fn.__code__.co_filename,
                fn.__module__,
                fn.__name__,
                str(folder / "args"),
                str(folder / "result"),
                str(folder / "error"),
                str(Path(__file__).resolve().parent),
            ]
            with open(folder / "stderr", "wb") as err:
                proc = subprocess.Popen(
                    argv,
                    env=dict(os.environ if env is None else env),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                    cwd=folder,
                )
            r = Rank(rank, proc, folder)
            threading.Thread(target=r.pump, daemon=True).start()
            ranks.append(r)
        group = Ranks(ranks, timeout_s)
        spawned.append(group)
        return group

    yield spawn
    for group in spawned:
        group.kill()
