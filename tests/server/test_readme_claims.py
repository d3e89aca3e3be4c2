"""What the README states, checked against the code that runs.

The stated defaults are read out of README.md itself and the pages under docs/ that hold its
longer sections (so that the text and the code cannot drift apart unnoticed) and compared with the code's configuration objects and with what a running
daemon does. The rest are behaviours the README promises that no other test covered:
``smddp_errors_total`` for each kind, the peer byte and connection-error metrics, UCX with TLS
refused at start, ``/readyz`` 503 while the daemon is full, the daemons' rendezvous limit of
200 ranks, a hung node named by the heartbeat, and (as root, in a mount namespace of its own)
where daemons and clients find each other: ``SMDDP_SOCKET``, ``/run/smddp/smddpd.sock``, the
per-user folders, and the embedded daemon's 0700 folder and its exit with the job.

Every daemon here is a real smddpd process; ranks are numpy clients of this process or torch
processes.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import procstate
import pytest
import torch.distributed
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from smddp.client import SmddpError, connect, rendezvous
from smddp.client import communicator as client_communicator
from smddp.client.communicator import daemon_info
from smddp.client.errors import ConnectError
from smddp.core.wire import SYSTEM_SOCKET
from smddp.server import config, peer_transport
from smddp.server import rendezvous as server_rendezvous
from smddp.server.config import DaemonConfig
from smddp.server.peer_wire import token_proof
from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]
# The README and the pages its sections on many nodes, configuration, operations, failures and
# GPU tensors moved to: the claims below are read from them together.
README = "\n".join(
    (REPO / page).read_text()
    for page in (
        "README.md",
        "docs/multinode.md",
        "docs/configuration.md",
        "docs/operations.md",
        "docs/failures.md",
        "docs/gpu.md",
    )
)
DAEMONSET = REPO / "deploy" / "kubernetes" / "base" / "daemonset.yaml"
UNIT = REPO / "deploy" / "systemd" / "smddpd.service"
MIB = 1 << 20
ERROR_KINDS = (
    "invalid",
    "mismatch",
    "rank_failed",
    "timeout",
    "unauthenticated",
    "shutdown",
    "aborted",
)


def stated(pattern: str) -> list[tuple[str, ...]]:
    """Every match of ``pattern`` in the README and its pages (whitespace in it matches any line
    break); fails when they no longer say it."""
    found = [m.groups() for m in re.finditer(pattern.replace(" ", r"\s+"), README)]
    assert found, f"the README no longer states {pattern!r}"
    return found


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


# -- the stated defaults ----------------------------------------------------------------------


def test_stated_ports_are_the_daemons_and_the_daemonsets() -> None:
    cfg = DaemonConfig()
    # No peer listener unless told; the flags of the peer planes given alone imply one.
    assert stated(
        r"`--peer-bind HOST:PORT` \(default `([^`]+)`; `--data-port`, `--advertise`, "
        r"`--peer-transport` or "
        r"`--ucx-port` set alone imply `([^`]+)`\)"
    ) == [(cfg.peer_bind, config.IMPLIED_PEER_BIND)]
    assert (cfg.peer_bind, config.IMPLIED_PEER_BIND) == ("off", "0.0.0.0:7470")
    assert config.load(["--data-port", "7472"], {}).peer_bind == config.IMPLIED_PEER_BIND
    peer_port = port_of(config.IMPLIED_PEER_BIND)
    assert stated(r"`--data-port` \(default (\d+)\)") == [(str(cfg.data_port),)]
    assert stated(r"`--ucx-port` \(default (\d+)\)") == [(str(cfg.ucx_port),)]
    assert (
        stated(r"`--http-bind` \(default `([^`]+)`") == [(cfg.http_bind,)] == [("127.0.0.1:9464",)]
    )
    # "When things go wrong": the firewall hint repeats them.
    assert stated(
        r"\(`--peer-bind`, default (\d+), and `--data-port`, default (\d+); "
        r"`--ucx-port` (\d+) with UCX\)"
    ) == [(str(peer_port), str(cfg.data_port), str(cfg.ucx_port))]
    # Kubernetes: the named ports, as the DaemonSet has them and as the daemon is told.
    ((sentence,),) = stated(r"(port `grpc` \d+, `peer` \d+, `data` \d+, `ucx` \d+, `metrics` \d+)")
    readme_ports = {name: int(port) for name, port in re.findall(r"`(\w+)` (\d+)", sentence)}
    (container,) = yaml.safe_load(DAEMONSET.read_text())["spec"]["template"]["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == readme_ports
    assert {
        "peer": peer_port, "data": cfg.data_port, "ucx": cfg.ucx_port,
        "metrics": port_of(cfg.http_bind),
    } == {k: v for k, v in readme_ports.items() if k != "grpc"}  # fmt: skip
    assert f"--grpc-bind=0.0.0.0:{readme_ports['grpc']}" in container["args"]
    assert readme_ports["grpc"] == 7471


# How the README writes the limits' units: "(30 s)", "(512 MiB", "2 GiB in all".
_UNITS = {None: 1, " s": 1, " MiB": MIB, " GiB": 1 << 30}


def test_stated_limits_are_the_daemons() -> None:
    cfg = DaemonConfig()
    found = stated(
        r"`--([a-z][a-z-]*)`,?\s+\(?(\d+)( MiB| GiB| s)?\b"
    )  # "`--max-handshakes` 128 in all"
    got = {flag: int(n) * _UNITS[unit] for flag, n, unit in found}
    assert got == {flag: getattr(cfg, flag.replace("-", "_")) for flag in got}
    # Every limit of the daemon's own bounds is stated (a new one must be documented).
    assert set(got) >= {
        "attach-timeout-s", "max-unattached", "max-jobs-per-uid", "max-ranks-per-uid",
        "max-connections-per-uid", "max-handshakes-per-uid", "max-handshakes",
        "max-buffered-bytes-per-uid", "max-buffered-bytes",
        "max-pending-rendezvous", "max-rendezvous-wait-s", "max-op-streams",
    }  # fmt: skip


def test_stated_sizes_and_times_are_the_codes() -> None:
    cfg = DaemonConfig()
    assert stated(r"`SMDDP_ARENA_BYTES` \(default (\d+) MiB per rank and group") == [("64",)]
    assert client_communicator.DEFAULT_ARENA_BYTES == 64 * MIB
    assert (
        inspect.signature(connect).parameters["arena_bytes"].default is None
    )  # then the env or 64 MiB
    assert stated(r"`--gpu-chunk-bytes` \(`SMDDP_GPU_CHUNK_BYTES`, default (\d+) MiB\)") == [
        ("256",)
    ]
    assert cfg.gpu_chunk_bytes == 256 * MIB
    # The timeout: torch's default for a group, the daemon's for a client that sets none, and
    # the numpy client's.
    assert stated(r"`init_process_group\(timeout=...\)`, (\d+) minutes when unset") == [("30",)]
    assert torch.distributed.default_pg_timeout == timedelta(minutes=30)
    assert cfg.default_timeout_s == 30 * 60
    assert inspect.signature(connect).parameters["timeout_s"].default == 30 * 60
    # Heartbeats.
    assert stated(
        r"Heartbeats every (second) on the data connections detect a node that vanishes "
        r"within (\d+) s"
    ) == [("second", "5")]
    assert (peer_transport.HEARTBEAT_PERIOD_S, peer_transport.HEARTBEAT_TIMEOUT_S) == (1.0, 5.0)
    assert stated(r"jobs of up to (\d+) ranks; larger ones pass their layout themselves") == [
        ("200",)
    ]
    assert server_rendezvous.MAX_WORLD == 200
    assert stated(r"\(WatchdogSec=(\d+)s\)") == [("30",)]
    assert "WatchdogSec=30s" in UNIT.read_text().splitlines()
    assert stated(r"socket `(/run/smddp/smddpd\.sock)` is 0660") == [(SYSTEM_SOCKET,)]


def group_timeout(rank: int, init_file: str) -> float:
    """A torch rank that sets no timeout: the one its smddp group got."""
    import torch.distributed as dist

    import smddp  # noqa: F401  (registers the backend)

    dist.init_process_group("smddp", init_method=f"file://{init_file}", rank=rank, world_size=1)
    group = dist.group.WORLD  # smddp's creator returns the process group itself
    assert type(group).__name__ == "SmddpProcessGroup"
    timeout = group.comm.timeout_s
    dist.destroy_process_group()
    return timeout


@pytest.mark.timeout(120)
def test_a_group_without_a_timeout_gets_30_minutes(daemon, spawn_ranks, tmp_path: Path) -> None:
    env = dict(os.environ, SMDDP_SOCKET=daemon.socket, SMDDP_EMBEDDED="0")
    assert spawn_ranks(group_timeout, 1, str(tmp_path / "init"), env=env).join() == [1800.0]


# -- a daemon with metrics --------------------------------------------------------------------


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def samples(port: int, name: str) -> dict[frozenset, float]:
    """The series of metric ``name`` (a sample name, e.g. ``smddp_errors_total``) by labels."""
    code, text = http_get(port, "/metrics")
    assert code == 200, text
    return {
        frozenset(s.labels.items()): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    }


def metered(start_daemon, name: str = "smddpd", args: tuple[str, ...] = ()) -> tuple[Any, int]:
    d = start_daemon(args=("--http-bind", "127.0.0.1:0", *args), name=name)
    return d, d.http_port()


def job() -> tuple[str, bytes]:
    return f"readme-{secrets.token_hex(4)}", secrets.token_bytes(16)


def wait_for(socket_path: str, what: str, check) -> Any:
    """Polls the daemon's Status until ``check(comms)`` gives something true; returns it."""
    with grpc.insecure_channel("unix:" + socket_path) as channel:
        stub = pb_grpc.NodeStub(channel)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            found = check(stub.Status(pb.StatusRequest(), timeout=10).comms)
            if found:
                return found
            time.sleep(0.02)
    pytest.fail(f"the daemon never showed {what}")


