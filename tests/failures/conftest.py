"""Fixtures of the failure tests: a system daemon whose socket the test knows, rank
environments, ``smddpctl status --json``, and the multi-node fixtures reused from
``tests/multinode/conftest.py`` (``loopback_nodes``, ``netns_nodes``, ``netns_cluster``,
``launch_world``), loaded here under a name of their own.

- ``system_daemon``: an smddpd on a private socket, as a system daemon would be (the ranks
  find it through SMDDP_SOCKET and never start an embedded one); SIGTERM at the end must
  make it exit 0.
- ``rank_env(socket, node_id)``: the environment of a rank that uses that daemon.
- ``ctl_status(socket)``: what ``smddpctl status --json`` prints, parsed.
- ``launch_failure_world``: ``launch_world`` of the multi-node fixtures running
  ``failure_rank.py`` (programs ``until_failure``, ``until_stopped``) instead of theirs.
- ``loopback_daemons([args0, args1, ...])``: like ``loopback_nodes``, with extra daemon
  arguments per node (TLS certificates, say).
- ``module_daemon``: an smddpd on a private socket shared by a whole test module.
- ``daemon_at(socket, args=())``: an smddpd on a socket path of the test's choosing (the
  shared ``start_daemon`` picks its own), ready once health says SERVING; SIGTERM at the
  end must make it exit 0.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
NODE_ID = "node-a"  # SMDDP_NODE_ID of the single-node tests' ranks; messages name it


def _load(relative: str, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, REPO / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


shared = _load("tests/conftest.py", "smddp_tests_shared_fixtures")
multinode = _load("tests/multinode/conftest.py", "smddp_tests_multinode_fixtures")
loopback_nodes = multinode.loopback_nodes
netns_cluster = multinode.netns_cluster
netns_nodes = multinode.netns_nodes
peer_transport = multinode.peer_transport
launch_world = multinode.launch_world


def make_rank_env(socket_path: str, node_id: str = NODE_ID, **extra: str) -> dict[str, str]:
    """A rank's environment: the daemon at ``socket_path``, no embedded fallback."""
    env = dict(os.environ, SMDDP_SOCKET=socket_path, SMDDP_EMBEDDED="0", SMDDP_NODE_ID=node_id)
    # A rank that dies of a signal (SIGABRT, SIGSEGV) prints every thread's stack: a rare
    # crash in CI then says where it was.
    env["PYTHONFAULTHANDLER"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def smddpctl_status(socket_path: str) -> dict[str, Any]:
    """``SMDDP_SOCKET=socket_path smddpctl status --json``, parsed."""
    env = dict(os.environ, SMDDP_SOCKET=socket_path)
    proc = subprocess.run(
        [sys.executable, "-m", "smddp.server.ctl", "--json", "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, f"smddpctl status failed ({proc.returncode}): {proc.stderr}"
    return json.loads(proc.stdout)


@pytest.fixture
def launch_failure_world(
    launch_world: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Any]:
    """``launch_world`` with this folder's ``failure_rank.py`` as the ranks' program."""
    monkeypatch.setattr(multinode, "RANK_MAIN", HERE / "failure_rank.py")
    return launch_world


@pytest.fixture
def loopback_daemons(start_daemon: Callable[..., Any]) -> Iterator[Callable[..., list[Any]]]:
    """``loopback_daemons(per_node_args)``: one smddpd per entry, node ids ``node0..``."""
    started: list[Any] = []

    def start(per_node_args: list[tuple[str, ...]]) -> list[Any]:
        nodes = []
        for i, extra in enumerate(per_node_args):
            d = start_daemon(args=("--node-id", f"node{i}", *extra), name=f"node{i}")
            nodes.append(multinode.Node(f"node{i}", "127.0.0.1", [], d))
        started.extend(nodes)
        return nodes

    yield start
    multinode._stop_daemons(started)


@pytest.fixture
def rank_env() -> Callable[..., dict[str, str]]:
    """``rank_env(socket, node_id="node-a", **extra)``: a rank's environment."""
    return make_rank_env


@pytest.fixture
def ctl_status() -> Callable[[str], dict[str, Any]]:
    """``ctl_status(socket)``: ``smddpctl status --json`` against that daemon, parsed."""
    return smddpctl_status


@pytest.fixture
def daemon_at(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``daemon_at(socket, args=())``: starts smddpd on ``socket`` and waits for SERVING."""
    started: list[Any] = []

    def start(socket_path: str, args: tuple[str, ...] = (), name: str = "smddpd") -> Any:
        d = shared._launch(socket_path, args, shared.DAEMON_COMMAND, None, tmp_path / f"{name}.log")
        started.append(d)
        return d

    yield start
    bad = []
    for d in started:
        if d.proc.poll() is None:
            rc = d.stop(signal.SIGTERM)
            if rc != 0:
                bad.append(f"smddpd on {d.socket} exited {rc} after SIGTERM:\n{d.log()}")
        if d.proc.stdout is not None:
            d.proc.stdout.close()
    assert not bad, "\n".join(bad)


@pytest.fixture(scope="module")
def module_daemon() -> Iterator[Any]:
    """An smddpd on a private socket for a whole module; SIGTERM at the end must make it exit 0."""
    folder = Path(tempfile.mkdtemp(prefix="smddp-test-"))
    d = shared._launch(
        str(folder / "smddpd.sock"), (), shared.DAEMON_COMMAND, None, folder / "smddpd.log"
    )
    yield d
    try:
        if d.proc.poll() is None:
            rc = d.stop(signal.SIGTERM)
            assert rc == 0, f"smddpd exited with status {rc} after SIGTERM:\n{d.log()}"
    finally:
        if d.proc.stdout is not None:
            d.proc.stdout.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def system_daemon(start_daemon: Callable[..., Any]) -> Iterator[Any]:
    """An smddpd on a private socket that the ranks reach through SMDDP_SOCKET."""
    d = start_daemon(name="system")
    yield d
    if d.proc.poll() is None:
        rc = d.stop(signal.SIGTERM)
        assert rc == 0, f"smddpd exited with status {rc} after SIGTERM:\n{d.log()}"
