"""smddp: collectives for PyTorch carried out by a daemon on each node.

``import smddp`` registers the torch.distributed backend ``"smddp"``: at once when torch is
already imported, else the moment torch finishes importing. So a training script gets the
backend whatever its import order, while the daemon and ``smddpctl``, which import
``smddp.*`` but never torch, do not pay for importing torch.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

__version__ = "0.1.0"

_TRIGGER = "torch"


def _register() -> None:
    backend = sys.modules.get("smddp.backend")
    if backend is not None and not hasattr(backend, "register"):
        return  # smddp.backend is importing torch itself; it registers when it is done
    try:
        from smddp.backend import register
    except ImportError as exc:
        if not getattr(exc, "unsupported_torch", False):
            raise
        # torch itself must still import for a job that uses smddp.client or another backend;
        # ``import smddp.backend`` (or SageMaker's import) raises this error instead.
        warnings.warn(str(exc), RuntimeWarning, stacklevel=2)
        return
    register()


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Registers the backend right after ``torch`` (with torch.distributed) finishes importing."""

    def find_spec(self, fullname: str, path: object, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TRIGGER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)  # type: ignore[arg-type]
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module  # type: ignore[union-attr]

        def exec_module(module: ModuleType) -> None:
            original(module)
            _register()

        loader.exec_module = exec_module  # type: ignore[method-assign,union-attr]
        return spec


if _TRIGGER in sys.modules:
    _register()
elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterImport())
