"""The per-communicator progress thread: runs large shared-memory ops in the background.

A large op on the shared-memory path takes milliseconds of copies and reductions (numpy
releases the GIL in them), so the caller gets its Handle at once and goes on (DDP's
backward, the next bucket) while the thread works. Ops run in the order they were
submitted, one at a time; the engine sends later shared-memory ops of the communicator here
too while any are queued, so the ranks' synchronisation points stay in the same order.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class ProgressThread:
    """A FIFO of callables run by one daemon thread, started at the first submit."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self.queued = 0  # submitted and not yet finished

    def submit(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` after everything submitted before it; ``fn`` must not raise."""
        with self._lock:
            self.queued += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put(fn)

    def busy(self) -> bool:
        """True while something submitted has not finished."""
        return self.queued > 0

    def drain(self) -> None:
        """Blocks until everything submitted so far has finished."""
        with self._idle:
            while self.queued:
                self._idle.wait()

    def stop(self) -> None:
        """Finishes what is queued, then ends the thread."""
        self.drain()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            try:
                fn()
            finally:
                with self._idle:
                    self.queued -= 1
                    if not self.queued:
                        self._idle.notify_all()