def pending_in(job_id: str):
    return lambda comms: any(c.job_id == job_id and c.pending for c in comms)


@pytest.mark.timeout(180)
def test_errors_total_counts_each_kind_once(start_daemon) -> None:
    d, port = metered(start_daemon)

    def errors() -> dict[str, float]:
        return {
            dict(labels)["kind"]: v for labels, v in samples(port, "smddp_errors_total").items()
        }

    counts = dict.fromkeys(ERROR_KINDS, 0.0)
    assert errors() == counts  # every kind is there from the start, at zero

    def counted(kind: str) -> None:
        counts[kind] += 1
        assert errors() == counts, kind

    # invalid: a rank outside its world is refused at registration.
    name, token = job()
    with pytest.raises(ConnectError, match="rank 2 is outside a world of 2"):
        connect(name, token, 2, 2, socket_path=d.socket, arena_bytes=MIB)
    counted("invalid")

    # unauthenticated: a second rank of a job with another token.
    name, token = job()
    c0 = connect(name, token, 0, 2, socket_path=d.socket, arena_bytes=MIB)
    with pytest.raises(ConnectError, match="wrong job token"):
        connect(name, secrets.token_bytes(16), 1, 2, socket_path=d.socket, arena_bytes=MIB)
    counted("unauthenticated")
    c0.close()

    # mismatch: two ranks call different collectives as op #1; one count for the group.
    name, token = job()
    c0, c1 = (connect(name, token, r, 2, socket_path=d.socket, arena_bytes=MIB) for r in range(2))
    h0, h1 = c0.all_reduce(np.ones(8, np.float32)), c1.broadcast(np.ones(8, np.float32), root=0)
    for h in (h0, h1):
        with pytest.raises(SmddpError, match="rank 1 called broadcast"):
            h.wait()
    # The ranks find the mismatch among themselves (in their shared control region); the daemon
    # fails the group when its watchdog next looks, and counts it then.
    wait_for(
        d.socket,
        "the group failed",
        lambda comms: any(c.job_id == name and c.failed for c in comms),
    )
    counted("mismatch")
    # Later ops of the failed group fail with the same cause and are not counted again.
    with pytest.raises(SmddpError, match="rank 1 called broadcast"):
        c0.all_reduce(np.ones(8, np.float32)).wait()
    assert errors() == counts
    c0.close()
    c1.close()

    # rank_failed: a rank leaves while the other waits in an op.
    name, token = job()
    c0, c1 = (connect(name, token, r, 2, socket_path=d.socket, arena_bytes=MIB) for r in range(2))
    waiting = c0.all_reduce(np.ones(8, np.float32))
    wait_for(d.socket, "rank 0's all_reduce", pending_in(name))
    c1.close()
    with pytest.raises(SmddpError, match="rank 1"):
        waiting.wait()
    counted("rank_failed")
    c0.close()

    # timeout: the other rank never arrives.
    name, token = job()
    c0, c1 = (
        connect(name, token, r, 2, socket_path=d.socket, arena_bytes=MIB, timeout_s=0.5)
        for r in range(2)
    )
    with pytest.raises(SmddpError, match="rank 1 never arrived"):
        c0.all_reduce(np.ones(8, np.float32)).wait()
    counted("timeout")
    c0.close()
    c1.close()

    # aborted: another node of the job aborts the group without a cause of its own kind
    # (smddp's daemons always send theirs; a peer may send none).
    name, token = job()
    nodes = [
        pb.NodeSpec(node_id="a", peer_address=daemon_info(d.socket).peer_address, ranks=[0, 1]),
        pb.NodeSpec(node_id="b", peer_address="127.0.0.1:9", ranks=[2]),
    ]
    c0, c1 = (
        connect(name, token, r, 3, socket_path=d.socket, arena_bytes=MIB, nodes=nodes, timeout_s=60)
        for r in range(2)
    )
    waiting = c0.all_reduce(np.ones(8, np.float32))
    wait_for(d.socket, "rank 0's all_reduce", pending_in(name))
    peer = pb.PeerRequest(job_id=name, comm_id="0", node=1, proof=token_proof(token, name, "0"))
    with grpc.insecure_channel(daemon_info(d.socket).peer_address) as channel:
        pb_grpc.PeerStub(channel).Abort(
            pb.AbortRequest(peer=peer, kind=pb.ABORTED, message="node b gave up"), timeout=10
        )
    with pytest.raises(SmddpError, match="^node b gave up$"):
        waiting.wait()
    counted("aborted")
    c0.close()
    c1.close()

    # shutdown: the daemon stops while an op waits. An open health Watch (an RPC in flight,
    # which the daemon's grace period waits for) keeps /metrics up while it drains.
    name, token = job()
    c0, c1 = (connect(name, token, r, 2, socket_path=d.socket, arena_bytes=MIB) for r in range(2))
    waiting = c0.all_reduce(np.ones(8, np.float32))
    wait_for(d.socket, "rank 0's all_reduce", pending_in(name))
    with grpc.insecure_channel("unix:" + d.socket) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=30
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        d.proc.send_signal(signal.SIGTERM)
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(SmddpError, match="shutting down"):
            waiting.wait()
        counted("shutdown")
        watch.cancel()
    c0.close()
    c1.close()
    assert d.stop() == 0, d.log()


