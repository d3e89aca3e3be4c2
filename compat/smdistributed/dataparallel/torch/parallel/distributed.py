"""SageMaker's pre-1.4 ``DistributedDataParallel``: torch's, on the smddp process group.

The library's v1.3 class took ``(module, device_ids=None, output_device=None,
broadcast_buffers=True, process_group=None, bucket_cap_mb=None)`` and needed no backend
argument; this one passes those to ``torch.nn.parallel.DistributedDataParallel`` (other
keywords too), with the default group that ``smdistributed.dataparallel.torch.distributed.
init_process_group()`` made.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

import smddp  # noqa: F401  (registers the backend)

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(_TorchDDP):
    """torch's DistributedDataParallel with the pre-1.4 library's signature and defaults."""

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids: list[int] | None = None,
        output_device: int | None = None,
        broadcast_buffers: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        **kwargs: Any,
    ) -> None:
        if bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = bucket_cap_mb
        super().__init__(
            module,
            device_ids=device_ids,
            output_device=output_device,
            broadcast_buffers=broadcast_buffers,
            process_group=process_group,
            **kwargs,
        )
