"""The daemon's GPU side (server/gpu_supply.py): one ``GpuOps`` per ``DaemonGpu``, made at the
first GPU op on the runtime given to its constructor; and no code loaded from a path that an
environment variable names (the old test seams, ``SMDDP_TEST_GPU_RUNTIME`` in the daemon and
``SMDDP_TEST_CUDA_DEVICE`` in the ranks, are ignored: tests/backend/test_cuda_device.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from gpu_fakes import FakeRuntime

from smddp.server import gpu
from smddp.server.errors import FailedPrecondition
from smddp.server.gpu_runtime import GpuUnavailable
from smddp.server.gpu_supply import DaemonGpu

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("server", "client", "backend", "core", "compat")
OLD_SEAM = "SMDDP_TEST_GPU_RUNTIME"
OLD_DEVICE_SEAM = "SMDDP_TEST_CUDA_DEVICE"  # the ranks' (backend/cuda.py's) old seam


class CountingFactory:
    """A runtime factory that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.made: list[FakeRuntime] = []

    def __call__(self) -> FakeRuntime:
        self.calls += 1
        self.made.append(FakeRuntime())
        return self.made[-1]


@pytest.mark.timeout(60)
def test_the_ops_are_made_once_at_the_first_gpu_op_on_the_given_runtime() -> None:
    factory = CountingFactory()
    supply = DaemonGpu(1 << 20, runtime_factory=factory)
    assert factory.calls == 0 and supply.active() is None  # nothing made before a GPU op
    ops = supply.ops("n0")
    assert factory.calls == 1 and ops.rt is factory.made[0] and ops.chunk_bytes == 1 << 20
    assert supply.ops("n0") is ops and supply.active() is ops and factory.calls == 1
    assert DaemonGpu(1, runtime_factory=factory).chunk_bytes == 1 << 16  # the floor


@pytest.mark.timeout(60)
def test_two_daemons_in_one_process_have_their_own_gpu_ops() -> None:
    """No process-wide GPU state: each daemon object owns its ops, on its own runtime."""
    first, second = CountingFactory(), CountingFactory()
    a = DaemonGpu(1 << 20, runtime_factory=first)
    b = DaemonGpu(2 << 20, runtime_factory=second)
    assert a.ops().rt is first.made[0] and b.active() is None
    assert b.ops().rt is second.made[0] and b.ops() is not a.ops()
    assert (a.ops().chunk_bytes, b.ops().chunk_bytes) == (1 << 20, 2 << 20)


@pytest.mark.timeout(60)
def test_a_runtime_that_is_unavailable_fails_the_op_naming_the_node() -> None:
    def unavailable() -> gpu.Runtime:
        raise GpuUnavailable("CuPy finds no GPU visible to the daemon")

    supply = DaemonGpu(runtime_factory=unavailable)
    with pytest.raises(
        FailedPrecondition,
        match="smddpd on node n3 cannot carry GPU tensors: CuPy finds no GPU visible",
    ):
        supply.ops("n3")
    assert supply.active() is None


@pytest.mark.timeout(60)
def test_no_product_module_names_the_old_test_seams_or_loads_code_from_a_path() -> None:
    offenders = []
    for folder in PRODUCT:
        for path in sorted((REPO / folder).rglob("*.py")):
            text = path.read_text()
            for word in (OLD_SEAM, OLD_DEVICE_SEAM, "spec_from_file_location"):
                if word in text:
                    offenders.append(f"{path.relative_to(REPO)}: {word}")
    assert offenders == []


@pytest.mark.timeout(120)
def test_a_real_daemon_ignores_the_old_test_runtime_variable(start_daemon, tmp_path) -> None:
    """smddpd started with SMDDP_TEST_GPU_RUNTIME naming a fake runtime makes its GPU ops
    (--gpu-warm start: what its first GPU op does) without ever loading that file."""
    marker = tmp_path / "loaded"
    fake = tmp_path / "planted_runtime.py"
    fake.write_text(f"open({str(marker)!r}, 'w').close()\n\ndef runtime():\n    return None\n")
    d = start_daemon(
        args=["--gpu-warm", "start"],
        env=dict(os.environ, **{OLD_SEAM: f"{fake}:runtime"}),
    )
    deadline = time.monotonic() + 60
    while "--gpu-warm start: " not in d.log():
        assert d.proc.poll() is None, d.log()
        assert time.monotonic() < deadline, d.log()
        time.sleep(0.05)
    assert not marker.exists(), d.log()
    assert "TEST runtime" not in d.log(), d.log()
    assert d.stop() == 0, d.log()
