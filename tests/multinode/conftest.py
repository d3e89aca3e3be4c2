"""Fixtures of the multi-node tests: nodes as daemons, and jobs whose ranks run on them.

- ``loopback_nodes(n)``: ``n`` smddpds on this host, each its own node (``--node-id``,
  peers on an ephemeral loopback port); needs no privileges.
- ``netns_nodes(n)``: ``n`` network namespaces joined by a bridge (``netns_cluster``), one
  smddpd inside each, listening for peers on the namespace's address; skipped when this
  process is not root, failed with ``ip``'s error when root cannot create namespaces. Everything is
  removed at teardown,
  also when the test fails.
- ``launch_world(program, nodes, node_of_rank, spec)``: one process per rank, started on its
  node (inside the namespace for netns nodes) with the ``env://`` variables, SMDDP_NODE_ID
  and SMDDP_SOCKET of its node, running ``rank_main.py PROGRAM``. ``join()`` returns the
  ranks' results or fails with every failed rank's traceback and the daemons' logs.

The daemons are stopped with SIGTERM at teardown and must exit 0.
"""

from __future__ import annotations

import json
import os
import pickle
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from netns_cluster import IFNAME, NetnsCluster, unavailable_reason  # noqa: E402  (after sys.path)
from ports import free_port  # noqa: E402

RANK_MAIN = HERE / "rank_main.py"
DAEMON = (sys.executable, "-m", "smddp.server")
FAILED_RANK_GRACE_S = 15.0
LOG_TAIL = 3000


@dataclass
class Node:
    """One node of a test job: its id, daemon and where its processes run.

    Attributes:
        node_id: SMDDP_NODE_ID of its ranks and the daemon's ``--node-id``.
        address: the node's IP address (127.0.0.1 on loopback).
        prefix: the command prefix that runs a program on the node (``ip netns exec NS``).
        daemon: its smddpd (``.socket``, ``.log()``), or None where the job brings its own.
    """

    node_id: str
    address: str
    prefix: list[str] = field(default_factory=list)
    daemon: Any = None


def _stop_daemons(nodes: Sequence[Node]) -> None:
    bad = []
    for node in nodes:
        if node.daemon is not None and node.daemon.proc.poll() is None:
            rc = node.daemon.stop(signal.SIGTERM)
            if rc != 0:
                bad.append(
                    f"smddpd of {node.node_id} exited {rc} after "
                    f"SIGTERM:\n{node.daemon.log()[-LOG_TAIL:]}"
                )
    assert not bad, "\n".join(bad)


@dataclass(frozen=True)
class Transport:
    """How the daemons of a test carry data between nodes: their flags and environment."""

    name: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


TRANSPORTS = {
    "tcp": Transport("tcp"),
    # UCX over its TCP transport: no RDMA device exists here.
    "ucx": Transport("ucx", ("--peer-transport", "ucx"), {"UCX_TLS": "tcp"}),
}
# In a namespace, UCX must not offer its peers a lane on the loopback device: 127.0.0.1 there is
# the namespace itself, and such a lane breaks or stays silent (seen: 1 run in 10 failed). A site
# sets UCX_NET_DEVICES to its data NICs for the same reason (README).
NETNS_UCX_ENV = {"UCX_NET_DEVICES": IFNAME}


@pytest.fixture(params=list(TRANSPORTS))
def peer_transport(request) -> Transport:
    """Each data transport in turn. ucxx is installed with the test extras (scripts/setup.sh),
    so where it does not import the ucx case fails with the import's error, never skips."""
    if request.param == "ucx":
        from smddp.server.ucx_transport import unavailable_reason

        reason = unavailable_reason()
        if reason is not None:
            pytest.fail(f"UCX transport: {reason}", pytrace=False)
    return TRANSPORTS[request.param]


