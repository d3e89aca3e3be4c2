"""SageMaker's import path: ``import smdistributed.dataparallel.torch.torch_smddp``.

Registers the torch.distributed backend "smddp", as Amazon SageMaker's module does, so that a
script written for SageMaker runs unchanged with ``dist.init_process_group(backend="smddp")``.
"""

from smddp.backend import register

register()
