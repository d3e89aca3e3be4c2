"""Keeps smddp's own threads out of torch once the interpreter has begun to exit.

A script need not call ``destroy_process_group``: then the communicator's completer thread
(``work.py``, a daemon thread) may still be finishing a Work when the main thread ends. At
interpreter finalization CPython ends a daemon thread the moment it takes the GIL back
(``pthread_exit``); inside a torch binding that released the GIL (``Future.set_result``,
``Tensor.copy_``), that is pybind11's ``gil_scoped_release`` destructor, the unwinding
crosses a ``noexcept`` frame and the C++ runtime aborts the process: "terminate called
without an active exception", SIGABRT, after the script has printed all it had to. Measured:
a large non-contiguous async all_reduce whose Future was taken, then a small blocking one,
then the end of the script: 3 of 3 torchrun runs of 3 ranks ended with a rank killed by
SIGABRT.

So a smddp thread calls into torch only through ``GATE.passage()``, and an ``atexit``
handler (which runs before finalization, while threads still run) closes the gate: it waits
for the threads inside to come out and turns the later ones away. Waiting for an op itself
happens outside the gate (numpy and the client only), so an op that never completes does not
hold up the exit; a thread still waiting for one at finalization ends in plain Python code,
which is safe.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger("smddp")

# How long the exit waits for threads inside torch: their calls are bounded (a copy-back, a
# Future's completion), so this is only a backstop against a thread stuck there for good.
CLOSE_TIMEOUT_S = 60.0


class ExitGate:
    """Counts the threads inside torch calls; ``close`` waits for them and bars new ones."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self._closed = False

    @contextmanager
    def passage(self) -> Iterator[bool]:
        """Holds the gate open while the block runs; yields False (the block must then not
        call torch) once the interpreter is exiting."""
        with self._cond:
            if self._closed:
                admitted = False
            else:
                self._inside += 1
                admitted = True
        try:
            yield admitted
        finally:
            if admitted:
                with self._cond:
                    self._inside -= 1
                    if self._inside == 0:
                        self._cond.notify_all()

    @property
    def closed(self) -> bool:
        """True once ``close`` has been called."""
        return self._closed

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Bars new passages and waits until no thread is inside; False if one still was
        after ``timeout_s``."""
        with self._cond:
            self._closed = True
            done = self._cond.wait_for(lambda: self._inside == 0, timeout_s)
        if not done:
            log.warning(
                "smddp: at exit a thread of smddp was still inside torch after %.0f s; "
                "the process may abort as the interpreter finalizes",
                timeout_s,
            )
        return done


GATE = ExitGate()
atexit.register(GATE.close)
