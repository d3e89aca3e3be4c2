"""Log lines a client can cause, rate-limited per cause, and log text no client can forge.

A hostile or broken client can make the daemon refuse thousands of requests a minute; each
refusal is worth a line, but not thousands: per cause, the first ``BURST`` lines of a window
of ``WINDOW_S`` are written, and the next line after the window says how many were left out.
Whatever a client sends that reaches a log line passes ``SafeText``, which escapes control
characters, so that a newline in a field cannot start a forged line.
"""

from __future__ import annotations

import logging
import threading
import time

BURST = 10
WINDOW_S = 60.0


class Throttle:
    """Per-cause rate limit of log lines: ``throttle.log(logger, level, cause, msg, *args)``."""

    def __init__(self, burst: int = BURST, window_s: float = WINDOW_S) -> None:
        self.burst = burst
        self.window_s = window_s
        self._windows: dict[str, tuple[float, int]] = {}  # cause -> (window start, lines seen)
        self._lock = threading.Lock()

    def log(
        self,
        logger: logging.Logger,
        level: int,
        cause: str,
        msg: str,
        *args: object,
        **kwargs: object,
    ) -> bool:
        """Logs unless ``cause`` already had its ``burst`` lines in this window.

        Returns:
            True if the line was written.
        """
        now = time.monotonic()
        with self._lock:
            start, seen = self._windows.get(cause, (now, 0))
            dropped = 0
            if now - start >= self.window_s:
                dropped = max(0, seen - self.burst)
                start, seen = now, 0
            seen += 1
            self._windows[cause] = (start, seen)
            if len(self._windows) > 1024:  # causes are ours, but keep the table bounded anyway
                self._windows = {
                    k: v for k, v in self._windows.items() if now - v[0] < self.window_s
                }
        if dropped:
            logger.log(
                level,
                "%s: %d more lines were left out in the previous %.0f s",
                cause,
                dropped,
                self.window_s,
            )
        if seen > self.burst:
            if seen == self.burst + 1:
                logger.log(
                    level,
                    "%s: "
                    "more than %d lines in %.0f s; "
                    "the rest of this minute's are counted, not written",
                    cause,
                    self.burst,
                    self.window_s,
                )
            return False
        logger.log(level, msg, *args, **kwargs)  # type: ignore[arg-type]
        return True


# Refusals of clients' requests, shared by the daemon's edges.
refusals = Throttle()


def escape(text: str) -> str:
    """``text`` with control characters (newlines above all) written as escapes."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class SafeText(logging.Filter):
    """A handler filter that escapes control characters in every record's message.

    The traceback of a record (exc_info) is the daemon's own and keeps its lines.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format: the handler reports it as it always did
            return True
        safe = escape(message)
        if safe is not message:
            record.msg, record.args = safe, None
        return True