def two_nodes(start_daemon) -> tuple[list[Any], list[int], list[pb.NodeSpec]]:
    daemons, ports = zip(
        *(metered(start_daemon, f"node{i}", ("--node-id", f"node{i}")) for i in range(2))
    )
    nodes = [
        pb.NodeSpec(node_id=f"node{i}", peer_address=daemon_info(d.socket).peer_address, ranks=[i])
        for i, d in enumerate(daemons)
    ]
    return list(daemons), list(ports), nodes


@pytest.mark.timeout(120)
def test_peer_bytes_count_the_data_exchanged_with_each_node(start_daemon) -> None:
    daemons, ports, nodes = two_nodes(start_daemon)
    name, token = job()
    comms = [
        connect(name, token, r, 2, socket_path=daemons[r].socket, nodes=nodes, arena_bytes=MIB)
        for r in range(2)
    ]
    # all_reduce of S bytes across 2 nodes: each node sends the other half of its partial sum
    # and then its reduced half, S in all, and receives as much (README, "Speed"). An odd
    # count splits unevenly; the sum is S either way.
    xs = [np.full(1001, r + 1, np.float32) for r in range(2)]
    for h in [c.all_reduce(x) for c, x in zip(comms, xs)]:
        h.wait()
    assert all((x == 3).all() for x in xs)
    # broadcast from rank 1 (node1): node1 sends the tensor once, node0 receives it.
    ys = [np.arange(300, dtype=np.int64) * r for r in range(2)]
    for h in [c.broadcast(y, root=1) for c, y in zip(comms, ys)]:
        h.wait()
    assert (ys[0] == np.arange(300)).all()
    for h in [c.barrier() for c in comms]:  # a barrier moves no data bytes
        h.wait()

    all_reduce, broadcast = 1001 * 4, 300 * 8
    expected = {
        0: {"sent": all_reduce, "received": all_reduce + broadcast},
        1: {"sent": all_reduce + broadcast, "received": all_reduce},
    }
    for i in range(2):
        other = f"node{1 - i}"
        got = {
            way: samples(ports[i], f"smddp_peer_bytes_{way}_total") for way in ("sent", "received")
        }
        assert got == {
            way: {frozenset({("peer", other)}): float(n)} for way, n in expected[i].items()
        }, i
        assert samples(ports[i], "smddp_peer_connection_errors_total") == {}
    for c in comms:
        c.close()
    for d in daemons:
        assert d.stop() == 0, d.log()


