"""What the GPU tests share: whether they can run here, and the ranks' environment.

They need a CUDA build of torch that sees a GPU (the ranks) and CuPy (the daemon); without
either every test in tests/gpu is skipped with the reason. Several ranks may share one GPU
(CUDA IPC between processes on the same device); ``layouts()`` gives the rank-to-GPU
layouts worth testing on this machine.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


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
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (smddpd needs it for GPU ops: pip install cupy-cuda12x)"
    return None


REASON = skip_reason()
requires_gpu = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


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