@pytest.fixture
def loopback_nodes(start_daemon) -> Iterator[Callable[[int], list[Node]]]:
    """``loopback_nodes(n, args=(), env=None, command=DAEMON)``: ``n`` daemons on
    this host, node ids ``node0..``; ``args`` go to every daemon, ``env`` adds to their
    environment, ``command`` starts each (``start_daemon``'s)."""
    started: list[Node] = []

    def start(
        n: int,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        command: Sequence[str] = DAEMON,
    ) -> list[Node]:
        nodes = []
        for i in range(n):
            d = start_daemon(
                args=("--node-id", f"node{i}", *args),
                command=command,
                name=f"node{i}",
                env={**os.environ, **(env or {})},
            )
            nodes.append(Node(f"node{i}", "127.0.0.1", [], d))
        started.extend(nodes)
        return nodes

    yield start
    _stop_daemons(started)


_NETNS_PROBE: list[str | None] = []


def netns_skip_reason() -> str | None:
    """Why the netns tests cannot run here (probed once), or None.

    Only a process that is not root skips them (a developer's account; CI runs as root). As
    root, a namespace that cannot be made fails the test with ``ip``'s error.
    """
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run the netns tests as root"
    if not _NETNS_PROBE:
        _NETNS_PROBE.append(unavailable_reason())
    if _NETNS_PROBE[0] is not None:
        pytest.fail(f"running as root, yet {_NETNS_PROBE[0]}", pytrace=False)
    return None


@pytest.fixture
def netns_cluster() -> Iterator[Callable[[int], NetnsCluster]]:
    """``netns_cluster(n)``: ``n`` bridged namespaces, no daemons; removed at teardown."""
    reason = netns_skip_reason()
    if reason:
        pytest.skip(reason)
    clusters: list[NetnsCluster] = []

    def create(n: int) -> NetnsCluster:
        cluster = NetnsCluster(n)
        clusters.append(cluster)  # before create(): a half-built cluster is removed too
        cluster.create()
        return cluster

    yield create
    for cluster in clusters:
        cluster.destroy()
        assert not cluster.exists(), f"namespaces left behind: {cluster.exists()}"


@pytest.fixture
def netns_nodes(netns_cluster, start_daemon) -> Iterator[Callable[[int], list[Node]]]:
    """``netns_nodes(n, args=(), env=None)``: ``n`` namespaces with one smddpd each (peers on
    the namespace's address, ephemeral ports), node ids ``ns0..``; ``args`` go to every
    daemon, ``env`` adds to their environment."""
    started: list[Node] = []

    def start(n: int, args: Sequence[str] = (), env: dict[str, str] | None = None) -> list[Node]:
        cluster = netns_cluster(n)
        nodes = []
        for i, addr in enumerate(cluster.addresses):
            d = start_daemon(
                args=("--node-id", f"ns{i}", "--peer-bind", f"{addr}:0", *args),
                command=(*cluster.prefix(i), *DAEMON),
                name=f"ns{i}",
                env={**os.environ, **NETNS_UCX_ENV, **(env or {})},
            )
            nodes.append(Node(f"ns{i}", addr, cluster.prefix(i), d))
        started.extend(nodes)
        return nodes

    yield start
    _stop_daemons(started)  # runs before netns_cluster's teardown removes the namespaces


