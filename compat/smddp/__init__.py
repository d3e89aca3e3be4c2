"""smddp: collectives for PyTorch carried out by a daemon on each node.

``import smddp`` registers the torch.distributed backend ``"smddp"``: at once when torch is
already imported, else the moment torch finishes importing. So a training script gets the
backend whatever its import order, while the daemon and ``smddpctl``, which import
``smddp.*`` but never torch, do not pay for importing torch.

Installed as a distribution, smddp also names ``smddp:_torch_autoload`` in torch's
``torch.backends`` entry point group, which torch calls at the end of its own import: then
``init_process_group(backend="smddp")`` works without the import. That path only registers
a creator that imports the backend when a process group is first made, so importing torch
costs next to nothing more.

When the backend registers (torch imported), smddp also fills torchrun's variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) from an MPI or Slurm launcher's where they are
missing (``smddp.core.launch_env``), and makes the ``env://`` rendezvous say how to start the
script when they are missing still. The daemon and ``smddpctl`` import ``smddp.*`` too, and
never torch: for them this package only waits for a torch import that never comes.

This folder is ``compat/smddp`` (pyproject.toml's package-dir): no folder at the checkout's
root is called smddp, so running from the root imports the installed package.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

from smddp.core import launch_env

__version__ = "0.1.0"

_TRIGGER = "torch"
_BACKEND_NAME = "smddp"

# Set when the launcher's environment could not be completed (a job across nodes with no
# known rendezvous host): the env:// rendezvous raises it instead of torch's bare message.
_launch_problem: str | None = None


def _create(dist_opts: Any, pg_options: Any) -> Any:
    """The backend's creator as registered before ``smddp.backend`` is imported.

    Importing the backend here is also where a torch outside the supported range is refused
    (smddp.backend.version), with its message, when a group is first made.
    """
    from smddp.backend import _create as create

    return create(dist_opts, pg_options)


def _register() -> None:
    global _launch_problem
    import torch.distributed as dist

    # Here, not at import: a process that never imports torch (the daemon) keeps its
    # environment as it was given.
    _launch_problem = launch_env.fill()

    if not dist.is_available():
        return
    if _BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            _BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"]
        )
    _explain_env_rendezvous()


def _torch_autoload() -> None:
    """torch's ``torch.backends`` entry point: called while torch finishes importing.

    Never raises: torch turns an entry point's exception into a failed ``import torch``, and
    a training script that does not use smddp must not break over it.
    """
    try:
        _register()
    except Exception as exc:
        import warnings

        warnings.warn(
            f"smddp: could not register backend 'smddp' with torch: {exc!r}; "
            "add 'import smddp' to the script",
            stacklevel=2,
        )


def _explain_env_rendezvous() -> None:
    """Makes ``env://`` say how to start the script when RANK / WORLD_SIZE / MASTER_* are
    missing (torch's message names the variable only)."""
    import importlib

    # By module path: torch.distributed's attribute "rendezvous" is the function.
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    original = handlers.get("env")
    if original is None or getattr(original, "_smddp", False):
        return

    def env_handler(url: str, timeout: Any = None, **kwargs: Any) -> Iterator[Any]:
        gen = (
            original(url, **kwargs) if timeout is None else original(url, timeout=timeout, **kwargs)
        )
        try:
            first = next(gen)
        except ValueError as exc:
            if "expected, but not set" not in str(exc):
                raise
            raise ValueError(
                f"{exc}. {_launch_problem or 'smddp: ' + launch_env.HOW_TO_START}"
            ) from None
        yield first
        yield from gen

    # A mark on the function itself (what the getattr above checks); mypy knows no such attribute.
    env_handler._smddp = True  # type: ignore[attr-defined]
    handlers["env"] = env_handler


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Registers the backend right after ``torch`` (with torch.distributed) finishes importing."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TRIGGER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            _register()

        # Wrapping the loader's method in place is the point; mypy forbids assigning to methods.
        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


# The backend's public calls, imported (with torch) when first asked for.
_BACKEND_CALLS = {
    "shrink_group": "smddp.backend.shrink",
    "failed_ranks": "smddp.backend.shrink",
    "SHRINK_DEFAULT": "smddp.backend.shrink",
    "SHRINK_ABORT": "smddp.backend.shrink",
    "grow": "smddp.backend.grow",
    "join": "smddp.backend.grow",
    "heal": "smddp.backend.heal",
}


def __getattr__(name: str) -> Any:
    """``smddp.shrink_group``, its flags, ``smddp.failed_ranks``, ``smddp.grow``,
    ``smddp.join`` and ``smddp.heal``, from the backend, on first use (they need torch, which
    ``import smddp`` does not import)."""
    module = _BACKEND_CALLS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


if _TRIGGER in sys.modules:
    _register()
elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterImport())
