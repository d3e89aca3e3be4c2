"""The daemon's GPU side as an object it owns and hands down: ``gpu``'s ops, created (CuPy
imported) at the first GPU op.

The communicator sees only ``communicator.GpuSupply``, so it does not import ``gpu``, which
imports the communicator's types.
"""

from __future__ import annotations

from smddp.server import gpu


class DaemonGpu:
    """``communicator.GpuSupply`` backed by ``gpu``'s ops (one ``GpuOps`` per daemon).

    Args:
        chunk_bytes: the launch size, the configuration's ``gpu_chunk_bytes``.
    """

    def __init__(self, chunk_bytes: int) -> None:
        gpu.configure(chunk_bytes)  # imports nothing: CuPy waits for the first GPU op

    def ops(self, node_id: str = "") -> gpu.GpuOps:
        """The GPU ops, made on first use.

        Raises:
            FailedPrecondition: CuPy is not installed or no GPU is usable.
        """
        return gpu.ops(node_id)

    def active(self) -> gpu.GpuOps | None:
        """The GPU ops if a GPU op has run in this daemon, else None."""
        return gpu.active()
