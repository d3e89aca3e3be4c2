"""Which torch versions the backend works with, checked when it is imported.

The backend is a Python subclass of ``torch.distributed.ProcessGroup`` registered with
``Backend.register_backend(..., extended_api=True, devices=[...])``, and it implements the
collectives under every name torch reaches them by. torch 2.13 renamed several of them
(pytorch/pytorch#186130 and #188548); torch 2.11 reaches the same ops under the old names,
measured with torch 2.11.0 (``tests/backend`` and ``tests/frameworks`` ran against it, and a
probe called each functional collective into a recording Python group):

=========================  ===================================  =============================
op                         torch 2.11 reaches                   torch 2.13 reaches
=========================  ===================================  =============================
all_gather_into_tensor     ``_allgather_base`` (Python lookup)  ``all_gather_single``
reduce_scatter_tensor      ``_reduce_scatter_base`` (Python)    ``reduce_scatter_single``
all_to_all_single          ``alltoall_base`` (Python and C++)   ``all_to_all_single``
functional all_gather      ``allgather_into_tensor_coalesced``  ``all_gather_single_coalesced``
functional reduce_scatter  ``reduce_scatter_tensor_coalesced``  ``reduce_scatter_single_coalesced``
=========================  ===================================  =============================

``torch.distributed``'s Python functions call the group's methods by attribute lookup, so they
find the subclass's methods whatever the C++ trampoline (``PyProcessGroup``) overrides; C++
callers (functional collectives, DDP's reducer) reach only what the trampoline overrides, and
2.11's overrides every op above under its old name. SmddpProcessGroup defines both names.

torch 2.12 lies inside the range but has not been run here. Keep this range in step with the
``torch`` extra in pyproject.toml.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

MIN_TORCH = (2, 11)
BELOW_TORCH = (3, 0)  # a new major version may change the ProcessGroup API again
SUPPORTED = "torch>=2.11,<3"


# The ProcessGroup methods (C++ side) a torch in the range has for the ops whose names changed:
# one of each pair, the 2.13 name or the one before it.
_REACHED_AS = (
    ("all_gather_single", "_allgather_base"),
    ("reduce_scatter_single", "_reduce_scatter_base"),
    ("all_to_all_single", "alltoall_base"),
    ("all_gather_single_coalesced", "allgather_into_tensor_coalesced"),
    ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"),
)


class UnsupportedTorchError(ImportError):
    """The installed torch is outside the range the backend supports."""

    unsupported_torch = True  # what smddp's import hook looks for (it imports no torch itself)


def _release(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise UnsupportedTorchError(
            f"smddp's torch backend cannot read torch's version {version!r}"
        )
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
            f"smddp's torch backend needs {SUPPORTED}; "
            f"this process has torch {found}. "
            "Install a torch in that range (e.g. pip install torch==2.13.0), or run this job with another backend; "  # noqa: E501
            "smddpd itself needs no torch and serves jobs of any supported torch"
        )
    if version is None:
        missing = [
            " or ".join(names)
            for names in _REACHED_AS
            if not any(hasattr(dist.ProcessGroup, n) for n in names)
        ]
        register = dist.Backend.register_backend.__code__.co_varnames
        if "devices" not in register or "extended_api" not in register:
            missing.append("Backend.register_backend(extended_api=..., devices=...)")
        if missing:
            raise UnsupportedTorchError(
                f"smddp's torch backend needs {SUPPORTED}; "
                f"this torch {found} lacks {', '.join(missing)} (a development build between releases?): "  # noqa: E501
                "install a released torch in that range"
            )


check_torch()  # at import, before the backend's modules touch torch's ProcessGroup API
