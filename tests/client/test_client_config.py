"""ClientConfig: every SMDDP_* variable the client and the backend read, read in one place.

The reading: ``from_env`` and the checks that no other module of client/ or backend/ reads
one, and that only the entry points build a config. The passing down: a config the caller
passes governs where the environment says otherwise (the C part, the socket, the embedded
daemon's address, the free hook), and the backend builds one per process group.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import secrets
import socket
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from smddp.client.config import (
    DEFAULT_ARENA_BYTES,
    DEFAULT_DIRECT_CHUNK_BYTES,
    DEFAULT_DIRECT_MIN_BYTES,
    DEFAULT_FREE_WAIT_MS,
    SHARED_CORES_DIRECT_CHUNK_BYTES,
    ClientConfig,
)

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]


def test_defaults_without_any_variable() -> None:
    config = ClientConfig.from_env({})
    assert config == ClientConfig()
    assert (config.socket, config.arena_bytes, config.direct_min_bytes) == (
        None,
        DEFAULT_ARENA_BYTES,
        DEFAULT_DIRECT_MIN_BYTES,
    )
    assert (config.region, config.op_channel, config.embedded) == (True, "socket", True)
    assert config.node_id == socket.gethostname()
    assert config.embedded_log_level == "WARNING"


def test_every_variable() -> None:
    config = ClientConfig.from_env(
        {
            "SMDDP_SOCKET": "/tmp/x.sock",
            "SMDDP_ARENA_BYTES": "1048576",
            "SMDDP_DIRECT_MIN_BYTES": "4096",
            "SMDDP_DIRECT_CHUNK_BYTES": "8192",
            "SMDDP_REGION": "0",
            "SMDDP_OP_CHANNEL": "grpc",
            "SMDDP_NODE_ID": "node-7",
            "SMDDP_EMBEDDED": "0",
            "SMDDP_EMBEDDED_LOG_LEVEL": "DEBUG",
        }
    )
    assert config == ClientConfig(
        socket="/tmp/x.sock",
        arena_bytes=1 << 20,
        direct_min_bytes=4096,
        direct_chunk_bytes=8192,
        region=False,
        op_channel="grpc",
        node_id="node-7",
        embedded=False,
        embedded_log_level="DEBUG",
    )
    # Empty values mean "not set", as they did where each module read its own.
    assert ClientConfig.from_env({"SMDDP_SOCKET": "", "SMDDP_NODE_ID": ""}) == ClientConfig()


def test_a_bad_number_is_an_error_and_the_config_is_frozen() -> None:
    with pytest.raises(ValueError):
        ClientConfig.from_env({"SMDDP_ARENA_BYTES": "lots"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        ClientConfig().arena_bytes = 1  # type: ignore[misc]


def test_the_direct_chunk_is_the_default_or_the_setting_in_whole_alignments() -> None:
    assert ClientConfig().direct_chunk(64) == DEFAULT_DIRECT_CHUNK_BYTES
    assert ClientConfig(direct_chunk_bytes=1).direct_chunk(64) == 64  # at least ALIGN
    assert ClientConfig(direct_chunk_bytes=4096).direct_chunk(64) == 4096
    assert ClientConfig(direct_chunk_bytes=4100).direct_chunk(64) == 4096
    assert ClientConfig.from_env({"SMDDP_DIRECT_CHUNK_BYTES": "65536"}).direct_chunk(64) == 65536


def test_ranks_that_share_cpus_take_larger_chunks_unless_told() -> None:
    assert ClientConfig().direct_chunk(64, ranks=4, cpus=4) == DEFAULT_DIRECT_CHUNK_BYTES
    assert ClientConfig().direct_chunk(64, ranks=4, cpus=2) == SHARED_CORES_DIRECT_CHUNK_BYTES
    assert ClientConfig(direct_chunk_bytes=4096).direct_chunk(64, ranks=4, cpus=2) == 4096


def test_the_native_advertise_and_free_hook_variables() -> None:
    config = ClientConfig.from_env(
        {
            "SMDDP_NATIVE": "0",
            "SMDDP_ADVERTISE": "10.0.0.7",
            "SMDDP_FREE_HOOK": "0",
            "SMDDP_FREE_WAIT_MS": "1500",
        }
    )
    assert (config.native, config.advertise, config.free_hook, config.free_wait_ms) == (
        False,
        "10.0.0.7",
        False,
        1500,
    )
    defaults = ClientConfig.from_env({"SMDDP_ADVERTISE": ""})
    assert (defaults.native, defaults.advertise, defaults.free_hook) == (True, None, True)
    assert defaults.free_wait_ms == DEFAULT_FREE_WAIT_MS
    # As where cuda_free_hook read it: a bad or non-positive wait is the default, or 1 ms.
    assert ClientConfig.from_env({"SMDDP_FREE_WAIT_MS": "soon"}).free_wait_ms == 2000
    assert ClientConfig.from_env({"SMDDP_FREE_WAIT_MS": "-3"}).free_wait_ms == 1


# -- who reads the environment ------------------------------------------------------------------

# SMDDP_* variables read outside client/config.py, each with why (client/config.py's docstring
# names it): none since the rank's test device is given to backend.cuda.use_device() instead of
# named by SMDDP_TEST_CUDA_DEVICE.
OUTSIDE_CONFIG: set[tuple[str, str]] = set()
# Where a ClientConfig may be built from the environment: the entry points a user calls
# (connect, rendezvous, find_or_start_daemon, start_embedded_daemon) and the backend's
# creators of a process group (torch's, and torchft's ProcessGroupSmddp on each quorum).
# Everything they call takes the config they built.
ENTRY_POINTS = {
    ("backend/__init__.py", "_create"),
    ("backend/grow.py", "join"),
    ("backend/torchft.py", "_create_pg"),
    ("client/communicator.py", "connect"),
    ("client/discovery.py", "rendezvous"),
    ("client/embedded.py", "find_or_start_daemon"),
    ("client/embedded.py", "start_embedded_daemon"),
}


def _product_modules() -> list[tuple[str, ast.Module]]:
    return [
        (str(path.relative_to(REPO)), ast.parse(path.read_text(), str(path)))
        for folder in ("client", "backend")
        for path in sorted((REPO / folder).rglob("*.py"))
    ]


def _string_constants() -> dict[str, set[str]]:
    """Every module-level ``NAME = "text"`` of client/, backend/ and core/, by name: what a
    key like ``ENV_NATIVE`` stands for, wherever it was imported from."""
    table: dict[str, set[str]] = {}
    for folder in ("client", "backend", "core"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.parse(path.read_text()).body:
                targets: list[ast.expr] = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, ast.AnnAssign) and node.value is not None:
                    targets = [node.target]
                value = getattr(node, "value", None)
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    for t in targets:
                        if isinstance(t, ast.Name):
                            table.setdefault(t.id, set()).add(value.value)
    return table


def _keys(node: ast.AST, constants: dict[str, set[str]]) -> set[str]:
    """The strings an expression used as a variable's name may be."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Name):
        return constants.get(node.id, set())
    if isinstance(node, ast.Attribute):
        return constants.get(node.attr, set())
    return set()


