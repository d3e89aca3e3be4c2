"""``from smddp.torchft import ProcessGroupSmddp``: torchft's process group on smddp.

The class lives beside the process group it wraps (``smddp.backend.torchft``); this is the
name a training script imports. It needs torchft installed; ``import smddp`` never imports it.
"""

from smddp.backend.torchft import ProcessGroupSmddp

__all__ = ["ProcessGroupSmddp"]
