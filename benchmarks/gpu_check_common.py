"""What the GPU check's stages share: daemons on private sockets, the rank's GPU (real, or the
fake GPU of the dry run), rank processes with a deadline, and each stage's verdict file.

The fake GPU (``benchmarks/gpu_check.py --fake-gpu``): ranks get ``tests/gpu/fake_device.py``
(given to ``backend.cuda.use_device`` by ``Gpu``: "GPU memory" is host shared memory exported
by fake IPC handles) and daemons ``benchmarks/gpu_check_fake.py`` (given by
``tests/gpu/fake_smddpd.py``: the tests' fake runtime, whose kernels are the generated ones
interpreted, and which looks each module up in the prepared kernel cache). ``Gpu`` hides the
difference from the rank programs.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Set by gpu_check.py --fake-gpu for every stage: ranks give the backend the fake device
# (``Gpu``), daemons are FAKE_SMDDPD.
FAKE_GPU_ENV = "SMDDP_CHECK_FAKE_GPU"
# The dry run's daemons: smddpd with this fake runtime given to its constructor.
FAKE_SMDDPD = REPO / "tests" / "gpu" / "fake_smddpd.py"
FAKE_RUNTIME = f"{REPO / 'benchmarks' / 'gpu_check_fake.py'}:runtime"
# Set by gpu_check.py for every stage: the scratch folder (outside OUT) and the stage's end.
SCRATCH_ENV = "SMDDP_CHECK_SCRATCH"
DEADLINE_ENV = "SMDDP_CHECK_DEADLINE"  # time.time() by which the stage must be done
QUICK_ENV = "SMDDP_CHECK_QUICK"


def scratch() -> Path:
    """The check's scratch folder (a temporary folder of its own outside the tree)."""
    path = Path(os.environ.get(SCRATCH_ENV) or "/tmp/smddp-gpu-check")
    path.mkdir(parents=True, exist_ok=True)
    return path


def deadline() -> float:
    """When the running stage's cap ends (time.time()); an hour away when unset."""
    return float(os.environ.get(DEADLINE_ENV) or time.time() + 3600)


def fake_gpu() -> bool:
    """Whether this is the dry run on the fake GPU."""
    return os.environ.get(FAKE_GPU_ENV) == "1"


def quick() -> bool:
    """Whether the check runs ``--quick`` (fewer sizes, worlds, steps)."""
    return os.environ.get(QUICK_ENV) == "1"


def write_verdict(stage: str, verdict: str, detail: str, **extra: Any) -> None:
    """Records the stage's verdict (PASS, FAIL or SKIP) and one line of detail for the summary."""
    path = scratch() / f"verdict.{stage}.json"
    path.write_text(json.dumps({"verdict": verdict, "detail": detail, **extra}))


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- daemons ---------------------------------------------------------------------------------


@dataclass
class Daemon:
    """An smddpd the stage started: its socket, process, log and HTTP port (0: none)."""

    name: str
    socket: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    http_port: int = 0

    def log(self) -> str:
        """What it logged so far."""
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        """Its Prometheus text (needs ``http=True`` at start)."""
        url = f"http://127.0.0.1:{self.http_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return str(reply.read().decode())

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 10 s; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_daemon(
    name: str, node_id: str = "", http: bool = False, timeout_s: float = 60.0
) -> Daemon:
    """Starts ``python -m smddp.server`` (the dry run: ``FAKE_SMDDPD``) on a private socket
    (free peer ports, HTTP only when ``http``) and waits for its "smddpd serving" line.

    Raises:
        RuntimeError: it exited or did not serve within ``timeout_s``; the log is in the message.
    """
    folder = scratch() / "daemons"
    folder.mkdir(exist_ok=True)
    sock = str(folder / f"{name}.sock")
    log_path = folder / f"{name}.log"
    # The dry run's daemon is smddpd given the fake runtime through its constructor.
    if fake_gpu():
        program = [sys.executable, str(FAKE_SMDDPD), FAKE_RUNTIME]
    else:
        program = [sys.executable, "-m", "smddp.server"]
    cmd = [
        *program,
        "--socket",
        sock,
        "--http-bind",
        "127.0.0.1:0" if http else "off",
        "--peer-bind",
        "127.0.0.1:0",
        "--data-port",
        "0",
        "--ucx-port",
        "0",
    ]
    if node_id:
        cmd += ["--node-id", node_id]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    d = Daemon(name, sock, proc, log_path)
    end = time.monotonic() + timeout_s
    while True:
        text = d.log()
        line = next((x for x in text.splitlines() if "smddpd serving" in x), None)
        if line is not None:
            if http:
                found = re.search(r"listening: .*\bHTTP [^,\s]*:(\d+)", line)
                d.http_port = int(found[1]) if found else 0
            return d
        if proc.poll() is not None or time.monotonic() > end:
            d.stop()
            raise RuntimeError(f"smddpd {name} did not start (exit {proc.returncode}):\n{text}")
        time.sleep(0.05)


