"""The per-communicator progress thread: runs large shared-memory ops in the background.

A large op on the shared-memory path takes milliseconds of copies and reductions (numpy
releases the GIL in them), so the caller gets its Handle at once and goes on (DDP's
backward, the next bucket) while the thread works. Ops run in the order they were
submitted, one at a time; the engine sends later shared-memory ops of the communicator here
too while any are queued, so the ranks' synchronisation points stay in the same order.

An op submitted with ``submit_claimable`` may instead be run by a caller that waits for it,
once every op submitted before it has finished: a thread handoff each way costs tens of
microseconds on a busy host, which a blocking call saves this way.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable


class ProgressThread:
    """A FIFO of callables run by one daemon thread, started at the first submit."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        # Ops are numbered as submitted, and finish in that order (a claimed one only once
        # every op before it has): the op numbered ``_finished`` is the next to finish.
        self._submitted = 0
        self._finished = 0

    def submit(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` after everything submitted before it; ``fn`` must not raise."""

        def queued() -> None:
            try:
                fn()
            finally:
                self._finish()

        self._enqueue(queued)

    def submit_claimable(
        self, run: Callable[[], None], event: threading.Event
    ) -> Callable[[], bool]:
        """Queues ``run`` (which must not raise) and returns ``claim()``: a caller that would
        wait for it runs it in its own thread instead, when every op submitted before it has
        finished, and gets True; False leaves it to this thread. Whoever runs it sets
        ``event`` once it has finished."""
        claimed = threading.Lock()

        def run_once() -> bool:
            if not claimed.acquire(blocking=False):
                return False
            try:
                run()
            finally:
                self._finish()
                event.set()
            return True

        def queued() -> None:
            if not run_once():
                # The caller runs it: what was queued after it must still wait for it.
                event.wait()

        ticket = self._enqueue(queued)

        def claim() -> bool:
            return self._finished == ticket and run_once()

        return claim

    def busy(self) -> bool:
        """True while something submitted has not finished."""
        return self._finished < self._submitted

    def drain(self) -> None:
        """Blocks until everything submitted so far has finished."""
        with self._idle:
            while self._finished < self._submitted:
                self._idle.wait()

    def stop(self) -> None:
        """Finishes what is queued, then ends the thread."""
        self.drain()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _enqueue(self, fn: Callable[[], None]) -> int:
        with self._lock:
            ticket = self._submitted
            self._submitted += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put(fn)
        return ticket

    def _finish(self) -> None:
        with self._idle:
            self._finished += 1
            if self._finished == self._submitted:
                self._idle.notify_all()

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            try:
                fn()
            except Exception:
                # A bug in one op: say so, and run the ops behind it (its own waiter has been
                # released by its finish), rather than leave them all waiting on a dead thread.
                traceback.print_exc()
