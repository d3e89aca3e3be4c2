"""A peer connection that lacks the job token, speaks garbage, or sends a chunk of the wrong size is
refused with a reason (issue 3, "Bad input and faults"), and nothing reaches the job's results.

One real daemon listens for peers on loopback; a real numpy rank registers as the only rank of
node "a" of a two-node communicator, and the test plays node "b" by hand over raw TCP.
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import socket
import struct

import numpy as np
import pytest

from smddp.client.communicator import daemon_info
from smddp.server.peer_transport import (
    FRAME_DATA,
    HEADER,
    HELLO,
    HELLO_MAGIC,
    HELLO_OK,
    HELLO_REFUSED,
    MAGIC,
    token_proof,
)
from smddp.v1 import smddp_pb2 as pb

JOB, COMM = "jpeer", "0"
TOKEN = b"t" * 32


def _rank(socket_path: str, peer_address: str, queue: mp.Queue) -> None:
    """Rank 0 of a 2-rank, 2-node communicator; rank 1 is node b, played by the test."""
    from smddp.client import connect

    nodes = [
        pb.NodeSpec(node_id="a", peer_address=peer_address, ranks=[0]),
        pb.NodeSpec(node_id="b", peer_address="127.0.0.1:9", ranks=[1]),
    ]
    comm = connect(JOB, TOKEN, 0, 2, socket_path=socket_path, nodes=nodes, timeout_s=30)
    queue.put("registered")
    data = np.arange(8, dtype=np.float32)
    try:
        comm.all_reduce(data).wait()
        queue.put(("ok", data.tolist()))
    except Exception as exc:  # the test expects the op to fail
        queue.put(("error", str(exc), data.tolist()))


def _hello(port: int, proof: bytes, node: int = 1) -> tuple[socket.socket, int, str]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    job, comm = JOB.encode(), COMM.encode()
    sock.sendall(HELLO.pack(HELLO_MAGIC, len(job), len(comm), node) + job + comm + proof)
    status = sock.recv(1)[0]
    (n,) = struct.unpack("!H", sock.recv(2))
    return sock, status, sock.recv(n).decode()


@pytest.mark.timeout(90)
def test_peer_without_token_garbage_and_wrong_size_are_refused(daemon) -> None:
    info = daemon_info(daemon.socket)
    port = int(info.peer_address.rsplit(":", 1)[1])
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_rank, args=(daemon.socket, info.peer_address, queue))
    proc.start()
    try:
        assert queue.get(timeout=30) == "registered"

        # Garbage instead of a handshake: the daemon closes the connection.
        junk = socket.create_connection(("127.0.0.1", port), timeout=10)
        junk.sendall(secrets.token_bytes(64))
        try:  # closed with our garbage unread, the kernel may answer with a reset
            closed = junk.recv(64) == b""
        except ConnectionResetError:
            closed = True
        assert closed
        junk.close()

        # A handshake without the job's token: refused, saying why.
        sock, status, message = _hello(port, secrets.token_bytes(32))
        assert status == HELLO_REFUSED
        assert message == f"wrong job token for job {JOB}"
        sock.close()

        # With the token, but a chunk of the wrong size for the op: the job fails, naming it.
        sock, status, message = _hello(port, token_proof(TOKEN, JOB, COMM))
        assert (status, message) == (HELLO_OK, "")
        req = pb.OpRequest(seq=1, part=0, parts=1, kind=pb.ALL_REDUCE, dtype=pb.FLOAT32, count=8, reduce_op=pb.SUM)
        wrong = np.full(3, 100.0, dtype=np.float32)  # node a expects its 4-element segment
        sock.sendall(
            HEADER.pack(MAGIC, FRAME_DATA, req.kind, req.dtype, 0, req.seq, req.part, req.parts, 0,
                        -1, -1, req.count, 0, req.reduce_op, wrong.nbytes, 1)
            + wrong.tobytes()
        )
        result = queue.get(timeout=30)
        assert result[0] == "error", result
        assert "node b sent 3 elements where this node expected 4" in result[1]
        # Nothing of the bad chunk reached the rank's tensor.
        assert result[2] == list(range(8))
        sock.close()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
