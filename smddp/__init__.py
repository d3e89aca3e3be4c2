"""smddp: collectives for PyTorch carried out by a daemon on each node.

``import smddp`` registers the torch.distributed backend ``"smddp"`` when torch is
installed, so that ``dist.init_process_group(backend="smddp")`` works. The daemon itself
(``smddp.server``) never needs torch; it sets ``SMDDP_DAEMON=1`` for itself so that
importing this package there skips the registration.
"""

from __future__ import annotations

import importlib.util
import os

__version__ = "0.1.0"

if os.environ.get("SMDDP_DAEMON") != "1" and importlib.util.find_spec("torch") is not None:
    from smddp.backend import register as _register

    _register()
