"""init_process_group(backend="smddp") with no smddp import: torch's entry point loads it.

Prints whether the backend module was imported with torch (it should not be: the entry point
only registers a creator) and the all_reduce's result.
"""

import sys

import torch
import torch.distributed as dist

backend_loaded_with_torch = "smddp.backend" in sys.modules
dist.init_process_group(backend="smddp")
t = torch.ones(2) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(
    f"no-import ok rank={dist.get_rank()} sum={t[0].item():g} "
    f"backend_loaded_with_torch={backend_loaded_with_torch}",
    flush=True,
)
dist.destroy_process_group()
