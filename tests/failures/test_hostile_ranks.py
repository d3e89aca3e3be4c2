"""A rank of a job may misuse its own data-socket connection; the daemon stays bounded.

The attacks a red team found, against a real daemon, each with rank 1 of a two-rank job
absent and the job's timeout at an hour (so nothing ends them early):

- peer-arenas requests: each used to start a thread that waited for rank 1 until that hour
  was over, however many one connection sent, and whether its rank was still there or not.
  Now a connection has one in flight at most (a second closes it), and the wait ends with
  the rank.
- ops far ahead of the other ranks: each used to be held until the timeout, without limit
  (about 1 KiB apiece). Now the communicator fails at ``--max-pending-ops`` with a message
  naming the job, the rank, the op and the limit, every rank gets it, and the daemon holds
  nothing of it; another job on the daemon runs on.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable

import pytest
from test_limits import _attach, pair_all_reduce, register, rss_mb, stub

from smddp.client.arena import ClientArena
from smddp.core.wire import MAX_MESSAGE_BYTES, MSG_OP, MSG_OP_REPLY, MSG_PEER_ARENAS, pack, unpack
from smddp.server import config
from smddp.v1 import smddp_pb2 as pb

HOUR_MS = 3_600_000  # the job timeout the attacker picks: nothing may wait on it


def threads(pid: int) -> int:
    """The daemon's thread count."""
    return len(os.listdir(f"/proc/{pid}/task"))


def wait_threads(pid: int, ok: Callable[[int], bool], timeout_s: float) -> tuple[int, float]:
    """Waits until the daemon's thread count satisfies ``ok``; returns it and how long that
    took (``timeout_s`` and the last count when it never did)."""
    start = time.monotonic()
    while True:
        n = threads(pid)
        took = time.monotonic() - start
        if ok(n) or took > timeout_s:
            return n, took
        time.sleep(0.05)


def attached_rank(path: str, job: str, token: bytes, rank: int = 0) -> socket.socket:
    """Registers ``rank`` of a two-rank job that times out after an hour and attaches it."""
    reg = stub(path).Register(
        register(path, job_id=job, job_token=token, rank=rank, world_size=2, timeout_ms=HOUR_MS),
        timeout=10,
    )
    arena = ClientArena(1 << 20)
    s, reply = _attach(path, reg, arena.fd)
    assert reply.ok, reply.error
    return s


@pytest.mark.timeout(120)
def test_peer_arenas_requests_hold_one_thread_per_connection_and_end_with_it(start_daemon):
    d = start_daemon(name="arenas")
    pid = d.proc.pid

    # 1. One request, as the client sends it; rank 1 never comes. When the rank's connection
    # closes, the thread that waits for rank 1 ends at once, not an hour later.
    s = attached_rank(d.socket, "one-ask", secrets.token_bytes(32))
    time.sleep(0.3)  # the connection's own thread has started
    connected = threads(pid)
    s.sendall(pack(MSG_PEER_ARENAS, b""))
    n, _ = wait_threads(pid, lambda n: n > connected, 5)
    assert n == connected + 1, f"{n} threads after one peer-arenas request, {connected} before"
    s.close()
    n, took = wait_threads(pid, lambda n: n <= connected - 1, 5)
    print(f"one waiter: {connected + 1} -> {n} threads {took:.2f} s after the rank closed")
    assert n <= connected - 1, (
        f"{n} daemon threads 5 s after the rank closed its connection, {connected} with it "
        "connected and idle: its peer-arenas waiter outlived it"
    )
    assert took < 2.0, took

    # 2. A thousand requests on one connection: the second one closes it.
    s = attached_rank(d.socket, "flood", secrets.token_bytes(32))
    time.sleep(0.3)
    connected = threads(pid)
    sent = 0
    try:
        for _ in range(1000):
            s.sendall(pack(MSG_PEER_ARENAS, b""))
            sent += 1
    except OSError:
        pass  # the daemon closed the connection
    peak, until = connected, time.monotonic() + 1.0
    while time.monotonic() < until:
        peak = max(peak, threads(pid))
        time.sleep(0.02)
    print(f"{sent} peer-arenas requests sent: {connected} -> {peak} threads")
    assert peak <= connected + 1, f"{peak} daemon threads after {sent} requests, {connected} before"
    s.settimeout(10)
    while True:  # perhaps the first request's refusal, then the end
        msg = s.recv(MAX_MESSAGE_BYTES)
        if not msg:
            break
    s.close()
    n, took = wait_threads(pid, lambda n: n <= connected - 1, 5)
    print(f"{n} threads {took:.2f} s after the daemon closed the flooding connection")
    assert n <= connected - 1, (n, connected)
    assert (
        "disconnected without leaving the communicator (a second peer-arenas request on the "
        "data socket before the first was answered (one at a time))"
    ) in d.log(), d.log()[-3000:]

    # The real client, which asks once and waits, still gets its peers' arenas and runs.
    pair_all_reduce(d.socket, "beside-arenas")


