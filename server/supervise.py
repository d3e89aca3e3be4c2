"""Supervision of the daemon's long-lived threads, and release paths that always finish.

Each long-lived thread (the watchdog, the accept loops, a connection's reader, a
communicator's worker, the GPU gate thread) works in units: one communicator's timeout
check, one accepted connection, one op, one frame. An exception in a unit is a bug of the
daemon or an input nobody foresaw; it must cost what that unit worked on and nothing more:
``unit`` logs it (once per cause, rate-limited: a bug met at every tick must not flood the
log), lets ``on_error`` fail what it concerned (a communicator fails on all its ranks with a
named internal error, a connection closes), and the thread goes on with its next unit. A
thread that dies takes every later unit with it: the watchdog's death once left every later
job's missing rank untimed and /healthz failing.

Releasing what a rank, a communicator or a connection held is a list of steps (its metrics,
its control region, its worker, its arenas, its connection, its counts); ``Steps`` runs each
of them whatever the ones before raised, logs what raised once, and raises the first error
only after all ran (as ``Reported``, which nobody logs again). A close that stopped at its
first error once kept four 256 MiB arenas and five regions of ended jobs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent import futures
from types import TracebackType
from typing import Protocol, TypeVar

from smddp.server.logthrottle import Throttle

log = logging.getLogger(__name__)

T = TypeVar("T")

# Per cause (what the unit does and the exception's type, never a job's name: the causes
# stay few), the first lines of a minute are written and the rest counted.
_throttle = Throttle()


class SupportsClose(Protocol):
    """Anything with ``close()``: a socket, a connection."""

    def close(self) -> None: ...


class Reported(Exception):
    """An error that supervision has logged already, raised on after every release step ran
    so that the caller knows the release met one; nobody logs it again."""


def report(
    where: str, exc: BaseException, about: str = "", fields: Mapping[str, object] | None = None
) -> None:
    """Logs an exception that escaped a unit of work, with its traceback, once per cause.

    Args:
        where: what the unit did, e.g. "the watchdog checking a communicator's timeouts";
            with the exception's type, the cause that rate-limits the line.
        about: whom it concerned, e.g. "job j comm 0" (starts the line).
        fields: ``extra=`` of the record (the JSON log's job, comm, rank, node).
    """
    if isinstance(exc, Reported):
        return
    _throttle.log(
        log,
        logging.ERROR,
        f"{where}: {type(exc).__name__}",
        "%sinternal error in smddpd while %s: %s: %s",
        f"{about}: " if about else "",
        where,
        type(exc).__name__,
        exc,
        exc_info=(type(exc), exc, exc.__traceback__),
        extra=dict(fields or {}),
    )


class unit:  # lower case: it reads as a function, ``with unit(...):``
    """One unit of a long-lived thread's work: ``with unit(...): work()``.

    An exception of the block is logged (``report``) and handed to ``on_error``, which fails
    what the unit concerned; then the block ends as if it had returned, and the thread goes
    on. An exception of ``on_error`` itself is logged too, never raised.

    Args:
        where, about, fields: as for ``report``.
        on_error: called with the exception; fails what the unit worked on.
    """

    def __init__(
        self,
        where: str,
        about: str = "",
        fields: Mapping[str, object] | None = None,
        on_error: Callable[[Exception], object] | None = None,
    ) -> None:
        self.where = where
        self.about = about
        self.fields = fields
        self.on_error = on_error

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is None or not isinstance(exc, Exception):
            return False  # KeyboardInterrupt, SystemExit: not the unit's to keep
        report(self.where, exc, self.about, self.fields)
        if self.on_error is not None:
            try:
                self.on_error(exc)
            except Exception as again:
                report(f"failing what {self.where} concerned", again, self.about, self.fields)
        return True


def closing(resource: SupportsClose) -> Callable[[Exception], None]:
    """An ``on_error`` that closes ``resource`` (a connection), whatever the error."""

    def close(_exc: Exception) -> None:
        resource.close()

    return close


class Steps:
    """Release steps that all run, whatever each raises.

    Example::

        steps = Steps("closing a communicator", comm.name())
        steps.run("closing its control region", region.close)
        steps.run("stopping its worker", stop_worker)
        steps.raise_first()  # Reported, naming the first error, if any step raised
    """

    def __init__(
        self, what: str, about: str = "", fields: Mapping[str, object] | None = None
    ) -> None:
        self.what = what
        self.about = about
        self.fields = fields
        # The first error as text: the exception itself would keep the frames of its
        # traceback, and with them the maps and buffers they point at, alive.
        self.first: str | None = None

    def run(
        self,
        step: str,
        fn: Callable[[], T],
        on_error: Callable[[Exception], object] | None = None,
    ) -> T | None:
        """Runs one step; an exception is logged, kept if it is the first, and handed to
        ``on_error``.

        Returns:
            What ``fn`` returned, or None when it raised.
        """
        try:
            return fn()
        except Exception as exc:
            report(f"{self.what}: {step}", exc, self.about, self.fields)
            if self.first is None:
                self.first = f"{step} failed ({type(exc).__name__}: {exc})"
            if on_error is not None:
                try:
                    on_error(exc)
                except Exception as again:
                    report(f"{self.what}: after {step}", again, self.about, self.fields)
            return None

    def raise_first(self) -> None:
        """Raises ``Reported`` saying which step raised first, if one did.

        Raises:
            Reported: a step raised (logged already).
        """
        first, self.first = self.first, None
        if first is not None:
            prefix = f"{self.about}: " if self.about else ""
            raise Reported(f"{prefix}{self.what}: {first}; every other step ran")


# prctl(2)'s PR_SET_NAME: the name the kernel shows for a thread (/proc/PID/task/TID/comm,
# top -H, ps -L), at most 15 bytes.
_PR_SET_NAME = 15


def name_os_thread() -> None:
    """Gives the calling thread its Python name in the kernel too, so that an operator (and a
    test) sees which of the daemon's threads are whose. Pools call it as their initializer.
    Where prctl is not reachable the thread keeps the process's name."""
    import ctypes
    import threading

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, threading.current_thread().name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def named_pool(max_workers: int, prefix: str) -> futures.ThreadPoolExecutor:
    """A thread pool whose threads carry ``prefix`` in the kernel's name as well (gRPC's
    servers keep the threads they made, up to ``max_workers``: bounded, never per job)."""
    return futures.ThreadPoolExecutor(
        max_workers=max_workers, thread_name_prefix=prefix, initializer=name_os_thread
    )
