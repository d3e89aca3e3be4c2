"""sd_notify(3) for smddpd, in pure Python.

systemd starts smddpd as ``Type=notify`` with ``WatchdogSec=``: the daemon says ``READY=1`` once
its sockets are listening, ``STOPPING=1`` when it begins to drain, and ``WATCHDOG=1`` regularly
while it is healthy. systemd passes the notification socket in ``$NOTIFY_SOCKET`` and the watchdog
period in ``$WATCHDOG_USEC``. Outside systemd (a terminal, a container, the embedded daemon a
training job starts for itself) those variables are unset and every call here is a cheap no-op, so
the daemon calls them unconditionally.

This is a re-implementation of the small part of libsystemd that smddpd needs, so that the daemon
does not depend on a C extension or on libsystemd being installed.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable

__all__ = [
    "NOTIFY_SOCKET_ENV",
    "READY",
    "RELOADING",
    "STOPPING",
    "WATCHDOG",
    "WATCHDOG_PID_ENV",
    "WATCHDOG_USEC_ENV",
    "Watchdog",
    "notify",
    "watchdog_interval",
]

logger = logging.getLogger(__name__)

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"
WATCHDOG_USEC_ENV = "WATCHDOG_USEC"
WATCHDOG_PID_ENV = "WATCHDOG_PID"

READY = "READY=1"
RELOADING = "RELOADING=1"
STOPPING = "STOPPING=1"
WATCHDOG = "WATCHDOG=1"


def _socket_address(path: str) -> str | None:
    """Translate ``$NOTIFY_SOCKET`` into an address for ``socket.connect``.

    Args:
        path: the variable's value: a filesystem path, or ``@name`` for a socket in the
            abstract namespace.

    Returns:
        The address (abstract names get their leading NUL byte), or None when the value is of a
        kind this module does not speak (systemd also knows ``vsock:``, which smddpd never needs).
    """
    if path.startswith("@"):
        return "\0" + path[1:]
    if path.startswith("/"):
        return path
    return None


def notify(state: str) -> bool:
    """Send one state update to the service manager.

    Args:
        state: newline-separated ``KEY=VALUE`` assignments, e.g. ``"READY=1"`` or
            ``"STATUS=serving 3 jobs"``.

    Returns:
        True when the datagram was sent; False when ``$NOTIFY_SOCKET`` is unset or unusable,
        or the send failed. Failures are logged, never raised: a daemon must keep serving
        even if its supervisor has gone away.
    """
    path = os.environ.get(NOTIFY_SOCKET_ENV)
    if not path:
        return False
    address = _socket_address(path)
    if address is None:
        logger.warning("ignoring %s=%r: not a unix socket path", NOTIFY_SOCKET_ENV, path)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode("utf-8"))
    except OSError as exc:
        logger.warning("sd_notify %r to %s failed: %s", state, path, exc)
        return False
    return True


def watchdog_interval() -> float | None:
    """Return the watchdog period systemd expects of this process.

    Returns:
        The period in seconds from ``$WATCHDOG_USEC``, or None when no watchdog is enabled:
        the variable is unset or not a positive integer, or ``$WATCHDOG_PID`` names another
        process (the variables were inherited from a parent that systemd actually watches).
    """
    usec = os.environ.get(WATCHDOG_USEC_ENV)
    if not usec:
        return None
    pid = os.environ.get(WATCHDOG_PID_ENV)
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    try:
        value = int(usec)
    except ValueError:
        return None
    if value <= 0:
        return None
    return value / 1_000_000


class Watchdog:
    """Pings the systemd watchdog from a daemon thread while the daemon is healthy.

    Every half period it calls ``healthy()``; if that returns True it sends ``WATCHDOG=1``. If
    the daemon is wedged (``healthy()`` returns False or raises) it stops pinging, so systemd
    kills and restarts the service once the period runs out. That is the point of having a
    watchdog at all: a thread that pinged unconditionally would only prove that the
    interpreter is alive.

    Example::

        watchdog = Watchdog(healthy=server.is_serving)
        watchdog.start()  # False, and nothing started, outside systemd
        ...
        watchdog.stop()
    """

    def __init__(self, healthy: Callable[[], bool], interval: float | None = None) -> None:
        """Prepare a watchdog; nothing runs until ``start()``.

        Args:
            healthy: called from the watchdog thread every half period; must be quick and
                thread-safe.
            interval: the watchdog period in seconds; by default ``watchdog_interval()``.
        """
        self._healthy = healthy
        self._interval = interval if interval is not None else watchdog_interval()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def interval(self) -> float | None:
        """The watchdog period in seconds, or None when no watchdog is enabled."""
        return self._interval

    def start(self) -> bool:
        """Start pinging.

        Returns:
            True when the thread started (or was already running); False when no watchdog
            is enabled, in which case nothing is started.
        """
        if self._interval is None or self._interval <= 0:
            return False
        if self._thread is not None and self._thread.is_alive():
            return True
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="smddp-sd-watchdog", daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop pinging and wait for the thread to end.

        Args:
            timeout: seconds to wait for the thread; None waits without limit.
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _is_healthy(self) -> bool:
        try:
            return bool(self._healthy())
        except Exception:
            logger.exception("watchdog health check raised; treating the daemon as unhealthy")
            return False

    def _run(self) -> None:
        assert self._interval is not None
        # Half the period, as sd_watchdog_enabled(3) recommends, so one late wake-up is
        # not fatal.
        period = self._interval / 2
        was_healthy = True
        while True:
            healthy = self._is_healthy()
            if healthy:
                notify(WATCHDOG)
                if not was_healthy:
                    logger.warning("daemon healthy again: resuming the systemd watchdog ping")
            elif was_healthy:
                logger.error(
                    "daemon unhealthy: "
                    "withholding the systemd watchdog ping (systemd restarts the service after %.1f s)",  # noqa: E501
                    self._interval,
                )
            was_healthy = healthy
            if self._stop.wait(period):
                return
