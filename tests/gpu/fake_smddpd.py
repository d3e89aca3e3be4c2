"""TEST ONLY: smddpd on a fake GPU runtime, for tests and dry runs without a GPU.

    python tests/gpu/fake_smddpd.py FILE.py:FUNCTION [smddpd's arguments...]

runs the daemon exactly as ``python -m smddp.server [smddpd's arguments...]`` does (the same
``main``: configuration from flags, environment and file, logging, signals), except that its
GPU ops run on the runtime ``FUNCTION`` of ``FILE.py`` returns
(``tests/server/gpu_fakes.py:ipc_runtime``, ``benchmarks/gpu_check_fake.py:runtime``) instead
of CuPy's. The runtime reaches the daemon through its constructor (``Daemon(config,
gpu_runtime=...)``); the product daemon reads no variable naming one. The file is loaded,
and the runtime made, when the daemon makes its GPU ops (its first GPU op, or the start with
``--gpu-warm start``), which it logs as a warning.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Callable
from typing import Any

# The name the runtime's file is loaded under: dataclasses look their module up in sys.modules.
MODULE_NAME = "smddp_test_gpu_runtime"
USAGE = "usage: fake_smddpd.py FILE.py:FUNCTION [smddpd arguments...]"


def runtime_factory(spec: str) -> Callable[[], Any]:
    """The factory of the runtime ``spec`` (FILE.py:FUNCTION) names, loaded when called.

    Raises:
        ValueError: ``spec`` does not name FILE.py:FUNCTION.
    """
    path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not name:
        raise ValueError(f"{spec!r} does not name FILE.py:FUNCTION")

    def make() -> Any:
        module_spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"{spec!r} does not name a Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[MODULE_NAME] = module
        module_spec.loader.exec_module(module)
        logging.getLogger("smddp.server.gpu_supply").warning(
            "smddpd runs GPU ops on the TEST runtime %s (tests/gpu/fake_smddpd.py)", spec
        )
        return getattr(module, name)()

    return make


def main(argv: list[str]) -> int:
    """Runs smddpd with the fake runtime ``argv[0]`` names and the arguments after it."""
    if not argv or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    from smddp.server.main import main as smddpd

    return smddpd(argv[1:], gpu_runtime=runtime_factory(argv[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