@pytest.mark.timeout(120)
def test_a_node_that_never_answers_is_one_connection_error(start_daemon) -> None:
    d, port = metered(start_daemon, args=("--node-id", "node0"))
    name, token = job()
    nodes = [
        pb.NodeSpec(node_id="node0", peer_address=daemon_info(d.socket).peer_address, ranks=[0]),
        pb.NodeSpec(node_id="dead", peer_address="127.0.0.1:9", ranks=[1]),  # nothing listens
    ]
    c0 = connect(name, token, 0, 2, socket_path=d.socket, nodes=nodes, arena_bytes=MIB, timeout_s=2)
    # node0 is the lower node: it calls dead's Join until the group's timeout, then gives up.
    failed = wait_for(
        d.socket,
        "the group failed",
        lambda comms: [c.failed for c in comms if c.job_id == name and c.failed],
    )
    (message,) = failed
    assert re.fullmatch(
        rf"job {name} comm 0: lost node dead \(daemon at 127\.0\.0\.1:9\): "
        r"did not let this node join within 2 s "
        r"\(.*127\.0\.0\.1:9.*\)",
        message,
    ), message
    assert "Connection refused" in message, message
    assert samples(port, "smddp_peer_connection_errors_total") == {
        frozenset({("peer", "dead")}): 1.0
    }
    # The rank's op fails with the same message; no op was pending, so no error was counted.
    with pytest.raises(SmddpError) as info:
        c0.all_reduce(np.ones(4, np.float32)).wait()
    assert str(info.value) == message
    assert samples(port, "smddp_errors_total")[frozenset({("kind", "rank_failed")})] == 0
    c0.close()
    assert d.stop() == 0, d.log()


