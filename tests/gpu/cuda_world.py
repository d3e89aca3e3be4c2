"""What the GPU tests share: whether they can run here, and the ranks' environment.

They need a CUDA build of torch that sees a GPU (the ranks) and CuPy with a working NVRTC
(the daemon); without either every test in tests/gpu is skipped with the reason, unless
``SMDDP_REQUIRE_GPU=1`` (what ``benchmarks/gpu_check.sh`` sets): then each of them fails
with the reason instead, so a GPU check cannot pass having run nothing. Several ranks may
share one GPU (CUDA IPC between processes on the same device); ``layouts()`` gives the
rank-to-GPU layouts worth testing on this machine. ``SMDDP_GPU_QUICK=1`` keeps the world
sizes to 2 and 4 (``gpu_check.sh --quick``).
"""

from __future__ import annotations

import os

import pytest

REQUIRED = os.environ.get("SMDDP_REQUIRE_GPU") == "1"
QUICK = os.environ.get("SMDDP_GPU_QUICK") == "1"


def skip_reason() -> str | None:
    """Why the GPU tests cannot run here, or None when they can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return (
            f"no CUDA GPU: torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}) sees "
            "none; run benchmarks/gpu_check.sh on a GPU machine"
        )
    try:
        import cupy
    except ImportError as exc:
        return (
            f"CuPy does not import ({exc}); smddpd needs it for GPU ops (pip install cupy-cuda12x)"
        )
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.nvrtc.getVersion()
    except Exception as exc:  # CUDARuntimeError, or NVRTC's library missing
        return f"CuPy cannot run the daemon's kernels here: {exc}"
    if count == 0:
        return "CuPy sees no GPU"
    return None


REASON = skip_reason()
# Under SMDDP_REQUIRE_GPU=1 no skip mark: conftest.py's fixture fails each test instead.
requires_gpu = [pytest.mark.gpu] + (
    [] if REQUIRED else [pytest.mark.skipif(REASON is not None, reason=REASON or "")]
)


def worlds(*sizes: int) -> list[int]:
    """The world sizes to test, of ``sizes`` (2 and 4 only under SMDDP_GPU_QUICK=1)."""
    return [w for w in sizes if not QUICK or w in (2, 4)] or [min(sizes)]


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def layouts(world: int) -> list[list[int]]:
    """Rank-to-GPU layouts for ``world`` ranks: all on GPU 0, and spread when there are more."""
    out = [[0] * world]
    n = gpu_count()
    if n > 1:
        out.append([r % n for r in range(world)])
    return out


def rank_env(socket_path: str, **extra: str) -> dict[str, str]:
    """A rank's environment: the test's daemon, no embedded fallback."""
    env = dict(os.environ, SMDDP_SOCKET=socket_path, SMDDP_EMBEDDED="0", **extra)
    return env


def measure(line: str) -> None:
    """Records one measurement line: printed, and appended to the file named by
    ``SMDDP_GPU_MEASURE_FILE`` (benchmarks/gpu_check.sh prints that file after the tests)."""
    print(line)
    path = os.environ.get("SMDDP_GPU_MEASURE_FILE")
    if path:
        with open(path, "a") as f:
            f.write(line.rstrip("\n") + "\n")