class World:
    """The rank processes of one job."""

    def __init__(
        self, procs: list[subprocess.Popen], folder: Path, nodes: Sequence[Node], timeout_s: float
    ) -> None:
        self.procs = procs
        self.folder = folder
        self.nodes = nodes
        self.deadline = time.monotonic() + timeout_s
        self._lines: list[list[str]] = [[] for _ in procs]
        self._cond = threading.Condition()
        for r, p in enumerate(procs):
            threading.Thread(target=self._pump, args=(r, p), daemon=True).start()

    def _pump(self, rank: int, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self._cond:
                self._lines[rank].append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._lines[rank].append("\0eof")
            self._cond.notify_all()

    def wait_for(self, marker: str) -> None:
        """Blocks until every rank has printed the line ``marker``."""
        while True:
            with self._cond:
                if all(marker in lines for lines in self._lines):
                    return
                ended = [
                    r
                    for r, lines in enumerate(self._lines)
                    if "\0eof" in lines and marker not in lines
                ]
                if not ended and time.monotonic() < self.deadline:
                    self._cond.wait(timeout=0.5)
                    continue
            self.kill()
            pytest.fail(
                f"ranks {ended or 'some'} did not print "
                f"{marker!r}:\n{self._failures(set(range(len(self.procs))))}"
            )

    def send(self, line: str) -> None:
        """Writes ``line`` to every rank's stdin."""
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(line + "\n")
            p.stdin.flush()

    def join(self) -> list[Any]:
        """Every rank's result, in rank order; fails the test with what went wrong otherwise.

        After the first rank fails, the others get FAILED_RANK_GRACE_S to fail too (smddp must
        not leave them hanging) before they are killed.
        """
        deadline = self.deadline
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                deadline = min(deadline, time.monotonic() + FAILED_RANK_GRACE_S)
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.kill()
        bad = {r for r, p in enumerate(self.procs) if p.returncode != 0}
        if bad:
            pytest.fail(self._failures(bad), pytrace=False)
        return [self._outcome(r)["result"] for r in range(len(self.procs))]

    def _outcome(self, rank: int) -> dict[str, Any]:
        path = self.folder / f"rank{rank}.out"
        if not path.exists():
            return {"error": "(no result file)"}
        with open(path, "rb") as f:
            return pickle.load(f)

    def _failures(self, ranks: set[int]) -> str:
        parts = []
        for r in sorted(ranks):
            rc = self.procs[r].returncode
            why = (
                "still running (killed)"
                if rc is None or rc == -signal.SIGKILL
                else f"exit status {rc}"
            )
            err = (self.folder / f"rank{r}.err").read_text(errors="replace")[-LOG_TAIL:]
            parts.append(
                f"--- rank {r}: {why}\n{self._outcome(r).get('error', '')}\n[stderr]\n{err}"
            )
        for node in self.nodes:
            if node.daemon is not None:
                parts.append(f"--- smddpd {node.node_id} log\n{node.daemon.log()[-LOG_TAIL:]}")
        return "\n".join(parts)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def launch_world(tmp_path: Path) -> Iterator[Callable[..., World]]:
    """``launch_world(program, nodes, node_of_rank, spec, env=None, timeout_s=120)``.

    Rank r runs on ``nodes[node_of_rank[r]]``; rank 0's node hosts the c10d store.
    ``spec`` (JSON) reaches every rank; ``env`` adds environment variables.
    """
    worlds: list[World] = []

    def launch(
        program: str,
        nodes: Sequence[Node],
        node_of_rank: Sequence[int],
        spec: dict[str, Any],
        env: dict[str, str] | None = None,
        timeout_s: float = 120.0,
    ) -> World:
        folder = tmp_path / f"world{len(worlds)}-{secrets.token_hex(2)}"
        folder.mkdir()
        spec = {**spec, "node_of_rank": list(node_of_rank), "barrier_dir": str(folder)}
        (folder / "spec.json").write_text(json.dumps(spec))
        master = nodes[node_of_rank[0]]
        # Below the ephemeral range, also in a namespace: its smddpd binds port 0 and connects
        # out there, from that range (CI saw EADDRINUSE on a port drawn from 20000-39999).
        port = free_port()
        world = len(node_of_rank)
        procs = []
        for rank, n in enumerate(node_of_rank):
            node = nodes[n]
            local = [r for r in range(rank) if node_of_rank[r] == n]
            rank_env = dict(os.environ)
            rank_env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(len(local)),
                MASTER_ADDR=master.address,
                MASTER_PORT=str(port),
                SMDDP_NODE_ID=node.node_id,
                SMDDP_EMBEDDED="0",
                PYTHONPATH=os.pathsep.join(
                    filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])
                ),
            )
            if node.daemon is not None:
                rank_env["SMDDP_SOCKET"] = node.daemon.socket
            rank_env.update(env or {})
            cmd = [
                *node.prefix,
                sys.executable,
                str(RANK_MAIN),
                program,
                str(folder / "spec.json"),
                str(folder / f"rank{rank}.out"),
            ]
            with open(folder / f"rank{rank}.err", "wb") as err:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=rank_env,
                        cwd=folder,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                    )
                )
        w = World(procs, folder, nodes, timeout_s)
        worlds.append(w)
        return w

    yield launch
    for w in worlds:
        w.kill()
