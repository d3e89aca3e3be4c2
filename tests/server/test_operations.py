"""Operating smddpd as a real process: JSON logs, HTTP health and metrics, the probe-only TCP
listener, smddpctl and sd_notify.

Each test starts its own daemon (``sys.executable -m smddp.server``) on a private socket and a
free HTTP port, waits for grpc.health.v1 to say SERVING, and drives real ops through the numpy
client, two ranks of one job from this process.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from daemon_log import http_port, serving_line
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from ports import free_port
from prometheus_client.parser import text_string_to_metric_families

from smddp.client import SmddpError, connect
from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
NODE_SERVICE = "smddp.v1.Node"
HEALTH_SERVICE = "grpc.health.v1.Health"
REFLECTION_SERVICE = "grpc.reflection.v1alpha.ServerReflection"
# Reconnect quickly while the daemon is still binding its socket.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 200),
]
# Label names a metric may carry; none of them is numbered by op.
BOUNDED_LABELS = {"op", "dtype", "kind", "job", "rank", "peer", "le"}
# Environment that would change what the daemon does, whatever pytest runs under.
_FOREIGN_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "SMDDP_CONFIG")


def _clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("SMDDP_") and k not in _FOREIGN_ENV
    }
    env.update(extra or {})
    return env


@dataclass
class Smddpd:
    """One smddpd process started by a test."""

    proc: subprocess.Popen
    socket: str
    log_path: Path
    _http_port: int = 0

    @property
    def http_port(self) -> int:
        """The port its HTTP server took, from its "smddpd serving" log line.

        It is started with port 0: a free port picked here and bound by the daemon a second
        later could be taken in between.
        """
        if not self._http_port:
            line = serving_line(self.log, lambda: self.proc.poll() is None)
            self._http_port = http_port(line)
        return self._http_port

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel("unix:" + self.socket, options=CHANNEL_OPTIONS)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signals the daemon and returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(
                f"smddpd did not exit within {STOP_TIMEOUT_S} s of "
                f"{signal.Signals(sig).name}:\n{self.log()}"
            )


def _wait_serving(d: Smddpd) -> None:
    """Follows the daemon's health Watch until it says SERVING (no sleeping)."""
    with d.channel() as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            for reply in stub.Watch(
                health_pb2.HealthCheckRequest(service=""),
                timeout=START_TIMEOUT_S,
                wait_for_ready=True,
            ):
                if reply.status == SERVING:
                    return
        except grpc.RpcError as exc:
            d.proc.kill()
            d.proc.wait()
            pytest.fail(
                f"smddpd never reported SERVING ({exc.code().name}), exit "
                f"{d.proc.returncode}:\n{d.log()}"
            )
    pytest.fail(f"smddpd's health Watch ended before SERVING:\n{d.log()}")


@pytest.fixture
def launch() -> Iterator[Callable[..., Smddpd]]:
    """``launch(*args, env=None)`` starts smddpd on a private socket and an HTTP port it picks."""
    folder = Path(tempfile.mkdtemp(prefix="smddp-ops-"))  # short: sun_path holds 108 bytes
    started: list[Smddpd] = []

    def start(*args: str, env: dict[str, str] | None = None, wait: bool = True) -> Smddpd:
        n = len(started)
        sock = str(folder / f"d{n}.sock")
        log_path = folder / f"d{n}.log"
        # No peer listener: these tests use one node, and the default peer port is shared.
        cmd = [
            sys.executable,
            "-m",
            "smddp.server",
            "--socket",
            sock,
            "--http-bind",
            "127.0.0.1:0",
            "--peer-bind",
            "off",
            *args,
        ]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd, env=_clean_env(env), stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        d = Smddpd(proc, sock, log_path)
        started.append(d)
        if wait:
            _wait_serving(d)
        return d

    yield start
    for d in started:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _scrape(d: Smddpd) -> Series:
    code, text = _get(d.url("/metrics"))
    assert code == 200, text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _value(series: Series, name: str, **labels: str) -> float:
    return series.get((name, frozenset(labels.items())), 0.0)


