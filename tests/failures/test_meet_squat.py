"""A stranger on the Peer port cannot stop this node's jobs from meeting.

``Peer.Meet`` answers whoever reaches the peer port (no TLS by default), and a daemon cannot
tell a made-up arrival from a real rank of another node. These tests squat a root daemon's
peer port with Meet calls of made-up jobs and random proofs, as an attacker would, and show:

- the meetings only other daemons' ranks are in stop at ``--max-peer-rendezvous`` (16), each
  call beyond refused with RESOURCE_EXHAUSTED naming the flag, apart from ``--max-jobs``;
- the waiting Meet calls stop at ``--max-pending-rendezvous`` (200) of their own, apart from
  the Node service's Rendezvous calls;
- a stranger who opened a meeting for a real job's id with a wrong proof is told
  PERMISSION_DENIED once the job's own rank on the root's node arrives, and the job meets;
- meanwhile this node's own jobs, and a two-node job whose root-node rank arrived first,
  meet, and health says SERVING; a two-node job whose remote rank arrives first still meets.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
import time
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from smddp.client import rendezvous
from smddp.client.communicator import daemon_info
from smddp.client.errors import ConnectError
from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc

PEER_CAP = 16  # DaemonConfig.max_peer_rendezvous
MEET_SLOTS = 200  # DaemonConfig.max_pending_rendezvous
STRANGER_WORLD = 200  # the largest world the daemons' rendezvous serves: room for many ranks
NODE_SERVICE = "smddp.v1.Node"


def _meet_all(jobs: list[dict[str, Any]]) -> list[Any]:
    """Runs each ``rendezvous(**job)`` in a thread; the layouts (or ConnectErrors) in order."""
    results: list[Any] = [None] * len(jobs)

    def one(i: int) -> None:
        try:
            results[i] = [(n.node_id, n.peer_address, list(n.ranks)) for n in rendezvous(**jobs[i])]
        except ConnectError as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
        time.sleep(0.5)  # in this order: the first named arrives first
    for t in threads:
        t.join(60)
    return results


def _squat_request(job_id: str, rank: int) -> pb.MeetRequest:
    """A stranger's Meet: a made-up proof, asking to wait as long as the daemon allows."""
    return pb.MeetRequest(
        job_id=job_id,
        proof=hashlib.sha256(job_id.encode()).digest(),  # made up, the same for a job's ranks
        rank=rank,
        world_size=STRANGER_WORLD,
        node_id="stranger",
        peer_address="127.0.0.1:1",
        timeout_ms=900_000,
    )


def _squat(stub: pb_grpc.PeerStub, job_id: str, rank: int) -> grpc.Future:
    """Starts a stranger's Meet; the call's future."""
    return stub.Meet.future(_squat_request(job_id, rank), timeout=120)


def _until_waiting(stub: pb_grpc.PeerStub, request: pb.MeetRequest) -> None:
    """Waits until ``request``'s arrival waits at the root: a rank of the same proof that
    gives up at once then finds 2 ranks there (it harms neither, arriving first or not)."""
    probe = pb.MeetRequest()
    probe.CopyFrom(request)
    probe.rank, probe.timeout_ms = request.rank + 1, 1
    deadline = time.monotonic() + 30
    while True:
        with pytest.raises(grpc.RpcError) as info:
            stub.Meet(probe, timeout=10)
        if "(2 of" in (info.value.details() or ""):
            return
        assert time.monotonic() < deadline, f"{request.job_id}: {info.value.details()}"
        time.sleep(0.1)


def _settle(calls: list[grpc.Future], refusals: int) -> list[grpc.RpcError]:
    """Waits until ``refusals`` of ``calls`` ended (the rest wait); returns those errors."""
    deadline = time.monotonic() + 30
    while True:
        done = [c.exception() for c in calls if c.done()]
        if len(done) >= refusals or time.monotonic() > deadline:
            return done
        time.sleep(0.1)