@pytest.mark.timeout(120)
def test_a_mismatch_across_nodes_is_counted_on_each_node(start_daemon) -> None:
    daemons, ports, nodes = two_nodes(start_daemon)
    name, token = job()
    comms = [
        connect(name, token, r, 2, socket_path=daemons[r].socket, nodes=nodes, arena_bytes=MIB)
        for r in range(2)
    ]
    # Each node's only rank arrived, so neither daemon holds the op as pending: the exchange
    # finds the mismatch while the op runs.
    # (Both nodes must need the other's data to see it: a broadcast's root node receives nothing.)
    handles = [
        comms[0].all_reduce(np.ones(8, np.float32)),
        comms[1].all_reduce(np.ones(8, np.float32), pb.MAX),
    ]
    messages = []
    for h in handles:
        with pytest.raises(SmddpError) as info:
            h.wait()
        messages.append(str(info.value))
    # Each node finds it in the other's data, and tells the other; a rank gets the view of the
    # node that failed the group first, which may be either (issue 15 report: across nodes,
    # a mismatch can give the ranks two messages, each exact).
    views = {
        f"job {name} comm 0: rank {them} (node node{them}) called all_reduce({theirs}, 8 x "
        "float32) as op #1 "
        f"while rank {me} (node node{me}) called all_reduce({mine}, 8 x float32)"
        for me, mine, them, theirs in ((0, "SUM", 1, "MAX"), (1, "MAX", 0, "SUM"))
    }
    assert set(messages) <= views, messages
    for port in ports:
        errors = {
            dict(labels)["kind"]: v for labels, v in samples(port, "smddp_errors_total").items()
        }
        assert errors == {**dict.fromkeys(ERROR_KINDS, 0.0), "mismatch": 1.0}, errors
    for c in comms:
        c.close()
    for d in daemons:
        assert d.stop() == 0, d.log()


@pytest.mark.timeout(120)
def test_a_hung_node_is_named_by_the_heartbeat(start_daemon) -> None:
    daemons, ports, nodes = two_nodes(start_daemon)
    name, token = job()
    comms = [
        connect(name, token, r, 2, socket_path=daemons[r].socket, nodes=nodes, arena_bytes=MIB)
        for r in range(2)
    ]
    for h in [c.all_reduce(np.ones(16, np.float32)) for c in comms]:
        h.wait()  # the data connections are up
    procstate.stop(daemons[1].proc.pid)  # hung: its connections stay open, silent
    try:
        stopped = time.monotonic()
        with pytest.raises(SmddpError) as info:
            comms[0].all_reduce(np.ones(16, np.float32)).wait()
        took = time.monotonic() - stopped
    finally:
        daemons[1].proc.send_signal(signal.SIGCONT)
    assert str(info.value) == (
        f"job {name} comm 0: lost node node1 (daemon at {nodes[1].peer_address}): silent for 5 s "
        "(no heartbeat: partitioned or hung)"
    )
    assert 4.0 < took < 10.0, took  # README: about 5 s later (under 10 s tested)
    # Each of node0's connections to node1 fell silent; the peer is counted once.
    assert samples(ports[0], "smddp_peer_connection_errors_total") == {
        frozenset({("peer", "node1")}): 1.0
    }
    for c in comms:
        c.close()
    for d in daemons:
        assert d.stop() == 0, d.log()


