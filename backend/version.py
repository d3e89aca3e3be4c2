"""Which torch versions the backend works with, checked when it is imported.

The backend is a Python subclass of ``torch.distributed.ProcessGroup`` registered with
``Backend.register_backend(..., extended_api=True, devices=[...])``, and it implements the
collectives under the names torch's Python trampoline (``PyProcessGroup``) dispatches to.
torch 2.13 is the first release whose trampoline reaches ``all_gather_single``,
``reduce_scatter_single`` and ``all_to_all_single`` (the "_single" renames of
``_allgather_base``, ``_reduce_scatter_base`` and ``alltoall_base``, pytorch/pytorch#186130 and
#188548); under an older torch, ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and
``all_to_all_single`` would fail deep inside torch ("No backend type associated with device
type cpu"). Keep this range in step with the ``torch`` extra in pyproject.toml.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

MIN_TORCH = (2, 13)
BELOW_TORCH = (3, 0)  # a new major version may change the ProcessGroup API again
SUPPORTED = "torch>=2.13,<3"


class UnsupportedTorchError(ImportError):
    """The installed torch is outside the range the backend supports."""

    unsupported_torch = True  # what smddp's import hook looks for (it imports no torch itself)


def _release(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise UnsupportedTorchError(f"smddp's torch backend cannot read torch's version {version!r}")
    return int(match.group(1)), int(match.group(2))


def check_torch(version: str | None = None) -> None:
    """Raises UnsupportedTorchError, saying what to do, unless torch (or ``version``) is supported.

    A build inside the range that lacks the calls (a nightly from before the renames) is refused
    too, by looking for them.
    """
    found = version if version is not None else torch.__version__
    release = _release(found)
    if not MIN_TORCH <= release < BELOW_TORCH:
        raise UnsupportedTorchError(
            f"smddp's torch backend needs {SUPPORTED}; this process has torch {found}. Install a "
            f"torch in that range (e.g. pip install torch==2.13.0), or run this job with another "
            f"backend; smddpd itself needs no torch and serves jobs of any supported torch"
        )
    if version is None:
        missing = [
            name for name in ("all_gather_single", "reduce_scatter_single", "all_to_all_single")
            if not hasattr(dist.ProcessGroup, name)
        ]
        register = dist.Backend.register_backend.__code__.co_varnames
        if "devices" not in register or "extended_api" not in register:
            missing.append("Backend.register_backend(extended_api=..., devices=...)")
        if missing:
            raise UnsupportedTorchError(
                f"smddp's torch backend needs {SUPPORTED}; this torch {found} lacks {', '.join(missing)} "
                f"(a build from before torch 2.13's release?): install a released torch in that range"
            )


check_torch()  # at import, before the backend's modules touch torch's ProcessGroup API
