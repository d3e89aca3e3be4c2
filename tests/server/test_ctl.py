"""``smddpctl`` against real daemons: every command reads the daemon named by ``--socket`` or
``SMDDP_SOCKET`` (metrics too, over the socket, whatever ``--http-bind`` says), options go
before or after the command, ``metrics`` summarizes, and a wrong socket gets a useful hint.
Also size flags with units.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from smddp.client import connect
from smddp.server import config as config_mod
from smddp.server.units import format_size, parse_size


def _ctl(*args: str, socket: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMDDP_")}
    if socket is not None:
        env["SMDDP_SOCKET"] = socket
    return subprocess.run(
        [sys.executable, "-m", "smddp.server.ctl", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def _json(*args: str, socket: str | None = None) -> Any:
    proc = _ctl(*args, socket=socket)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.timeout(120)
def test_every_command_reads_the_daemon_it_names(start_daemon) -> None:
    # --http-bind off (the fixture's default); the stragglers are per job, so shown only with
    # --metrics-job-labels.
    busy = start_daemon(args=("--metrics-job-labels",), name="busy")
    idle = start_daemon(args=("--http-bind", "127.0.0.1:0"), name="idle")
    job, token = f"ctl-{secrets.token_hex(4)}", secrets.token_bytes(16)
    c0 = connect(job, token, 0, 2, socket_path=busy.socket)
    c1 = connect(job, token, 1, 2, socket_path=busy.socket)
    try:
        for _ in range(3):
            a, b = np.ones(4096, np.float32), np.ones(4096, np.float32)
            h0, h1 = c0.all_reduce(a), c1.all_reduce(b)
            h0.wait()
            h1.wait()

        # Options before or after the command, the socket by flag or by SMDDP_SOCKET.
        for args, socket in (
            (("--json", "--socket", busy.socket, "metrics"), None),
            (("metrics", "--json", "--socket", busy.socket), None),
            (("metrics", "--json"), busy.socket),
        ):
            summary = _json(*args, socket=socket)
            (row,) = [r for r in summary["ops"] if r["op"] == "all_reduce"]
            assert row["dtype"] == "float32" and row["count"] == 3, summary
            assert 0 < row["p50_seconds"] <= row["p99_seconds"], row
            assert summary["registered_ranks"] == 2
            assert [s["job"] for s in summary["stragglers"]] == [job] * len(summary["stragglers"])
            assert sum(s["ops_last"] for s in summary["stragglers"]) == 3, summary
        # The other daemon, which serves /metrics over HTTP, has done nothing: its own figures.
        assert _json("metrics", "--json", "--socket", idle.socket)["ops"] == []

        text = _ctl("metrics", "--socket", busy.socket)
        assert text.returncode == 0, text.stderr
        # bytes: each rank's 16 KiB, summed over the 2 ranks, 3 times
        assert re.search(r"^all_reduce\s+float32\s+3\s+96\.0 KiB\s+\d", text.stdout, re.M), (
            text.stdout
        )
        assert re.search(rf"^  job {job}: rank [01] \d", text.stdout, re.M), text.stdout
        assert "p50" in text.stdout and "p99" in text.stdout

        raw = _ctl("metrics", "--raw", "--socket", busy.socket)
        assert 'smddp_ops_total{dtype="float32",op="all_reduce"} 3.0' in raw.stdout, raw.stdout
        assert "smddp_op_duration_seconds_bucket" in raw.stdout

        status = _json("status", "--json", "--socket", busy.socket)
        assert [c["job_id"] for c in status["comms"]] == [job]
        assert _json("status", "--json", socket=idle.socket)["comms"] == []
        topo = _json("topology", "--socket", idle.socket, "--json")
        assert topo["jobs"] == []
        health = _json("health", "--json", "--socket", busy.socket)
        assert health == {"target": "unix:" + busy.socket, "service": "", "status": "SERVING"}
    finally:
        c0.close()
        c1.close()


@pytest.mark.timeout(60)
def test_a_socket_where_no_daemon_is_gets_a_hint_that_helps(tmp_path) -> None:
    nope = str(tmp_path / "nope.sock")
    for args, socket in (((("--socket", nope, "status")), None), (("metrics",), nope)):
        proc = _ctl(*args, socket=socket)
        assert proc.returncode != 0
        assert f"no smddpd socket at {nope}" in proc.stderr, proc.stderr
        assert f"smddpd --socket {nope}" in proc.stderr, proc.stderr
        assert "use --socket" not in proc.stderr, proc.stderr
    # --address reaches a --grpc-bind listener, which serves health only: said before trying.
    proc = _ctl("--address", "127.0.0.1:9", "status")
    assert proc.returncode != 0 and "serves health only" in proc.stderr, proc.stderr


def test_sizes_take_units() -> None:
    assert parse_size("4MiB") == 4 << 20
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("512k") == 512 << 10
    assert parse_size("4MB") == 4_000_000
    assert parse_size("65536") == parse_size(65536) == 65536
    for bad in ("4 parsecs", "-1", "1.5", "MiB", ""):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert format_size(4 << 20) == "4MiB" and format_size(1000) == "1000"

    cfg = config_mod.load(["--chunk-bytes", "1MiB"], environ={"SMDDP_MAX_ARENA_BYTES": "2GiB"})
    assert (cfg.chunk_bytes, cfg.max_arena_bytes) == (1 << 20, 2 << 30)
    assert config_mod.load(["--chunk-bytes", "65536"], environ={}).chunk_bytes == 65536


def test_size_errors_and_the_config_file(tmp_path, capsys) -> None:
    toml = tmp_path / "smddpd.toml"
    toml.write_text('chunk_bytes = "2MiB"\nmax_arena_bytes = 1073741824\n')
    cfg = config_mod.load(["--config", str(toml)], environ={})
    assert (cfg.chunk_bytes, cfg.max_arena_bytes) == (2 << 20, 1 << 30)
    with pytest.raises(SystemExit):
        config_mod.load(["--chunk-bytes", "4 parsecs"], environ={})
    assert "unknown unit 'parsecs'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        config_mod.load([], environ={"SMDDP_CHUNK_BYTES": "lots"})
    assert "chunk_bytes: 'lots' is not a size" in capsys.readouterr().err
    help_text = config_mod.build_parser().format_help()
    assert "default 4MiB" in help_text and "default 16GiB" in help_text


def _ctl_into_closed_pipe(*args: str, socket: str) -> subprocess.CompletedProcess[str]:
    """smddpctl with a stdout whose reader has already gone, as in `smddpctl status | head -1`
    once head has its line: every write fails with EPIPE, whatever the timing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMDDP_")}
    env["SMDDP_SOCKET"] = socket
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "smddp.server.ctl", *args],
            env=env,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=30,
            check=False,
        )
    finally:
        os.close(write_end)


@pytest.mark.timeout(120)
def test_a_reader_that_closed_the_pipe_gets_no_traceback(daemon) -> None:
    for args in (("status",), ("metrics",), ("--help",)):
        proc = _ctl_into_closed_pipe(*args, socket=daemon.socket)
        assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, (
            args,
            proc.stderr,
        )
        assert proc.stderr == "", (args, proc.stderr)
        assert proc.returncode == 141, (args, proc.returncode, proc.stderr)

    # And through a real `head -1`, which reads the first line and exits.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMDDP_")}
    env["SMDDP_SOCKET"] = daemon.socket
    shell = subprocess.run(
        ["bash", "-c", f"'{sys.executable}' -m smddp.server.ctl status | head -1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert shell.returncode == 0 and shell.stdout.strip(), shell
    assert "Traceback" not in shell.stderr and "BrokenPipeError" not in shell.stderr, shell.stderr
