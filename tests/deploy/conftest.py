"""Fixtures shared by the deploy tests."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.fixture(scope="session")
def daemon_help() -> str:
    """The output of ``python -m smddp.server --help``: the daemon's flags and variables."""
    result = subprocess.run(
        [sys.executable, "-m", "smddp.server", "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"smddpd --help failed:\n{result.stderr}"
    return result.stdout