def _collect_replies(s: socket.socket, want: int, into: list[pb.OpReply]) -> None:
    s.settimeout(20)
    try:
        while len(into) < want:
            msg = s.recv(MAX_MESSAGE_BYTES)
            if not msg:
                return
            kind, payload = unpack(msg)
            assert kind == MSG_OP_REPLY, kind
            into.append(pb.OpReply.FromString(payload))
    except TimeoutError:
        return


def _barrier(seq: int) -> bytes:
    req = pb.OpRequest(request_id=seq, seq=seq, part=0, parts=1, kind=pb.BARRIER)
    return pack(MSG_OP, req.SerializeToString())


@pytest.mark.timeout(120)
def test_a_rank_racing_ahead_fails_its_communicator_at_the_limit(start_daemon, ctl_status):
    assert config.load([], {}).max_pending_ops == 4096
    assert config.load([], {"SMDDP_MAX_PENDING_OPS": "8"}).max_pending_ops == 8
    limit = 64
    d = start_daemon(args=("--max-pending-ops", str(limit)), name="pending")
    token = secrets.token_bytes(32)
    s0 = attached_rank(d.socket, "racer", token, 0)
    s1 = attached_rank(d.socket, "racer", token, 1)
    before = rss_mb(d.proc.pid)

    # Rank 1 is attached but sends nothing; rank 0 sends barriers #1..#5000.
    n = 5000
    replies: list[pb.OpReply] = []
    reader = threading.Thread(target=_collect_replies, args=(s0, n, replies))
    reader.start()
    for seq in range(1, n + 1):
        s0.sendall(_barrier(seq))
    reader.join(30)
    after = rss_mb(d.proc.pid)
    print(f"daemon RSS {before:.0f} MB before, {after:.0f} MB after {n} barriers")
    assert len(replies) == n, (
        f"{len(replies)} replies to {n} barriers of a rank whose peer never sent one: the daemon "
        "holds them all"
    )
    assert not any(r.ok for r in replies)
    errors = {r.error for r in replies}
    assert len(errors) == 1, errors
    message = errors.pop()
    print(message)
    assert re.fullmatch(
        rf"job racer comm 0: rank 0 \(pid {os.getpid()}, node limits\) sent barrier\(\) as op "
        rf"#{limit + 1} chunk 0 while {limit} op chunks already wait for other ranks \(the "
        rf"oldest, op #1, for rank 1\): past the limit of {limit} pending op chunks per "
        r"communicator \(--max-pending-ops, SMDDP_MAX_PENDING_OPS\); a rank runs too far ahead "
        r"of the others",
        message,
    ), message
    assert {r.error_kind for r in replies} == {pb.INVALID}

    # The other rank gets the same error at its next op; the daemon holds no op of the job.
    got: list[pb.OpReply] = []
    s1.sendall(_barrier(1))
    _collect_replies(s1, 1, got)
    assert [(r.ok, r.error) for r in got] == [(False, message)]
    (comm,) = [c for c in ctl_status(d.socket)["comms"] if c["job_id"] == "racer"]
    assert comm["failed"] == message and comm.get("pending", []) == [], comm
    assert message in d.log()
    assert after - before < 50, (before, after)

    # Another job on the same daemon runs as before.
    pair_all_reduce(d.socket, "beside-racer")
    s0.close()
    s1.close()
