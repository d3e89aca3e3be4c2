"""The Work object torch gets back from every smddp collective.

Errors leave a Work only as exceptions raised from ``wait()`` or ``get_future()``, never as
a failed Future. torch's C++ (DDP's reducer, the built-in comm hooks) reads a Future that
Python completed with ``set_exception`` as a successful one whose value is the exception
object, finds no tensors in it and crashes the process (SIGSEGV in ``loss.backward()``,
measured); a Future failed through ``then()`` keeps the message but turns the error into a
plain RuntimeError. An exception raised from the override itself travels through pybind11
and the autograd engine unchanged (measured: the default reducer path, the Python hooks
``allreduce_hook`` and ``fp16_compress_hook``, the built-in FP16_COMPRESS hook), so every
caller gets the SmddpBackendError subclass with the daemon's message. ``get_future()``
therefore waits for the op, as it did before, and raises its error. (Should it ever return
before the op ends, an error found later can still reach the caller with its type: a
Python final callback queued with ``Variable._execution_engine.queue_callback`` while the
backward pass runs is called before DDP's ``finalize_backward`` reads the Future, and
what it raises reaches ``backward()``'s caller unchanged; measured the same way.)

No ``from __future__ import annotations`` here: TorchScript compiles ``_identity`` below and
needs real annotations.
"""

import threading
from datetime import timedelta
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from smddp.backend.errors import translate
from smddp.client import Handle
from smddp.client.errors import SmddpError


@torch.jit.script
def _identity(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    return tensors


def typed_future(tensors: List[torch.Tensor]) -> torch.futures.Future:
    """A completed Future whose TorchScript type is List[Tensor].

    DDP's built-in C++ comm hooks (FP16_COMPRESS) require ``isTensorList()`` of the value; a
    Future completed from Python holds a PyObject, one made by ``torch.jit._fork`` does not.
    """
    return torch.jit._fork(_identity, tensors)


class SmddpWork(dist.Work):
    """Completes when the op's chunks are retired and copy-backs have run."""

    def __init__(
        self,
        handles: List[Handle],
        result: List[torch.Tensor],
        finish: Optional[Callable[[], None]] = None,
    ) -> None:
        super().__init__()
        self._handles = handles
        self._result = result
        self._finish = finish
        self._error: Optional[BaseException] = None
        self._completed = False
        self._lock = threading.Lock()

    def _complete(self) -> None:
        with self._lock:
            if self._completed:
                return
            try:
                for h in self._handles:
                    h.wait()
                if self._finish is not None:
                    self._finish()
            except SmddpError as exc:
                self._error = translate(exc)
            self._completed = True

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self._complete()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        # Polling makes progress; copy-backs run before True, so outputs are ready when it is.
        if not self._completed and all(h.poll() for h in self._handles):
            self._complete()
        return self._completed

    def is_success(self) -> bool:
        self._complete()
        return self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def result(self) -> List[torch.Tensor]:
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        """A completed Future of the output tensors; raises the op's error instead of
        returning a failed Future (see the module docstring for why)."""
        self._complete()
        if self._error is not None:
            raise self._error
        return typed_future(self._result)