def kernel_sources(log: str) -> str:
    """The daemon's last "cubins so far" counts (prepared, disk, compiled), or ""."""
    found = re.findall(r"cubins so far: ([^\n]*)", log)
    return found[-1] if found else ""


# -- rank processes --------------------------------------------------------------------------


@dataclass
class RankRun:
    """The outcome of a group of rank processes."""

    codes: list[int | None]
    outputs: list[str]
    timed_out: bool

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(c == 0 for c in self.codes)

    def results(self, marker: str) -> list[dict[str, Any]]:
        """Each rank's JSON result: its last line starting with ``marker``."""
        out = []
        for text in self.outputs:
            lines = [x for x in text.splitlines() if x.startswith(marker)]
            out.append(json.loads(lines[-1][len(marker) :]) if lines else {})
        return out

    def why(self, limit: int = 1500) -> str:
        """The failed ranks' exit statuses and the ends of their output."""
        parts = []
        for r, (code, text) in enumerate(zip(self.codes, self.outputs)):
            if code != 0:
                state = "killed at the deadline" if code is None else f"exit status {code}"
                parts.append(f"--- rank {r}: {state}\n{text[-limit:]}")
        return "\n".join(parts) or "(every rank exited 0)"


def run_ranks(
    commands: Sequence[Sequence[str]], envs: Sequence[dict[str, str]], timeout_s: float
) -> RankRun:
    """Runs one process per command, waits at most ``timeout_s`` (then kills the rest), and
    after the first failure gives the others 15 s to fail too."""
    logs = []
    procs = []
    folder = scratch() / "ranks"
    folder.mkdir(exist_ok=True)
    for cmd, env in zip(commands, envs):
        name = f"rank-{os.getpid()}-{len(procs)}-{time.monotonic_ns()}.log"
        log = open(folder / name, "w+b")  # noqa: SIM115  (closed once the ranks are read)
        logs.append(log)
        procs.append(
            subprocess.Popen(
                list(cmd), env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        )
    end = time.monotonic() + timeout_s
    timed_out = False
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            end = min(end, time.monotonic() + 15)
        if time.monotonic() > end:
            timed_out = True
            break
        time.sleep(0.05)
    codes: list[int | None] = []
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
            codes.append(None)
        else:
            codes.append(p.returncode)
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read().decode(errors="replace"))
        log.close()
    return RankRun(codes, outputs, timed_out)


def rank_env(
    rank: int, world: int, port: int, daemon: Daemon, local_rank: int | None = None, **extra: str
) -> dict[str, str]:
    """The ``env://`` variables of one rank using ``daemon`` (no embedded daemon)."""
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank if local_rank is None else local_rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        SMDDP_SOCKET=daemon.socket,
        SMDDP_EMBEDDED="0",
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


# -- the rank's GPU --------------------------------------------------------------------------


class Gpu:
    """The rank's GPU: ``torch.cuda`` on GPU ``local_rank % device_count`` (ranks share GPUs
    where there are fewer than ranks), or the fake GPU of the dry run."""

    def __init__(self, local_rank: int) -> None:
        import torch

        self.torch = torch
        self.fake: Any = None
        if fake_gpu():
            from smddp.backend.cuda import device_api, use_device

            if str(REPO / "tests" / "gpu") not in sys.path:
                sys.path.append(str(REPO / "tests" / "gpu"))
            import fake_device

            use_device(fake_device.get())  # before the process's first device call
            self.fake = device_api()
            self.index = 0
            self.device = torch.device("cpu")
        else:
            self.index = local_rank % torch.cuda.device_count()
            torch.cuda.set_device(self.index)
            self.device = torch.device("cuda", self.index)

    def empty(self, n: int, dtype: Any) -> Any:
        """An uninitialised tensor of ``n`` elements in GPU memory."""
        if self.fake is not None:
            return self.fake.empty(n, dtype)
        return self.torch.empty(n, dtype=dtype, device=self.device)

    def tensor(self, t: Any) -> Any:
        """A GPU copy of tensor ``t``."""
        if self.fake is not None:
            return self.fake.tensor(t.detach().cpu())
        return t.to(self.device)

    def module(self, m: Any) -> Any:
        """``m.cuda()``; on the fake GPU its parameters move into fake allocations."""
        if self.fake is None:
            return m.cuda()
        for p in m.parameters():
            p.data = self.fake.tensor(p.data)
        return m

    def sync(self) -> None:
        """Waits for the GPU (``torch.cuda.synchronize()``)."""
        if self.fake is not None:
            self.fake.streams[0].synchronize(120.0)
        else:
            self.torch.cuda.synchronize()
