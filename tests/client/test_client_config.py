"""ClientConfig: every SMDDP_* variable the client reads, read in one place."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from smddp.client.config import (
    DEFAULT_ARENA_BYTES,
    DEFAULT_DIRECT_CHUNK_BYTES,
    DEFAULT_DIRECT_MIN_BYTES,
    SHARED_CORES_DIRECT_CHUNK_BYTES,
    ClientConfig,
)

pytestmark = pytest.mark.timeout(30)


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
