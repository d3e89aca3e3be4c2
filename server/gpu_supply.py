"""The daemon's GPU side as an object it owns and hands down: one ``gpu.GpuOps``, made (CuPy
imported) at the first GPU op.

The ``Daemon`` makes one ``DaemonGpu`` and gives it to the registry (its communicators see it
as ``communicator.GpuSupply``, so they do not import ``gpu``, which imports their types) and
to the data socket's free channel. Which CUDA runtime the ops run on is a constructor
argument: CuPy's by default, a fake one where a test passes its factory
(``tests/gpu/fake_smddpd.py``). Nothing here reads the environment.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from smddp.server import gpu
from smddp.server.errors import FailedPrecondition

RuntimeFactory = Callable[[], gpu.Runtime]


def cupy_runtime() -> gpu.Runtime:
    """CuPy's runtime, its common kernels compiled in the background (the default factory).

    Raises:
        gpu_runtime.GpuUnavailable: CuPy is not installed or sees no usable GPU.
    """
    from smddp.server.gpu_runtime import CupyRuntime  # CuPy's import waits for the first op

    return CupyRuntime(warm=True)


class DaemonGpu:
    """``communicator.GpuSupply`` that makes the daemon's one ``GpuOps`` on first use.

    Args:
        chunk_bytes: the launch size, the configuration's ``gpu_chunk_bytes`` (at least
            64 KiB).
        runtime_factory: makes the CUDA runtime at the first GPU op; CuPy's when None. A
            factory may raise ``gpu_runtime.GpuUnavailable`` to say why no GPU is usable.
    """

    def __init__(
        self,
        chunk_bytes: int = gpu.LAUNCH_CHUNK_BYTES,
        runtime_factory: RuntimeFactory | None = None,
    ) -> None:
        self.chunk_bytes = max(1 << 16, chunk_bytes)
        self._factory = runtime_factory or cupy_runtime
        self._ops: gpu.GpuOps | None = None
        self._lock = threading.Lock()

    def ops(self, node_id: str = "") -> gpu.GpuOps:
        """The GPU ops, made (the runtime with them) on the first call.

        Raises:
            FailedPrecondition: CuPy is not installed or no GPU is usable.
        """
        with self._lock:
            if self._ops is None:
                from smddp.server.gpu_runtime import GpuUnavailable

                try:
                    self._ops = gpu.GpuOps(self._factory(), chunk_bytes=self.chunk_bytes)
                except GpuUnavailable as exc:
                    where = f"smddpd on node {node_id}" if node_id else "smddpd"
                    raise FailedPrecondition(f"{where} cannot carry GPU tensors: {exc}") from None
            return self._ops

    def active(self) -> gpu.GpuOps | None:
        """The GPU ops if a GPU op has run in this daemon, else None (nothing is imported)."""
        return self._ops
