"""The Future of a GPU Work that completes after ``get_future()`` has returned.

DDP calls ``get_future()`` on every bucket's Work as soon as it is launched; blocking there
until the daemon's reply would stall the autograd thread once per bucket. A Future made from
Python holds a PyObject, which DDP's built-in C++ hooks refuse, and none can be typed
directly; one made by ``torch.jit._fork`` *inside* TorchScript is typed
(``Future[List[Tensor]]``) and runs its function on torch's inter-op thread pool, so the
function below waits for the reply there and returns the Work's tensors.

No ``from __future__ import annotations`` here: TorchScript needs real annotations.
"""

import threading
import time
from typing import Any

import torch

_works: dict[int, Any] = {}
_lock = threading.Lock()
_keys = iter(range(1 << 62))
# Polling steps while waiting for a reply (seconds): the daemon answers within a round trip,
# and polling never holds the client's lock while waiting (a blocking wait would stall the
# caller's next submission).
_POLL_S = (0.00002, 0.0001, 0.0005, 0.002)


def pending(work: Any) -> torch.futures.Future[list[torch.Tensor]]:
    """A Future[List[Tensor]] completing with ``work.result()`` (or its error) later."""
    with _lock:
        key = next(_keys)
        _works[key] = work
    return _fork_wait(key)


@torch.jit.ignore
def _wait_work(key: int) -> list[torch.Tensor]:
    with _lock:
        work = _works.pop(key)
    step = 0
    while not work.is_completed():
        time.sleep(_POLL_S[min(step, len(_POLL_S) - 1)])
        step += 1
    return work.result()  # raises the op's error: the Future then holds it


@torch.jit.script
def _wait_script(key: int) -> list[torch.Tensor]:
    return _wait_work(key)


@torch.jit.script
def _fork_wait(key: int) -> torch.futures.Future[list[torch.Tensor]]:
    # In TorchScript, fork runs the call asynchronously; from Python it would run at once.
    return torch.jit._fork(_wait_script, key)
