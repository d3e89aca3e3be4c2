"""Reading a test's smddpd log: the "smddpd serving" line, once it is there.

The daemon reports SERVING (health) a moment before it logs that line, so a test that reads
its log right after seeing SERVING can find it missing; under load CI did. This waits for it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable


def serving_line(log: Callable[[], str], running: Callable[[], bool], timeout_s: float = 60) -> str:
    """The daemon's "smddpd serving" line, waited for while it runs (``running``), at most
    ``timeout_s``; AssertionError with the log when it never comes."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = log()
        found = next((x for x in text.splitlines() if "smddpd serving" in x), None)
        if found is not None:
            return found
        if not running() or time.monotonic() > deadline:
            raise AssertionError(f"smddpd logged no serving line:\n{text}")
        time.sleep(0.02)


def http_port(line: str) -> int:
    """The port of the HTTP listener a "smddpd serving" line names (a daemon started with
    ``--http-bind 127.0.0.1:0``: a port picked free by the test and bound by the daemon later
    could be taken in between)."""
    found = re.search(r"listening: .*\bHTTP [^,\s]*:(\d+)", line)
    assert found, f"smddpd logged no HTTP listener: {line}"
    return int(found[1])
