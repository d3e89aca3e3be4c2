"""The rank's device in backend/cuda.py: torch.cuda's calls unless the process gave another to
``use_device`` before its first device call; no variable names one (SMDDP_TEST_CUDA_DEVICE,
the old test seam, loads nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from smddp.backend import cuda
from smddp.client.errors import UnsupportedError


class Device:
    """Stands for a test device: use_device only keeps it."""


@pytest.mark.timeout(60)
def test_the_given_device_is_the_process_s_until_another_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cuda, "_api", None)  # as in a fresh process; restored afterwards
    device = Device()
    cuda.use_device(device)
    assert cuda.device_api() is device
    cuda.use_device(device)  # the same device again (a second process group): fine
    with pytest.raises(UnsupportedError, match="already makes its device calls on Device"):
        cuda.use_device(Device())
    assert cuda.device_api() is device


@pytest.mark.timeout(60)
def test_a_device_given_after_the_first_device_call_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cuda, "_api", None)
    assert type(cuda.device_api()) is cuda.TorchCuda
    with pytest.raises(UnsupportedError, match="before its first collective"):
        cuda.use_device(Device())


@pytest.mark.timeout(120)
def test_the_old_variable_loads_nothing(tmp_path) -> None:
    """A rank process with SMDDP_TEST_CUDA_DEVICE naming a planted file makes its device
    calls on torch.cuda, and the file is never run."""
    marker = tmp_path / "loaded"
    planted = tmp_path / "planted_device.py"
    planted.write_text(f"open({str(marker)!r}, 'w').close()\n\ndef get():\n    return object()\n")
    program = textwrap.dedent(
        """
        from smddp.backend.cuda import TorchCuda, device_api
        print(type(device_api()) is TorchCuda)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program],
        env=dict(os.environ, SMDDP_TEST_CUDA_DEVICE=f"{planted}:get"),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True", done.stdout + done.stderr
    assert not marker.exists()
