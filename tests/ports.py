"""TCP ports for the listeners a test must name in advance (a daemon's ``--http-bind``,
torch's MASTER_PORT), the one helper every test takes them from.

A port taken by ``bind(port 0)`` comes from the kernel's ephemeral range
(net.ipv4.ip_local_port_range), and the kernel hands it out again at once: to the next
``bind(0)`` of any daemon in the run, or as the local end of any outgoing connection. Between
the moment a test picked it and the moment its listener bound it, something else could hold
it, which CI saw twice in one run (torch's TCPStore failing with EADDRINUSE on its MASTER_PORT,
a daemon's HTTP port refusing connections). Below the ephemeral range nothing lands unless
asked by number, and within a run only this module asks.
"""

from __future__ import annotations

import secrets
import socket

SPAN = 12000  # how far below the ephemeral range the ports are drawn from
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int, host: str) -> bool:
    # Both the host asked for and every address: TCPStore listens on all of them.
    for where in {host, ""}:
        with socket.socket() as s:
            try:
                s.bind((where, port))
            except OSError:
                return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port below the ephemeral range that nothing is bound to on ``host`` now, and that this
    process has not handed out before."""
    high = _ephemeral_low()
    low = max(1024, high - SPAN)
    for _ in range(200):
        port = low + secrets.randbelow(high - low)
        if port not in _handed_out and _bindable(port, host):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port on {host} in {low}..{high - 1} after 200 tries")
