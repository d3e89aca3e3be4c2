"""TEST ONLY: the daemon's fake GPU runtime for the GPU check's dry run (``--fake-gpu``).

``tests/gpu/fake_smddpd.py benchmarks/gpu_check_fake.py:runtime``: the tests' fake runtime
(``tests/server/gpu_fakes.py:ipc_runtime``: the ranks' fake GPU memory mapped, the generated
kernels interpreted), whose ``prepare`` also looks the module up where the real runtime looks
first, in the prepared kernel cache (``SMDDP_KERNEL_CACHE``, ``gpu_runtime.PreparedKernels``,
for sm_90 and CUDA 13, the lent machine's), and appends "hit NAME" or "miss NAME" to the file
``SMDDP_CHECK_KERNEL_LEDGER`` names: so the dry run shows that every module its ops asked the
daemon for is in the cache the GPU run will read.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LEDGER_ENV = "SMDDP_CHECK_KERNEL_LEDGER"
ARCH = "sm_90"
CUDA_MAJOR = 13


def _fakes() -> Any:
    name = "smddp_check_gpu_fakes"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(
            name, REPO / "tests" / "server" / "gpu_fakes.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return module


def runtime() -> Any:
    """The factory fake_smddpd.py is given: fake GPU 0, modules looked up in the cache."""
    from smddp.server import gpu_kernels
    from smddp.server.gpu_runtime import PreparedKernels

    fakes = _fakes()
    prepared = PreparedKernels.from_env()
    ledger = os.environ.get(LEDGER_ENV, "")

    class CheckFakeRuntime(fakes.IpcFakeRuntime):  # type: ignore[misc, name-defined]
        def prepare(self, device: int, key: tuple[int, int, int, int]) -> None:
            super().prepare(device, key)
            found = prepared.get(key, ARCH, CUDA_MAJOR) is not None
            if ledger:
                with open(ledger, "a") as f:
                    f.write(
                        f"{'hit' if found else 'miss'} {gpu_kernels.kernel_name(*key, False)}\n"
                    )

    return CheckFakeRuntime(devices={fakes.uuid(0): 0})