def test_no_module_but_client_config_reads_an_smddp_variable() -> None:
    # Any lookup by an SMDDP_* name counts (os.environ.get, os.getenv, os.environ[...],
    # "... in os.environ", a copy's .get): a module holding its own copy of the environment
    # reads it all the same.
    constants = _string_constants()
    found = set()
    where = []
    for rel, tree in _product_modules():
        if rel == "client/config.py":
            continue
        for node in ast.walk(tree):
            key: ast.AST | None = None
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name in ("get", "getenv", "setdefault"):
                    key = node.args[0]
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                key = node.slice
            elif isinstance(node, ast.Compare) and any(
                isinstance(op, (ast.In, ast.NotIn)) for op in node.ops
            ):
                key = node.left
            for name in _keys(key, constants) if key is not None else ():
                if name.startswith("SMDDP_") and (rel, name) not in OUTSIDE_CONFIG:
                    found.add((rel, name))
                    where.append(f"{rel}:{node.lineno} reads {name}")
    assert not where, "\n".join(where)
    # The exception is documented where the rule is.
    doc = ast.get_docstring(dict(_product_modules())["client/config.py"]) or ""
    for _, name in OUTSIDE_CONFIG:
        assert name in doc


def test_only_the_entry_points_build_a_config_from_the_environment() -> None:
    builders = set()
    for rel, tree in _product_modules():
        if rel == "client/config.py":
            continue
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_env"
                ):
                    builders.add((rel, fn.name))
    assert builders == ENTRY_POINTS


# -- a config the caller passes governs --------------------------------------------------------