@pytest.mark.timeout(240)
def test_meet_squatter_cannot_block_local_rendezvous(loopback_nodes) -> None:
    nodes = loopback_nodes(2)
    sockets = [n.daemon.socket for n in nodes]
    root, other = (daemon_info(s).peer_address for s in sockets)
    token = secrets.token_bytes(16)

    def job(job_id: str, rank: int, world_size: int, on: int, **kw: Any) -> dict[str, Any]:
        return {
            "job_id": job_id, "job_token": token, "rank": rank, "world_size": world_size,
            "socket_path": sockets[on], "timeout_s": 30.0, **kw,
        }  # fmt: skip

    two_nodes = [("node0", root, [0]), ("node1", other, [1])]
    # Before any squatting: a two-node job whose remote rank reaches the root first meets
    # (a meeting only another daemon's rank is in, until rank 0 comes).
    assert _meet_all(
        [job("remote-first", 1, 2, 1, root=root), job("remote-first", 0, 2, 0, root=root)]
    ) == [two_nodes, two_nodes]

    channel = grpc.insecure_channel(root)
    stub = pb_grpc.PeerStub(channel)
    try:
        # A stranger opens a meeting for a real job's id (with a made-up proof), then 63 more
        # for made-up ids (the repro's 64, which filled --max-jobs before), then 10 beyond.
        request = _squat_request("real-job", 0)
        hijack = stub.Meet.future(request, timeout=120)
        _until_waiting(stub, request)
        squats = {f"squat-{i}": _squat(stub, f"squat-{i}", 0) for i in range(73)}
        refused = _settle(list(squats.values()), 73 - (PEER_CAP - 1))
        assert not hijack.done(), hijack.exception()
        assert len(refused) == 73 - (PEER_CAP - 1), len(refused)
        for err in refused:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            assert (
                "rendezvous that only other daemons' ranks are in (--max-peer-rendezvous 16)"
                in err.details()
            ), err.details()
        print("stranger refused:", refused[0].details())
        waiting = [j for j, c in squats.items() if not c.done()]
        assert len(waiting) == PEER_CAP - 1

        # This node's own job meets, and so does the real two-node job whose root-node rank
        # comes first: the stranger who took its id is told it has the wrong token.
        assert _meet_all([job("local-job", 0, 2, 0), job("local-job", 1, 2, 0)]) == [[], []]
        assert _meet_all(
            [job("real-job", 0, 2, 0, root=root), job("real-job", 1, 2, 1, root=root)]
        ) == [two_nodes, two_nodes]
        err = hijack.exception(timeout=10)
        assert err is not None and err.code() == grpc.StatusCode.PERMISSION_DENIED, err
        assert "the root's own ranks win, so those have the wrong job token" in err.details()
        print("hijacker told:", err.details())

        # The stranger now fills the waiting Meet calls: 200 wait, the rest are refused, and
        # they take nothing from this node's own Rendezvous calls.
        more = [_squat(stub, waiting[0], r) for r in range(1, MEET_SLOTS - len(waiting) + 1)]
        more += [_squat(stub, waiting[1], r) for r in range(1, 6)]
        slots_refused = _settle(more, 5)
        assert len(slots_refused) == 5, [e.details() for e in slots_refused]
        for err in slots_refused:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            # Which 5 of the 190 find no slot is the order they reach the daemon in.
            assert re.fullmatch(
                r"rendezvous of job squat-\d+: the daemon already has 200 waiting Meet calls "
                r"from other daemons \(--max-pending-rendezvous 200\)",
                err.details(),
            ), err.details()
        assert _meet_all([job("beside", 0, 2, 0), job("beside", 1, 2, 0)]) == [[], []]
        with grpc.insecure_channel("unix:" + sockets[0]) as local:
            health = health_pb2_grpc.HealthStub(local).Check(
                health_pb2.HealthCheckRequest(service=NODE_SERVICE), timeout=10
            )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        channel.close()