def _job(prefix: str) -> tuple[str, bytes]:
    return f"{prefix}-{secrets.token_hex(4)}", secrets.token_bytes(16)


def _all_reduce_pair(c0, c1, n: int = 1000) -> None:
    a = np.arange(n, dtype=np.float32)
    b = np.ones(n, dtype=np.float32)
    h0, h1 = c0.all_reduce(a), c1.all_reduce(b)
    h0.wait()
    h1.wait()
    np.testing.assert_array_equal(a, np.arange(n, dtype=np.float32) + 1)
    np.testing.assert_array_equal(a, b)


def _barrier_pair(c0, c1) -> None:
    h0, h1 = c0.barrier(), c1.barrier()
    h0.wait()
    h1.wait()


def _ctl(d: Smddpd, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "smddp.server.ctl", "--socket", d.socket, *args],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def _wait_pending(d: Smddpd, job: str) -> None:
    """Returns once the daemon shows an op of ``job`` waiting (the client submits
    asynchronously)."""
    with d.channel() as channel:
        stub = pb_grpc.NodeStub(channel)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            st = stub.Status(pb.StatusRequest(), timeout=5)
            if any(c.job_id == job and c.pending for c in st.comms):
                return
    pytest.fail(f"the daemon never showed a pending op of {job}")


# -- logs ---------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_json_logs_carry_job_comm_rank_node(launch, monkeypatch: pytest.MonkeyPatch) -> None:
    d = launch("--log-format", "json", "--node-id", "daemon-node")
    monkeypatch.setenv("SMDDP_NODE_ID", "rank-node")
    sock = d.socket

    # Registration, then a communicator failure: rank 1 leaves while rank 0 waits in an op.
    job, token = _job("logs")
    c0 = connect(job, token, 0, 2, socket_path=sock)
    c1 = connect(job, token, 1, 2, socket_path=sock)
    waiting = c0.all_reduce(np.ones(16, np.float32))
    _wait_pending(d, job)
    c1.close()
    with pytest.raises(SmddpError, match="rank 1"):
        waiting.wait()
    c0.close()

    # A timeout names the one rank that never arrived.
    late_job, late_token = _job("late")
    t0 = connect(late_job, late_token, 0, 2, socket_path=sock, timeout_s=0.5)
    t1 = connect(late_job, late_token, 1, 2, socket_path=sock, timeout_s=0.5)
    with pytest.raises(SmddpError, match="timed out"):
        t0.all_reduce(np.ones(4, np.float32)).wait()
    t0.close()
    t1.close()
    assert d.stop() == 0

    records = []
    for line in d.log().splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)  # every line is one JSON object
        assert isinstance(entry, dict), line
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", entry["time"]), line
        assert entry["level"] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), line
        assert isinstance(entry["message"], str) and entry["message"], line
        records.append(entry)
    assert any("serving on" in r["message"] for r in records)

    def one(pattern: str) -> dict:
        found = [r for r in records if re.search(pattern, r["message"])]
        assert len(found) == 1, f"{pattern!r} in {[r['message'] for r in records]}"
        return found[0]

    for rank in (0, 1):
        reg = one(rf"^job {job} comm 0: registered rank {rank} ")
        assert (reg["job"], reg["comm"], reg["rank"], reg["node"]) == (
            job,
            "0",
            rank,
            "rank-node",
        ), reg
        assert reg["level"] == "INFO"
    left = one(rf"^job {job} comm 0: rank 1 .* has left the communicator")
    assert (left["job"], left["comm"], left["rank"], left["node"]) == (job, "0", 1, "rank-node"), (
        left
    )
    assert left["level"] == "WARNING"  # it failed rank 0's op
    last = one(rf"^job {job} comm 0: rank 0 .* has left the communicator")
    assert (last["job"], last["comm"], last["rank"], last["node"]) == (job, "0", 0, "rank-node"), (
        last
    )
    assert last["level"] == "INFO"
    timeout = one(rf"^job {late_job} comm 0: .* timed out")
    assert (timeout["job"], timeout["comm"], timeout["rank"], timeout["node"]) == (
        late_job,
        "0",
        1,
        "rank-node",
    ), timeout
    assert timeout["level"] == "WARNING"