def native_worker(
    rank: int, world: int, socket_path: str, job: str, token: bytes, native: bool
) -> dict[str, Any]:
    """Connects with ``native`` in the config, whatever SMDDP_NATIVE and SMDDP_SOCKET say;
    runs a small all_reduce (the region) and a large one (direct); says which side ran."""
    from smddp.client import connect, region_ops

    calls = []
    real = region_ops.native_reduce

    def spy(out: np.ndarray, ins: list[np.ndarray], average: bool) -> bool:
        calls.append(out.nbytes)
        return real(out, ins, average)

    region_ops.native_reduce = spy  # what the rank-order reductions call for the C part
    config = dataclasses.replace(ClientConfig.from_env(), socket=socket_path, native=native)
    comm = connect(job, token, rank, world, config=config)
    try:
        small = np.arange(100, dtype=np.float32) + rank
        comm.all_reduce(small).wait()
        large = np.arange(1 << 20, dtype=np.float32) + rank
        comm.all_reduce(large).wait()
        ok = bool(
            np.array_equal(small, np.arange(100, dtype=np.float32) * world + world - 1)
            and np.array_equal(large, np.arange(1 << 20, dtype=np.float32) * world + world - 1)
        )
        return {
            "ok": ok,
            "slot_in_c": comm._region.shm.native is not None,
            "reduced_in_c": len(calls),
        }
    finally:
        comm.close()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("native", [False, True])
def test_the_config_passed_to_connect_governs_over_the_environment(
    daemon, spawn_ranks, native: bool
) -> None:
    # The environment says the opposite of the config, and names no daemon that exists.
    env = dict(os.environ, SMDDP_NATIVE="0" if native else "1", SMDDP_SOCKET="/nonexistent.sock")
    ranks = spawn_ranks(
        native_worker, 2, 2, daemon.socket, f"cfg-{secrets.token_hex(4)}", secrets.token_bytes(16),
        native, env=env, timeout_s=120,
    )  # fmt: skip
    results = ranks.join()
    assert all(r["ok"] for r in results), results
    assert all(r["slot_in_c"] == native for r in results), results
    if native:
        assert all(r["reduced_in_c"] > 0 for r in results), results
    else:
        assert all(r["reduced_in_c"] == 0 for r in results), results


def test_the_config_names_the_embedded_daemon_s_address_not_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from smddp.backend.job import peer_host

    monkeypatch.setenv("SMDDP_ADVERTISE", "10.9.9.9")
    assert peer_host(ClientConfig(advertise="10.1.2.3")) == "10.1.2.3"
    assert peer_host(ClientConfig.from_env()) == "10.9.9.9"


def test_the_config_turns_the_free_hook_off_whatever_the_environment_says(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from smddp.backend import cuda_free_hook
    from smddp.client.cuda_ipc import IpcExporter

    monkeypatch.setenv("SMDDP_FREE_HOOK", "1")
    monkeypatch.setattr(cuda_free_hook, "_tried", False)
    monkeypatch.setattr(cuda_free_hook, "_channel", None)
    loads = []

    def library() -> Any:
        loads.append(1)
        raise AssertionError("the hook is off: nothing is built or loaded")

    exporter = IpcExporter()
    with caplog.at_level("INFO", logger="smddp.backend.cuda_free_hook"):
        got = cuda_free_hook.install(
            object(),  # type: ignore[arg-type]
            exporter,
            ClientConfig(free_hook=False),
            library=library,
        )
    assert got is None and not loads and exporter.on_export is None
    assert "SMDDP_FREE_HOOK=0: GPU frees are reported to smddpd after the fact" in caplog.text


def test_the_backend_builds_one_config_per_group_and_uses_it_throughout(
    daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch's creator of a process group, called as torch calls it, on a world of one whose
    # daemon is the fixture's (SMDDP_SOCKET): one reading of the environment for the
    # rendezvous, the daemon's discovery and connect.
    import torch.distributed as dist

    import smddp.backend as backend
    from smddp.client import config as config_module

    monkeypatch.setenv("SMDDP_SOCKET", daemon.socket)
    monkeypatch.setenv("SMDDP_NATIVE", "0")
    monkeypatch.setenv("SMDDP_EMBEDDED", "0")  # the fixture's daemon or nothing
    monkeypatch.setattr(backend, "_job", None)
    built: list[ClientConfig] = []
    real = config_module.ClientConfig.from_env.__func__  # type: ignore[attr-defined]

    def counted(cls: type[ClientConfig], env: Any = None) -> ClientConfig:
        built.append(real(cls, env))
        return built[-1]

    monkeypatch.setattr(config_module.ClientConfig, "from_env", classmethod(counted))
    opts = SimpleNamespace(
        store=dist.HashStore(),
        group_rank=0,
        group_size=1,
        group_id="0",
        global_ranks_in_group=[0],
        timeout=timedelta(seconds=60),
    )
    pg = backend._create(opts, None)
    try:
        assert len(built) == 1, f"the environment was read {len(built)} times for one group"
        assert pg.comm.config is built[0] and built[0].native is False
        assert backend._job is not None and backend._job.socket_path == daemon.socket
    finally:
        pg.comm.close()
