"""The ``smddpd`` command: configuration, logging, signals, serve until told to stop."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time

from smddp.server import config as config_mod
from smddp.server.daemon import Daemon
from smddp.server.gpu_supply import RuntimeFactory
from smddp.server.logthrottle import SafeText


class JsonFormatter(logging.Formatter):
    """One JSON object per line, with the job and rank when a record carries them."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("job", "comm", "rank", "node"):
            if hasattr(record, key):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str, fmt: str) -> None:
    """Logs to stderr (journald and kubectl logs pick it up there)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s smddpd %(levelname)s %(name)s: %(message)s")
        )
    # Clients' strings reach messages: a newline among them must not start a forged line.
    handler.addFilter(SafeText())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def main(argv: list[str] | None = None, gpu_runtime: RuntimeFactory | None = None) -> int:
    """Runs smddpd until SIGTERM or SIGINT.

    Args:
        argv: the command line after the program's name (``sys.argv[1:]`` when None).
        gpu_runtime: the CUDA runtime's factory for the daemon's GPU ops; CuPy's when None
            (the ``smddpd`` command). Tests pass a fake one (``tests/gpu/fake_smddpd.py``).

    Returns:
        The process exit status.
    """
    cfg = config_mod.load(argv)
    setup_logging(cfg.log_level, cfg.log_format)
    daemon = Daemon(cfg, gpu_runtime=gpu_runtime)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logging.getLogger(__name__).info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        daemon.start()
    except (OSError, RuntimeError, KeyError) as exc:
        logging.getLogger(__name__).error("cannot start: %s", exc)
        return 1
    while not stop.is_set() and not daemon.stopped.is_set():
        stop.wait(0.5)
    daemon.stop()
    return 0
