"""What travels on a data connection between node daemons: the HELLO that opens it, the
frames that follow, and the token proof both carry.

One module holds the byte layout, so that the sender (``peer_transport``), the acceptor
(``tcp_transport``, ``ucx_transport``) and the tests that speak to a daemon by hand pack and
parse it the same way.

A connection opens with HELLO (magic, job and comm id lengths, the caller's node index, then
the ids and the 32-byte HMAC proof of the job's token) and the acceptor's answer (a status
byte, a length-prefixed message). Frames then flow both ways: DATA (a header and the chunk's
bytes, received straight into a buffer), HEARTBEAT and BYE.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from smddp.core.op import OpSpec
from smddp.server.domain import spec_signature

FRAME_DATA = 1
FRAME_HEARTBEAT = 3
FRAME_BYE = 4  # the sender's ranks have all left; its EOF that follows is not a failure

# magic, type, kind, dtype, reserved (0; it carried an ABORT frame's error kind before aborts
# moved to the Peer service), seq, part, parts, round, src rank, dst rank, count, root, reduce
# op, payload bytes, source node, tag (a SEND's; 0 in other frames)
HEADER = struct.Struct("!4sBBBBQIIIiiQiIQIq")
MAGIC = b"SMDP"
HELLO = struct.Struct("!4sHHI")
HELLO_MAGIC = b"SMDH"
# Job and communicator ids are at most 256 characters (the registry checks), 1 KiB in
# UTF-8; a HELLO announcing longer ones is no smddp peer's.
MAX_HELLO_NAME_BYTES = 1024
HELLO_OK, HELLO_RETRY, HELLO_REFUSED = 0, 1, 2
PROOF_BYTES = 32
MAX_PAYLOAD = 1 << 34


class Connection(Protocol):
    """What a data connection offers: a TCP socket, a ``TlsSocket`` or a ``UcxConnection``."""

    def settimeout(self, seconds: float | None) -> None: ...
    def sendall(self, data: bytes | bytearray | memoryview) -> None: ...
    def recv_into(self, view: memoryview) -> int: ...
    def shutdown(self, how: int) -> None: ...
    def close(self) -> None: ...


# How a transport hands an accepted connection over: the connection and who it came from.
OnConnection = Callable[[Connection, str], None]


@dataclass
class Frame:
    """One received frame: its header fields and payload."""

    ftype: int
    kind: int
    dtype: int
    seq: int
    part: int
    parts: int
    round: int
    src_rank: int
    dst_rank: int
    count: int
    root: int
    reduce_op: int
    src_node: int
    payload: np.ndarray
    tag: int = 0  # a SEND's tag, which a receive from any source matches on
    arrived: float = 0.0  # time.monotonic() when the receiving daemon had it whole

    @property
    def op(self) -> OpSpec:
        """The op the frame belongs to, as its sender's request described it."""
        return OpSpec(self.kind, self.dtype, self.count, self.root, self.reduce_op, self.tag)

    def signature(self) -> tuple[int, ...]:
        """What must agree between nodes for the frame to belong to this node's op."""
        return spec_signature(self.op, self.parts)


def token_proof(token: bytes, job_id: str, comm_id: str) -> bytes:
    """What a connecting daemon shows to prove it knows the job's token."""
    return hmac.new(token, f"smddp-peer-v1/{job_id}/{comm_id}".encode(), hashlib.sha256).digest()


def pack_header(
    ftype: int,
    src_node: int,
    nbytes: int = 0,
    *,
    kind: int = 0,
    dtype: int = 0,
    seq: int = 0,
    part: int = 0,
    parts: int = 0,
    round_: int = 0,
    src_rank: int = -1,
    dst_rank: int = -1,
    count: int = 0,
    root: int = 0,
    reduce_op: int = 0,
    tag: int = 0,
) -> bytes:
    """One frame's header; ``nbytes`` of payload follow it."""
    return HEADER.pack(
        MAGIC, ftype, kind, dtype, 0, seq, part, parts, round_,
        src_rank, dst_rank, count, root, reduce_op, nbytes, src_node, tag,
    )  # fmt: skip


