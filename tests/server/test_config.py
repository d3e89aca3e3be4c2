"""smddpd's configuration: flags > SMDDP_* environment > TOML file > defaults, and clear errors."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from smddp.core.wire import default_socket_path
from smddp.server import config
from smddp.server.config import DaemonConfig


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "smddpd.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.timeout(30)
def test_defaults_without_flags_env_or_file() -> None:
    # Every default, stated: a changed or added setting must change this list (and the README,
    # whose statements of these defaults tests/server/test_readme_claims.py checks).
    assert dataclasses.asdict(config.load([], {})) == {
        "socket": default_socket_path(),
        "socket_group": "",
        "grpc_bind": "",
        "http_bind": "127.0.0.1:9464",
        "peer_bind": "off",  # --data-port & co. given alone imply 0.0.0.0:7470
        "data_port": 7472,
        "peer_transport": "tcp",
        "ucx_port": 7473,
        "advertise": "",
        "node_id": socket.gethostname(),
        "log_level": "INFO",
        "log_format": "text",
        "owner_pid": 0,
        "launcher_pid": 0,
        "chunk_bytes": 4 << 20,
        "gpu_chunk_bytes": 256 << 20,
        "gpu_warm": "first-op",
        "default_timeout_s": 1800.0,
        "max_jobs": 64,
        "max_ranks_per_job": 4096,
        "max_arena_bytes": 16 << 30,
        "attach_timeout_s": 30.0,
        "max_unattached": 1024,
        "max_jobs_per_uid": 32,
        "max_ranks_per_uid": 1024,
        "max_connections_per_uid": 1024,
        "max_handshakes_per_uid": 16,
        "max_handshakes": 128,
        "max_buffered_bytes_per_uid": 512 << 20,
        "max_buffered_bytes": 2 << 30,
        "max_pending_rendezvous": 200,
        "max_peer_rendezvous": 16,
        "max_rendezvous_wait_s": 900.0,
        "max_op_streams": 256,
        "max_pending_ops": 4096,
        "tls_cert": "",
        "tls_key": "",
        "tls_ca": "",
        "admin_group": "",
        "metrics_job_labels": False,
        "algo": "",
    }


@pytest.mark.timeout(30)
def test_flag_beats_env_beats_file(tmp_path: Path) -> None:
    path = _toml(
        tmp_path, 'chunk_bytes = 1000\nlog_level = "ERROR"\nnode_id = "from-file"\nmax_jobs = 3\n'
    )
    env = {"SMDDP_CHUNK_BYTES": "2000", "SMDDP_LOG_LEVEL": "WARNING", "SMDDP_NODE_ID": "from-env"}
    argv = ["--config", path, "--chunk-bytes", "3000", "--log-level", "DEBUG"]

    only_file = config.load(["--config", path], {})
    assert (only_file.chunk_bytes, only_file.log_level, only_file.node_id, only_file.max_jobs) == (
        1000,
        "ERROR",
        "from-file",
        3,
    )
    env_over_file = config.load(["--config", path], env)
    assert (env_over_file.chunk_bytes, env_over_file.log_level, env_over_file.node_id) == (
        2000,
        "WARNING",
        "from-env",
    )
    assert env_over_file.max_jobs == 3  # set in the file only
    flags_over_env = config.load(argv, env)
    assert (flags_over_env.chunk_bytes, flags_over_env.log_level, flags_over_env.node_id) == (
        3000,
        "DEBUG",
        "from-env",
    )
    assert isinstance(flags_over_env.chunk_bytes, int)


@pytest.mark.timeout(30)
def test_config_file_named_by_env_and_dashed_keys(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'default-timeout-s = 12.5\nhttp-bind = "off"\n')
    cfg = config.load([], {"SMDDP_CONFIG": path})
    assert cfg.default_timeout_s == 12.5
    assert cfg.http_bind == "off"
    # A float setting accepts a TOML integer.
    assert (
        config.load(
            [], {"SMDDP_CONFIG": _toml(tmp_path, "default_timeout_s = 7\n")}
        ).default_timeout_s
        == 7.0
    )


@pytest.mark.timeout(30)
def test_unknown_key_in_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _toml(tmp_path, "chunk_bytes = 4096\nmax_jobz = 3\n")
    with pytest.raises(SystemExit) as info:
        config.load(["--config", path], {})
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "smddpd: error:" in err
    assert "max_jobz" in err and path in err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("text", "setting"),
    [
        ('max_jobs = "lots"\n', "max_jobs"),
        ("max_jobs = true\n", "max_jobs"),  # TOML booleans are not integers, whatever Python says
        ("chunk_bytes = 1.5\n", "chunk_bytes"),  # would silently become 1
        ('default_timeout_s = "soon"\n', "default_timeout_s"),
        ("default_timeout_s = false\n", "default_timeout_s"),
        ("node_id = 5\n", "node_id"),
        ('log_format = "xml"\n', "log_format"),
        ('log_level = "LOUD"\n', "log_level"),
    ],
)
def test_bad_type_in_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, setting: str
) -> None:
    with pytest.raises(SystemExit) as info:
        config.load(["--config", _toml(tmp_path, text)], {})
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "smddpd: error:" in err
    assert setting in err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("env", "argv", "setting"),
    [
        ({"SMDDP_MAX_JOBS": "many"}, [], "max_jobs"),
        ({"SMDDP_DEFAULT_TIMEOUT_S": "1h"}, [], "default_timeout_s"),
        ({"SMDDP_LOG_LEVEL": "chatty"}, [], "log_level"),
        ({}, ["--max-arena-bytes", "16Q"], "--max-arena-bytes"),  # 16G is a size now; Q is no unit
        ({}, ["--log-format", "yaml"], "log_format"),
    ],
)
def test_bad_env_or_flag_value_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], env: dict[str, str], argv: list[str], setting: str
) -> None:
    with pytest.raises(SystemExit) as info:
        config.load(argv, env)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "smddpd: error:" in err
    assert setting in err


@pytest.mark.timeout(30)
def test_unreadable_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(SystemExit):
        config.load(["--config", missing], {})
    assert missing in capsys.readouterr().err
    broken = _toml(tmp_path, "chunk_bytes = = 3\n")
    with pytest.raises(SystemExit):
        config.load(["--config", broken], {})
    assert broken in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_help_names_every_setting_flag_and_env_var() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "smddp.server", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    words = set(out.replace("(", " ").replace(")", " ").replace(";", " ").replace(",", " ").split())
    for f in dataclasses.fields(DaemonConfig):
        assert "--" + f.name.replace("_", "-") in words, f"--help lacks the flag of {f.name}"
        assert "SMDDP_" + f.name.upper() in words, f"--help lacks the env var of {f.name}"
    assert "--config" in words and "SMDDP_CONFIG" in words
