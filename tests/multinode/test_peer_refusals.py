"""A peer that lacks the job token, speaks garbage, disagrees about the job, or sends a chunk of
the wrong size is refused with a reason (issue 3, "Bad input and faults"), and nothing reaches
the job's results.

One real daemon listens for peers on loopback; a real numpy rank registers as the only rank of
node "a" of a two-node communicator, and the test plays node "b" by hand: gRPC calls to the
daemon's Peer service, and raw TCP to its data port.
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import socket
import struct
import threading
import urllib.request

import grpc
import numpy as np
import pytest

from smddp.client.communicator import daemon_info
from smddp.server.peer_wire import (
    FRAME_DATA,
    FRAME_HEARTBEAT,
    HELLO_OK,
    HELLO_REFUSED,
    pack_header,
    pack_hello,
    token_proof,
)
from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc

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
    sock.sendall(pack_hello(JOB, COMM, node, proof))
    status = sock.recv(1)[0]
    (n,) = struct.unpack("!H", sock.recv(2))
    return sock, status, sock.recv(n).decode()


def _peer_service_refusals(address: str) -> None:
    """Join, PeerStatus and Abort without the token, or with a different view of the job."""
    good = pb.PeerRequest(job_id=JOB, comm_id=COMM, node=1, proof=token_proof(TOKEN, JOB, COMM))
    forged = pb.PeerRequest(job_id=JOB, comm_id=COMM, node=1, proof=secrets.token_bytes(32))
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.PeerStub(channel)

        def refused(call, request) -> tuple[grpc.StatusCode, str]:
            with pytest.raises(grpc.RpcError) as info:
                call(request, timeout=10)
            return info.value.code(), info.value.details()

        wrong_token = (grpc.StatusCode.PERMISSION_DENIED, f"wrong job token for job {JOB}")
        assert (
            refused(stub.Join, pb.JoinRequest(peer=forged, node_ids=["a", "b"], transport=pb.TCP))
            == wrong_token
        )
        assert (
            refused(stub.Abort, pb.AbortRequest(peer=forged, kind=pb.ABORTED, message="forged"))
            == wrong_token
        )
        assert refused(stub.PeerStatus, pb.PeerStatusRequest(peer=forged)) == wrong_token
        code, message = refused(
            stub.Join, pb.JoinRequest(peer=good, node_ids=["a", "c"], transport=pb.TCP)
        )
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert (
            message == f"job {JOB} comm {COMM}: node b lists the nodes ['a', 'c'] "
            "where node a lists ['a', 'b']"
        )
        code, message = refused(
            stub.Join, pb.JoinRequest(peer=good, node_ids=["a", "b"], transport=pb.UCX)
        )
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert message.startswith("node b carries data over ucx and node a over tcp")
        code, message = refused(
            stub.Join, pb.JoinRequest(peer=good, node_ids=["a", "b"], transport=pb.TCP)
        )
        assert (code, message) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"job {JOB} comm {COMM}: the node of lower index joins the higher, not node b",
        )
        stranger = pb.PeerRequest(job_id=JOB, comm_id=COMM, node=7, proof=good.proof)
        assert (
            refused(stub.PeerStatus, pb.PeerStatusRequest(peer=stranger))[0]
            == grpc.StatusCode.INVALID_ARGUMENT
        )
        unknown = pb.PeerRequest(job_id="nojob", comm_id=COMM, node=1, proof=good.proof)
        assert refused(stub.Join, pb.JoinRequest(peer=unknown))[0] == grpc.StatusCode.NOT_FOUND
        # The Peer service tells what node a waits for: none of its own ranks. Its only rank,
        # 0, is registered; its all_reduce, once submitted, leaves the node's pending ops at
        # once (every local rank arrived) and waits for node b's data, which PeerStatus does
        # not list (pending ops are the node's own ranks' arrivals).
        status = stub.PeerStatus(pb.PeerStatusRequest(peer=good), timeout=10)
        assert (
            status.node_id,
            status.comm.job_id,
            status.comm.comm_id,
            status.comm.world_size,
        ) == ("a", JOB, COMM, 2)
        assert (status.comm.failed, status.comm.ops_completed) == ("", 0)
        assert [r.rank for r in status.comm.ranks] == [0]
        assert list(status.comm.pending) == []
    # Garbage on the gRPC port: the connection is dropped, the service goes on.
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as junk:
        junk.sendall(secrets.token_bytes(256))
        try:
            while junk.recv(4096):
                pass
        except (ConnectionResetError, TimeoutError):
            pass


@pytest.mark.timeout(90)
def test_peer_without_token_garbage_and_wrong_size_are_refused(start_daemon) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        http = f"127.0.0.1:{probe.getsockname()[1]}"
    # Node b is played by hand as the ring algorithm's first step: pinned, so that the cost
    # model's choice for 32 bytes (recursive doubling, whose first exchange is round 1 of the
    # whole buffer) does not leave the hand-made frame unread.
    daemon = start_daemon(args=("--http-bind", http, "--algo", "ring"))
    info = daemon_info(daemon.socket)
    assert info.peer_transport == pb.TCP
    port = info.data_port
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_rank, args=(daemon.socket, info.peer_address, queue))
    proc.start()
    try:
        assert queue.get(timeout=30) == "registered"

        _peer_service_refusals(info.peer_address)
        # Every answer of the Peer service is counted by method and status.
        metrics = urllib.request.urlopen(f"http://{http}/metrics", timeout=10).read().decode()
        for method, code, count in [
            ("Join", "PERMISSION_DENIED", 1),
            ("Abort", "PERMISSION_DENIED", 1),
            ("PeerStatus", "PERMISSION_DENIED", 1),
            ("Join", "FAILED_PRECONDITION", 2),
            ("Join", "INVALID_ARGUMENT", 1),
            ("Join", "NOT_FOUND", 1),
            ("PeerStatus", "INVALID_ARGUMENT", 1),
            ("PeerStatus", "OK", 1),
        ]:
            line = f'smddp_peer_calls_total{{code="{code}",method="{method}"}} {float(count)}'
            assert line in metrics, f"{line!r} not in:\n" + "\n".join(
                m for m in metrics.splitlines() if "peer_calls" in m
            )

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
        # Node b beats as a real daemon does, so that a slow machine cannot turn the wrong-size
        # error into "silent for 5 s" before the rank's op reads the chunk.
        sending = threading.Lock()
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(1.0):
                with sending:
                    try:
                        sock.sendall(pack_header(FRAME_HEARTBEAT, 1))
                    except OSError:
                        return

        beater = threading.Thread(target=beat, daemon=True)
        beater.start()
        req = pb.OpRequest(
            seq=1, part=0, parts=1, kind=pb.ALL_REDUCE, dtype=pb.FLOAT32, count=8, reduce_op=pb.SUM
        )
        wrong = np.full(3, 100.0, dtype=np.float32)  # node a expects its 4-element segment
        with sending:
            sock.sendall(
                pack_header(
                    FRAME_DATA,
                    1,
                    wrong.nbytes,
                    kind=req.kind,
                    dtype=req.dtype,
                    seq=req.seq,
                    part=req.part,
                    parts=req.parts,
                    count=req.count,
                    reduce_op=req.reduce_op,
                )
                + wrong.tobytes()
            )
        result = queue.get(timeout=30)
        assert result[0] == "error", result
        assert "node b sent 3 elements where this node expected 4" in result[1]
        # Nothing of the bad chunk reached the rank's tensor.
        assert result[2] == list(range(8))
        stop.set()
        beater.join(10)
        sock.close()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
