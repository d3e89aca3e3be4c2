"""examples/numpy_allreduce.py: plain numpy processes, no torch, collectives through smddpd."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "numpy_allreduce.py"
RUN_TIMEOUT_S = 60


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_numpy_example_runs_without_torch(daemon, torch_free_python, tmp_path):
    world = 2
    token = secrets.token_hex(16)
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            SMDDP_SOCKET=daemon.socket,
            SMDDP_TEST_TORCH_REPORT=str(tmp_path / f"torch{rank}.json"),
        )
        # A client must not need the daemon's switch to stay torch-free.
        cmd = [
            *torch_free_python,
            str(EXAMPLE),
            "--rank",
            str(rank),
            "--world-size",
            str(world),
            "--job-id",
            "numpy-example",
            "--job-token",
            token,
            "--size",
            "300000",
        ]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=RUN_TIMEOUT_S))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{out}\n{err}"
        assert f"rank {rank}: all_reduce(SUM) of 300000 x float32 ok" in out
        assert f"rank {rank}: all_gather and barrier ok" in out
        report = json.loads((tmp_path / f"torch{rank}.json").read_text())
        assert report["loaded"] == [], f"rank {rank} imported torch: {report}"