def unpack_header(data: bytes) -> tuple[Frame, int]:
    """A header's fields as a Frame without payload, and the payload's size in bytes.

    Raises:
        ConnectionError: not a frame header (wrong magic or an impossible size).
    """
    (magic, ftype, kind, dtype, _reserved, seq, part, parts, round_, src_rank, dst_rank,
     count, root, reduce_op, nbytes, src_node, tag) = HEADER.unpack(data)  # fmt: skip
    if magic != MAGIC or nbytes > MAX_PAYLOAD:
        raise ConnectionError("malformed frame header")
    empty = np.empty(0, dtype=np.uint8)
    frame = Frame(
        ftype, kind, dtype, seq, part, parts, round_, src_rank, dst_rank,
        count, root, reduce_op, src_node, empty, tag,
    )  # fmt: skip
    return frame, nbytes


def pack_hello(job_id: str, comm_id: str, node: int, proof: bytes) -> bytes:
    """The HELLO that opens a data connection from node index ``node``."""
    job, comm = job_id.encode(), comm_id.encode()
    return HELLO.pack(HELLO_MAGIC, len(job), len(comm), node) + job + comm + proof


@dataclass(frozen=True)
class Hello:
    """A parsed HELLO."""

    job_id: str
    comm_id: str
    node: int
    proof: bytes


def read_hello(sock: Connection, deadline: float | None = None) -> Hello:
    """Reads the HELLO an accepted connection opens with, all of it before ``deadline`` (a
    ``time.monotonic()`` value; None: each read within the socket's timeout).

    A whole HELLO has a deadline, not just each read: a client sending a byte every few
    seconds would otherwise hold an accepting thread for as long as it likes.

    Raises:
        ConnectionError: not an smddp peer (a TLS client on a plain listener says so), or a
            name longer than any job's or communicator's.
        TimeoutError: the HELLO did not arrive whole before ``deadline``.
        OSError, UnicodeDecodeError, struct.error: a broken or malformed HELLO.
    """
    magic, job_len, comm_len, node = HELLO.unpack(recv_exact(sock, HELLO.size, deadline))
    if magic != HELLO_MAGIC:
        tls_hint = (
            " (it speaks TLS: this daemon has no --tls-cert)" if magic[:2] == b"\x16\x03" else ""
        )
        raise ConnectionError(f"not an smddp peer{tls_hint}")
    if max(job_len, comm_len) > MAX_HELLO_NAME_BYTES:
        raise ConnectionError(
            f"a HELLO naming a job or communicator of {max(job_len, comm_len)} bytes (at most {MAX_HELLO_NAME_BYTES}): "  # noqa: E501
            "not an smddp peer"
        )
    job_id = recv_exact(sock, job_len, deadline).decode()
    comm_id = recv_exact(sock, comm_len, deadline).decode()
    return Hello(job_id, comm_id, node, recv_exact(sock, PROOF_BYTES, deadline))


def pack_answer(status: int, message: str) -> bytes:
    """The acceptor's answer to a HELLO: a status byte and a length-prefixed message."""
    data = message.encode()
    return bytes([status]) + struct.pack("!H", len(data)) + data


def answer(sock: Connection, status: int, message: str) -> None:
    """Sends the answer to a HELLO."""
    sock.sendall(pack_answer(status, message))


def read_answer(sock: Connection) -> tuple[int, str]:
    """Reads the acceptor's answer to our HELLO: its status and message."""
    status = recv_exact(sock, 1)[0]
    (n,) = struct.unpack("!H", recv_exact(sock, 2))
    return status, recv_exact(sock, n).decode(errors="replace")


def recv_into(sock: Connection, view: memoryview, deadline: float | None = None) -> None:
    """Fills ``view`` from ``sock``; raises ConnectionError if the peer closes first.

    ``deadline``: a ``time.monotonic()`` value by which all of it must have arrived (each
    read then waits at most until it; TimeoutError past it). None: the socket's timeout
    holds for each read.
    """
    got, n = 0, len(view)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{got} of {n} bytes arrived in time")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed by the peer")
        got += k


def recv_exact(sock: Connection, n: int, deadline: float | None = None) -> bytes:
    """Exactly ``n`` bytes from ``sock`` (before ``deadline``, as ``recv_into``)."""
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` to a tuple (``[v6]:PORT`` too)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)