# -- HTTP -----------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_healthz_and_readyz_then_503_during_graceful_shutdown(launch) -> None:
    d = launch()
    assert _get(d.url("/healthz")) == (200, "ok\n")
    assert _get(d.url("/readyz")) == (200, "ready\n")
    assert _get(d.url("/nothing"))[0] == 404

    job, token = _job("drain")
    c0 = connect(job, token, 0, 2, socket_path=d.socket)
    c1 = connect(job, token, 1, 2, socket_path=d.socket)
    waiting = c0.all_reduce(np.ones(8, np.float32))  # rank 1 never joins: shutdown has work
    _wait_pending(d, job)

    with d.channel() as channel:
        # An open Watch is an RPC in flight, which the daemon's grace period waits for: the
        # HTTP listener is still up while the daemon drains.
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=30
        )
        assert next(watch).status == SERVING
        d.proc.send_signal(signal.SIGTERM)
        assert next(watch).status == NOT_SERVING
        code, body = _get(d.url("/readyz"))
        assert (code, body) == (503, "shutting down\n")
        watch.cancel()
    with pytest.raises(SmddpError, match="shutting down"):
        waiting.wait()
    assert d.stop() == 0
    c0.close()
    c1.close()


@pytest.mark.timeout(120)
def test_metrics_count_ops_bytes_ranks_and_stragglers(launch) -> None:
    d = launch("--metrics-job-labels")  # the straggler series are per job: only with it
    before = _scrape(d)
    assert _value(before, "smddp_registered_ranks") == 0
    code, _ = _get(d.url("/metrics"))
    assert code == 200

    job, token = _job("metrics")
    c0 = connect(job, token, 0, 2, socket_path=d.socket)
    c1 = connect(job, token, 1, 2, socket_path=d.socket)
    registered = _scrape(d)
    assert _value(registered, "smddp_registered_ranks") == 2
    assert _value(registered, "smddp_active_jobs") == 1
    assert _value(registered, "smddp_shm_bytes") > 0

    _all_reduce_pair(c0, c1, n=1000)
    _barrier_pair(c0, c1)
    after = _scrape(d)
    ar = {"op": "all_reduce", "dtype": "float32"}
    assert _value(after, "smddp_ops_total", **ar) == _value(before, "smddp_ops_total", **ar) + 1
    # Two ranks contributed 1000 float32 each.
    assert (
        _value(after, "smddp_op_bytes_total", **ar)
        == _value(before, "smddp_op_bytes_total", **ar) + 2 * 4000
    )
    assert _value(after, "smddp_ops_total", op="barrier", dtype="none") == 1
    assert _value(after, "smddp_op_duration_seconds_count", **ar) == 1
    assert _value(after, "smddp_arrival_skew_seconds_count", op="all_reduce") == 1
    assert _value(after, "smddp_registered_ranks") == 2
    stragglers = {
        dict(labels)["rank"]: v
        for (name, labels), v in after.items()
        if name == "smddp_straggler_total" and dict(labels).get("job") == job
    }
    assert stragglers and set(stragglers) <= {"0", "1"}, stragglers
    assert sum(stragglers.values()) == 2  # one last rank per op
    for name, labels in after:
        assert {k for k, _ in labels} <= BOUNDED_LABELS, (name, labels)

    # No series appears per op: twenty more ops add no series but the other rank's straggler.
    # (A job's own series, --metrics-job-labels, go with the job.)
    def shape(series: Series) -> set:
        return {key for key in series if "job" not in dict(key[1])}

    for _ in range(10):
        _all_reduce_pair(c0, c1, n=10)
        _barrier_pair(c0, c1)
    later = _scrape(d)
    assert shape(later) == shape(after)
    assert {dict(labels)["rank"] for name, labels in later if name == "smddp_straggler_total"} <= {
        "0",
        "1",
    }
    assert _value(later, "smddp_ops_total", **ar) == _value(before, "smddp_ops_total", **ar) + 11

    c0.close()
    c1.close()
    ended = _scrape(d)
    assert _value(ended, "smddp_registered_ranks") == 0
    assert _value(ended, "smddp_active_jobs") == 0
    assert not [k for k in ended if k[0] == "smddp_straggler_total" and ("job", job) in k[1]]
    assert shape(ended) == shape(later)
    assert d.stop() == 0


