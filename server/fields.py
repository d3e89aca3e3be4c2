"""What a client's string fields may hold: they are stored, logged and echoed back.

Each check raises InvalidRequest naming the field, and quotes at most a bounded, escaped
prefix of the bad value, so that a refusal can neither flood a log nor forge a line in it.
"""

from __future__ import annotations

import re

from smddp.server.config import NODE_ID
from smddp.server.errors import InvalidRequest

JOB_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
COMM_ID = re.compile(r"^[\x21-\x7e]{1,256}$")
# HOST:PORT, [v6]:PORT, or "none" (a rendezvous arrival from a daemon without peers).
PEER_ADDRESS = re.compile(r"^[A-Za-z0-9._:\[\]%-]{1,300}$")
QUOTED = 64  # characters of a bad value a message quotes


def quote(value: str) -> str:
    """``value``'s first characters, escaped, for a message."""
    return repr(value[:QUOTED]) + ("..." if len(value) > QUOTED else "")


def check_node_id(where: str, field: str, value: str, optional: bool = False) -> None:
    """Raises InvalidRequest unless ``value`` is a node id (or empty, when ``optional``)."""
    if optional and not value:
        return
    if not NODE_ID.match(value):
        raise InvalidRequest(
            f"{where}: "
            f"{field} {quote(value)} ({len(value)} characters) must be 1-253 characters of A-Z a-z 0-9 . "  # noqa: E501
            "_ : "
            "@ + -"
        )


def check_peer_address(where: str, field: str, value: str) -> None:
    """Raises InvalidRequest unless ``value`` looks like HOST:PORT."""
    if not PEER_ADDRESS.match(value):
        raise InvalidRequest(
            f"{where}: {field} {quote(value)} ({len(value)} characters) is not HOST:PORT"
        )