# -- refusals the README states ---------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["flags", "environment"])
def test_ucx_with_tls_is_refused_at_start(tmp_path: Path, how: str) -> None:
    tls = [
        "--tls-cert",
        str(tmp_path / "c.pem"),
        "--tls-key",
        str(tmp_path / "k.pem"),
        "--tls-ca",
        str(tmp_path / "ca.pem"),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMDDP_")}
    args = ["--peer-transport", "ucx"]
    if how == "environment":  # as an embedded daemon reads it from the job's environment
        env["SMDDP_PEER_TRANSPORT"] = "ucx"
        args = []
    sock = tmp_path / "ucx.sock"
    proc = subprocess.run(
        [sys.executable, "-m", "smddp.server", "--socket", str(sock), "--http-bind", "off",
         *args, *tls],
        env=env, capture_output=True, text=True, timeout=50, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "smddpd: error: peer_transport ucx carries no TLS: use tcp with --tls-cert, or ucx on a "
        "trusted "
        "network without it"
    )
    assert not sock.exists()


@pytest.mark.timeout(90)
def test_readyz_is_503_while_the_daemon_is_full(
    start_daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SMDDP_ARENA_BYTES", raising=False)
    d, port = metered(start_daemon, args=("--max-jobs", "1"))
    assert http_get(port, "/readyz") == (200, "ready\n")
    name, token = job()
    c = connect(name, token, 0, 1, socket_path=d.socket)  # the default arena
    assert samples(port, "smddp_shm_bytes") == {frozenset(): float(64 * MIB)}
    assert http_get(port, "/readyz") == (503, "serving the maximum of 1 jobs (--max-jobs)\n")
    assert http_get(port, "/healthz") == (200, "ok\n")  # full, not unwell
    other, other_token = job()
    with pytest.raises(ConnectError) as info:
        connect(other, other_token, 0, 1, socket_path=d.socket, arena_bytes=MIB)
    assert str(info.value).endswith(
        f"job {other} comm 0: the daemon already serves 1 jobs (--max-jobs)"
    ), info.value
    c.close()
    # The daemon notices the job's last rank leaving on its own connection thread.
    deadline = time.monotonic() + 10
    while http_get(port, "/readyz") != (200, "ready\n") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert http_get(port, "/readyz") == (200, "ready\n")
    assert d.stop() == 0, d.log()


@pytest.mark.timeout(180)
def test_the_daemons_rendezvous_takes_up_to_200_ranks(start_daemon) -> None:
    daemons = [start_daemon(args=("--node-id", f"node{i}"), name=f"node{i}") for i in range(2)]
    root, other = (daemon_info(d.socket).peer_address for d in daemons)
    name, token = job()
    with pytest.raises(ConnectError) as info:
        rendezvous(name, token, 0, 201, root=root, socket_path=daemons[1].socket, timeout_s=10)
    assert str(info.value).endswith(
        f"rendezvous of job {name}: the daemons' rendezvous serves jobs of up to 200 ranks; a "
        "larger job "
        "passes its node layout to Register itself (as torch jobs do from their store)"
    ), info.value

    # 200 ranks, alternating between the two nodes, all waiting at the root at once.
    results: dict[int, Any] = {}

    def meet(rank: int) -> None:
        try:
            results[rank] = rendezvous(
                name,
                token,
                rank,
                200,
                root=root,
                socket_path=daemons[rank % 2].socket,
                timeout_s=120,
            )
        except ConnectError as exc:
            results[rank] = exc

    threads = [threading.Thread(target=meet, args=(r,)) for r in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    layouts = {
        r: [(n.node_id, n.peer_address, list(n.ranks)) for n in v]
        for r, v in results.items()
        if isinstance(v, list)
    }
    assert len(results) == 200 and len(layouts) == 200, {
        r: v for r, v in results.items() if r not in layouts
    }
    want = [("node0", root, list(range(0, 200, 2))), ("node1", other, list(range(1, 200, 2)))]
    assert all(v == want for v in layouts.values()), layouts[0]
    for d in daemons:
        assert d.stop() == 0, d.log()


# -- where daemons and clients find each other (root, a mount namespace of its own) -----------

# Runs inside ``unshare --mount`` with fresh tmpfs on /run and /tmp, so the system socket and
# the per-user folders are this test's alone. Prints one JSON object of what it saw.
FIND = r"""
import ctypes, json, os, signal, stat, subprocess, sys, textwrap, time
import grpc
from smddp.client import connect
from smddp.client.embedded import daemon_answers, find_or_start_daemon
from smddp.client.errors import ConnectError
from smddp.v1 import smddp_pb2 as pb, smddp_pb2_grpc as pb_grpc

PY = sys.executable
seen = {}
base_env = {k: v for k, v in os.environ.items() if not k.startswith("SMDDP_") and k != "XDG_RUNTIME_DIR"}

started = []  # every daemon's pid, killed at the end if an assertion left it running

def start(*args):
    proc = subprocess.Popen([PY, "-m", "smddp.server", "--http-bind", "off", "--peer-bind", "off", *args],
                            env=base_env, cwd="/", stdout=subprocess.DEVNULL, stderr=sys.stderr)
    started.append(proc.pid)
    return proc

def serving(path, proc):
    deadline = time.monotonic() + 60
    while not daemon_answers(path):
        assert proc.poll() is None, f"smddpd exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"nothing serves on {path}"
        time.sleep(0.05)
    return path

def jobs_at(path):
    with grpc.insecure_channel("unix:" + path) as ch:
        return sorted(c.job_id for c in pb_grpc.NodeStub(ch).Status(pb.StatusRequest(), timeout=10).comms)

def stop(proc):
    proc.send_signal(signal.SIGTERM)
    return proc.wait(30)

def as_nobody(code, env):
    p = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", PY, "-c", textwrap.dedent(code)],
                       env=env, cwd="/", capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)

def main():
    os.environ.clear(); os.environ.update(base_env)
    # 1. Root's daemon without --socket takes the system socket; a client without SMDDP_SOCKET finds
    # it.
    system = start()
    serving("/run/smddp/smddpd.sock", system)
    st = os.stat("/run/smddp/smddpd.sock")
    seen["system"] = {"mode": oct(stat.S_IMODE(st.st_mode)), "folder": oct(stat.S_IMODE(os.stat("/run/smddp").st_mode))}
    os.environ["SMDDP_EMBEDDED"] = "0"
    seen["found"] = find_or_start_daemon()
    c = connect("sysjob", b"t" * 16, 0, 1, arena_bytes=1 << 20)
    seen["sysjob_at"] = jobs_at("/run/smddp/smddpd.sock")
    c.close()
    # 2. SMDDP_SOCKET wins over a system daemon that answers.
    other = start("--socket", "/tmp/other/smddpd.sock")
    serving("/tmp/other/smddpd.sock", other)
    os.environ["SMDDP_SOCKET"] = "/tmp/other/smddpd.sock"
    seen["found_with_env"] = find_or_start_daemon()
    c = connect("envjob", b"t" * 16, 0, 1, arena_bytes=1 << 20)
    seen["envjob_at"] = {"other": jobs_at("/tmp/other/smddpd.sock"), "system": jobs_at("/run/smddp/smddpd.sock")}
    c.close()
    seen["stopped"] = [stop(system), stop(other)]
    del os.environ["SMDDP_SOCKET"]
    # 3. Another user may not create /run/smddp: its daemon and clients use its own folders.
    NOBODY = '''
    import json, os, signal, subprocess, sys, time
    from smddp.client.embedded import daemon_answers, find_or_start_daemon
    from smddp.core.wire import default_socket_path
    path = default_socket_path()
    d = subprocess.Popen([sys.executable, "-m", "smddp.server", "--http-bind", "off", "--peer-bind", "off"], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not daemon_answers(path):
        assert d.poll() is None and time.monotonic() < deadline, path
        time.sleep(0.05)
    found = find_or_start_daemon()
    d.send_signal(signal.SIGTERM)
    print(json.dumps({"listens": path, "found": found, "exit": d.wait(30), "folder": oct(os.stat(os.path.dirname(path)).st_mode & 0o777)}))
    '''
    nobody_env = {**base_env, "SMDDP_EMBEDDED": "0"}
    seen["nobody_tmp"] = as_nobody(NOBODY, nobody_env)
    os.makedirs("/run/user/65534", mode=0o700)
    os.chown("/run/user/65534", 65534, 65534)
    seen["nobody_xdg"] = as_nobody(NOBODY, {**nobody_env, "XDG_RUNTIME_DIR": "/run/user/65534"})
    # 4. No daemon answers and SMDDP_EMBEDDED=0: the job fails, saying where it looked.
    try:
        find_or_start_daemon()
    except ConnectError as exc:
        seen["forbidden"] = str(exc)
    # 5. No daemon answers: a torch job starts its own; it exits when the job ends. This process
    # adopts the orphaned daemon (a subreaper) to see it exit.
    del os.environ["SMDDP_EMBEDDED"]
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    JOB = '''
    import json, os, stat, torch, torch.distributed as dist
    import smddp, smddp.backend
    dist.init_process_group("smddp", init_method="file:///tmp/init", rank=0, world_size=1)
    t = torch.ones(4)
    dist.all_reduce(t)
    path = smddp.backend._job.socket_path
    st = os.stat(os.path.dirname(path))
    print(json.dumps({"socket": path, "folder_mode": oct(stat.S_IMODE(st.st_mode)), "folder_uid": st.st_uid, "sum": t.tolist()}))
    dist.destroy_process_group()
    '''
    # Files, not pipes: the daemon inherits the job's stdout and stderr and outlives it a little.
    with open("/tmp/job.out", "w") as out, open("/tmp/job.err", "w") as err:
        rc = subprocess.Popen([PY, "-c", textwrap.dedent(JOB)], env=dict(os.environ), cwd="/tmp", stdout=out, stderr=err).wait(180)
    ended = time.monotonic()
    job_err = open("/tmp/job.err").read()
    assert rc == 0, job_err
    seen["job"] = json.loads(open("/tmp/job.out").read())
    seen["job_log"] = [line for line in job_err.splitlines() if "embedded" in line]
    pid = int(seen["job_log"][0].rpartition("(pid ")[2].rstrip(")"))
    started.append(pid)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        assert time.monotonic() - ended < 60, "the embedded daemon outlived its job by 60 s"
        time.sleep(0.05)
    seen["embedded_exit"] = {"status": os.waitstatus_to_exitcode(status), "after_s": time.monotonic() - ended,
                             "folder_left": os.path.exists(os.path.dirname(seen["job"]["socket"]))}
    print(json.dumps(seen))

try:
    main()
finally:
    for pid in started:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
"""


@pytest.mark.timeout(300)
def test_where_daemons_and_clients_find_each_other() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: a mount namespace with its own /run, and a daemon of uid 65534")
    for tool in ("unshare", "setpriv"):
        assert shutil.which(tool), f"{tool} (util-linux) is missing"
    # A fresh /run and /tmp; a checkout or interpreter that lives under /tmp is bound back
    # into the fresh one (else the new /tmp would hide the very Python that runs the test).
    keep = sorted({
        os.path.relpath(d, "/tmp")
        for d in (str(Path(__file__).resolve().parents[2]), os.path.realpath(sys.prefix))
        if d.startswith("/tmp/")
    })  # fmt: skip
    script = (
        "mount -t tmpfs -o mode=0755 tmpfs /run && mkdir /run/host-tmp && mount --bind /tmp "
        "/run/host-tmp "
        "&& mount -t tmpfs -o mode=1777 tmpfs /tmp "
        '&& for d in $KEEP; do mkdir -p "/tmp/$d" && mount --bind "/run/host-tmp/$d" "/tmp/$d" || '
        "exit 1; done "
        '&& umount /run/host-tmp && rmdir /run/host-tmp && exec "$@"'
    )
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
         sys.executable, "-c", FIND],
        capture_output=True, text=True, timeout=280, check=False, cwd="/",
        env=dict(os.environ, KEEP=" ".join(keep)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = json.loads(proc.stdout.splitlines()[-1])

    # The system socket, 0600 in a 0700 folder without --socket-group (test_security: the modes).
    assert seen["system"] == {"mode": "0o600", "folder": "0o700"}
    assert seen["found"] == SYSTEM_SOCKET and seen["sysjob_at"] == ["sysjob"]
    assert seen["found_with_env"] == "/tmp/other/smddpd.sock"
    assert seen["envjob_at"] == {"other": ["envjob"], "system": []}
    assert seen["stopped"] == [0, 0]
    # Not root: $XDG_RUNTIME_DIR/smddp, else /tmp/smddp-<uid>, for daemon and client alike.
    assert seen["nobody_tmp"] == {
        "listens": "/tmp/smddp-65534/smddpd.sock", "found": "/tmp/smddp-65534/smddpd.sock",
        "exit": 0, "folder": "0o700",
    }  # fmt: skip
    assert seen["nobody_xdg"] == {
        "listens": "/run/user/65534/smddp/smddpd.sock",
        "found": "/run/user/65534/smddp/smddpd.sock", "exit": 0, "folder": "0o700",
    }  # fmt: skip
    assert seen["forbidden"] == (
        "no smddpd answers at /run/smddp/smddpd.sock, /tmp/smddp-0/smddpd.sock and "
        "SMDDP_EMBEDDED=0 forbids "
        "starting one"
    )
    # The embedded daemon: its socket in a 0700 temporary folder, said once in the log, gone
    # (folder too) once the job has ended.
    socket_path = seen["job"]["socket"]
    assert re.fullmatch(r"/tmp/smddp-job-[^/]+/smddpd\.sock", socket_path), seen["job"]
    assert (seen["job"]["folder_mode"], seen["job"]["folder_uid"], seen["job"]["sum"]) == (
        "0o700",
        0,
        [1.0] * 4,
    )
    (line,) = seen["job_log"]
    assert re.fullmatch(
        rf"smddp: no smddpd answers at /run/smddp/smddpd\.sock, /tmp/smddp-0/smddpd\.sock; "
        rf"started an embedded "
        rf"daemon for this job on {re.escape(socket_path)} \(pid \d+\)",
        line,
    ), line
    assert seen["embedded_exit"]["status"] == 0, seen["embedded_exit"]
    assert seen["embedded_exit"]["folder_left"] is False, seen["embedded_exit"]
    print(f"\nthe embedded daemon exited {seen['embedded_exit']['after_s']:.1f} s after its job")