# -- the TCP listener ----------------------------------------------------------------------------


def _reflected_services(channel: grpc.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
    )
    return {s.name for reply in replies for s in reply.list_services_response.service}


@pytest.mark.timeout(90)
def test_grpc_bind_serves_health_and_reflection_but_not_node(launch) -> None:
    port = free_port()
    d = launch("--grpc-bind", f"127.0.0.1:{port}")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as tcp:
        health = health_pb2_grpc.HealthStub(tcp)
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == SERVING
        assert (
            health.Check(health_pb2.HealthCheckRequest(service=NODE_SERVICE), timeout=10).status
            == SERVING
        )
        services = _reflected_services(tcp)
        assert {HEALTH_SERVICE, REFLECTION_SERVICE} <= services
        assert NODE_SERVICE not in services

        node = pb_grpc.NodeStub(tcp)
        register = pb.RegisterRequest(
            job_id="tcp",
            job_token=secrets.token_bytes(16),
            comm_id="0",
            rank=0,
            world_size=1,
            pid=os.getpid(),
            node_id="n",
            arena_bytes=1 << 20,
        )
        with pytest.raises(grpc.RpcError) as info:
            node.Register(register, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as info:
            node.Status(pb.StatusRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED

    with d.channel() as local:
        assert NODE_SERVICE in _reflected_services(local)
    assert d.stop() == 0


@pytest.mark.timeout(90)
def test_grpc_bind_on_a_taken_port_is_refused(launch) -> None:
    port = free_port()
    first = launch("--grpc-bind", f"127.0.0.1:{port}")
    second = launch("--grpc-bind", f"127.0.0.1:{port}", wait=False)
    # Probes must reach one daemon, not whichever of two the kernel picks.
    assert second.proc.wait(timeout=START_TIMEOUT_S) != 0, second.log()
    assert f"127.0.0.1:{port}" in second.log()
    assert first.stop() == 0


# -- smddpctl ------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_smddpctl_health_status_and_metrics(launch) -> None:
    d = launch()
    health = _ctl(d, "health")
    assert health.returncode == 0, health.stderr
    assert "SERVING" in health.stdout
    health_json = json.loads(_ctl(d, "--json", "health").stdout)
    assert health_json["status"] == "SERVING"

    job, token = _job("ctl")
    c0 = connect(job, token, 0, 2, socket_path=d.socket)
    c1 = connect(job, token, 1, 2, socket_path=d.socket)
    a, b = np.full(64, 2.0, np.float32), np.full(64, 3.0, np.float32)
    h0 = c0.all_reduce(a)  # rank 1 has not entered it yet
    _wait_pending(d, job)

    status = _ctl(d, "--json", "status")
    assert status.returncode == 0, status.stderr
    st = json.loads(status.stdout)
    comms = [c for c in st["comms"] if c["job_id"] == job]
    assert len(comms) == 1, st
    comm = comms[0]
    assert comm["world_size"] == 2
    assert sorted(r["rank"] for r in comm["ranks"]) == [0, 1]
    assert {r["pid"] for r in comm["ranks"]} == {os.getpid()}
    assert len(comm["pending"]) == 1, comm
    op = comm["pending"][0]
    assert op["missing_ranks"] == [1]
    assert op["arrived_ranks"] == [0]
    assert "all_reduce" in op["description"]
    assert int(op["seq"]) == 1
    assert op["waited_seconds"] > 0

    text = _ctl(d, "status")
    assert text.returncode == 0, text.stderr
    assert f"job {job} comm 0: 2/2 ranks" in text.stdout
    assert re.search(
        r"waiting: op #1 .*all_reduce.* for \d+\.\d s; arrived 0; missing 1", text.stdout
    ), text.stdout

    h1 = c1.all_reduce(b)
    h0.wait()
    h1.wait()
    np.testing.assert_array_equal(a, np.full(64, 5.0, np.float32))
    done = json.loads(_ctl(d, "--json", "status").stdout)
    (comm,) = [c for c in done["comms"] if c["job_id"] == job]
    assert comm["pending"] == []
    assert int(comm["ops_completed"]) == 1

    metrics = _ctl(d, "--json", "metrics", "--raw")  # the samples, read over the socket
    assert metrics.returncode == 0, metrics.stderr
    samples = json.loads(metrics.stdout)
    assert {
        "name": "smddp_ops_total",
        "labels": {"op": "all_reduce", "dtype": "float32"},
        "value": 1.0,
    } in samples
    assert {"name": "smddp_registered_ranks", "labels": {}, "value": 2.0} in samples

    c0.close()
    c1.close()
    assert d.stop() == 0
    gone = _ctl(d, "health")
    assert gone.returncode != 0


# -- sd_notify -----------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_sd_notify_ready_watchdog_and_stopping(launch) -> None:
    folder = tempfile.mkdtemp(prefix="smddp-notify-")
    path = os.path.join(folder, "notify")
    manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        manager.bind(path)
        manager.settimeout(START_TIMEOUT_S)
        d = launch(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"}, wait=False)

        def receive() -> tuple[str, float]:
            try:
                return manager.recv(4096).decode(), time.monotonic()
            except TimeoutError:
                pytest.fail(f"no notification from smddpd:\n{d.log()}")

        first, _ = receive()
        assert first == "READY=1", first
        # READY comes once the sockets listen: the daemon answers SERVING now, without waiting.
        with d.channel() as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
        assert reply.status == SERVING

        pings = []
        while len(pings) < 4:
            message, at = receive()
            assert message == "WATCHDOG=1", message  # READY=1 is sent once
            pings.append(at)
        gaps = [b - a for a, b in itertools.pairwise(pings)]
        # systemd expects a ping within WATCHDOG_USEC; smddpd pings every half of it.
        assert max(gaps) < 1.0, gaps

        d.proc.send_signal(signal.SIGTERM)
        while True:
            message, _ = receive()
            if message == "STOPPING=1":
                break
            assert message == "WATCHDOG=1", message
        assert d.proc.wait(timeout=STOP_TIMEOUT_S) == 0, d.log()
    finally:
        manager.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.timeout(120)
def test_straggler_counter_names_the_rank_held_back(launch) -> None:
    d = launch("--metrics-job-labels")
    job, token = _job("straggler")
    c0 = connect(job, token, 0, 2, socket_path=d.socket)
    c1 = connect(job, token, 1, 2, socket_path=d.socket)
    delay = 0.2
    for _ in range(3):
        a, b = np.ones(16, dtype=np.float32), np.ones(16, dtype=np.float32)
        h0 = c0.all_reduce(a)
        time.sleep(delay)  # rank 1 arrives late, on purpose
        h1 = c1.all_reduce(b)
        h0.wait()
        h1.wait()
    series = _scrape(d)
    stragglers = {
        dict(labels)["rank"]: v
        for (name, labels), v in series.items()
        if name == "smddp_straggler_total" and dict(labels).get("job") == job
    }
    assert stragglers == {"1": 3.0}, stragglers
    assert _value(series, "smddp_arrival_skew_seconds_sum", op="all_reduce") >= 3 * delay
    c0.close()
    c1.close()
