"""SageMaker's pre-1.4 ``smdistributed.dataparallel.torch.parallel``."""

from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
