"""Clients that open a daemon's sockets and then stall cannot take what other jobs need.

Against a real daemon, each attack is one a red-team pass found to work before:

- gRPC Ops streams that never send their first message: each held a gRPC thread outside the
  ``--max-op-streams`` bound, until Register and health timed out;
- connections to the peer data port that trickle their HELLO a byte at a time: each held a
  thread and a descriptor with no count and no overall deadline, until the daemon ran out
  of descriptors and said NOT_SERVING;
- an attach whose memfd the kernel could not pass (out of descriptors): it was refused as
  if the rank had sent none.

Each test shows the attack bounded, health and a real job beside it unaffected, and the
daemon's threads back near where they were once the attacker leaves.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2
from test_limits import SERVING, node_health, pair_all_reduce, register, stub

from smddp.core.wire import DATA_SOCKET_SUFFIX, MAX_MESSAGE_BYTES, MSG_ATTACH, pack, unpack
from smddp.server.peer_wire import HELLO
from smddp.server.tcp_transport import MAX_HANDSHAKING
from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc


def threads(pid: int) -> int:
    """The daemon's thread count now."""
    return len(os.listdir(f"/proc/{pid}/task"))


def settles(pid: int, at_most: int, within_s: float) -> int:
    """Waits until the daemon has at most ``at_most`` threads; returns the last count."""
    deadline = time.monotonic() + within_s
    while (count := threads(pid)) > at_most and time.monotonic() < deadline:
        time.sleep(0.1)
    return count


@pytest.mark.timeout(120)
def test_silent_ops_streams_count_against_their_bound(start_daemon):
    d = start_daemon(args=("--max-op-streams", "8"), name="streams")
    baseline = threads(d.proc.pid)
    channel = grpc.insecure_channel("unix:" + d.socket)
    release = threading.Event()

    def silence() -> Iterator[pb.OpRequest]:
        release.wait()  # never a first message while the attack lasts
        return
        yield  # a generator

    calls = [pb_grpc.NodeStub(channel).Ops(silence()) for _ in range(24)]
    # 8 are held, the other 16 refused at once, naming the bound.
    deadline = time.monotonic() + 30
    refused: list[str] = []
    while len(refused) < 16 and time.monotonic() < deadline:
        refused = [c.details() for c in calls if c.done() and c.code() != grpc.StatusCode.OK]
        time.sleep(0.1)
    assert len(refused) == 16, f"{len(refused)} of 24 silent streams refused: {refused}"
    assert set(refused) == {
        "an Ops stream: the daemon already has 8 gRPC Ops streams (--max-op-streams 8)"
    }, set(refused)
    assert all(c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in calls if c.done())
    # Health, Register and a real job answer meanwhile.
    start = time.monotonic()
    assert node_health(channel) == SERVING
    stub(d.socket).Register(register(d.socket, job_id="beside-silent-streams"), timeout=5)
    print(f"health and Register answered in {time.monotonic() - start:.2f} s")
    pair_all_reduce(d.socket, "job-beside-silent-streams")
    # The attacker leaves: its slots are free again, and a second wave of the same attack
    # finds the same bound with no more threads (gRPC's pool keeps its idle workers).
    release.set()
    for c in calls:
        c.cancel()
    after_first = threads(d.proc.pid)
    release.clear()
    deadline = time.monotonic() + 30
    while True:
        again = [pb_grpc.NodeStub(channel).Ops(silence()) for _ in range(24)]
        time.sleep(1.0)
        refused = [c for c in again if c.done()]
        if len(refused) == 16 or time.monotonic() > deadline:
            break
        for c in again:  # the first wave's slots were not all free yet
            c.cancel()
    assert len(refused) == 16, f"{len(refused)} of the second wave refused"
    assert threads(d.proc.pid) <= max(after_first, baseline + 24 + 4), (
        f"{threads(d.proc.pid)} threads in the second wave, {after_first} after the first "
        f"({baseline} before any)"
    )
    release.set()
    for c in again:
        c.cancel()
    channel.close()


def _peer_data_port(line: str) -> int:
    found = re.search(r"peer data tcp 127\.0\.0\.1:(\d+)", line)
    assert found, f"no peer data listener on the startup line: {line}"
    return int(found[1])


def _closed_by_daemon(sock: socket.socket) -> bool:
    """True when the daemon has closed (or reset) its end of ``sock``."""
    try:
        sock.recv(64, socket.MSG_DONTWAIT)  # b"" (closed), or a refusal before the close
    except BlockingIOError:
        return False  # open, nothing said
    except OSError:
        pass  # reset
    return True


@pytest.mark.timeout(120)
def test_trickled_hellos_on_the_data_port_are_bounded_and_cut(start_daemon):
    d = start_daemon(name="trickle")
    port = _peer_data_port(d.serving_line())
    baseline = threads(d.proc.pid)
    opened = MAX_HANDSHAKING + 16
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(opened)]
    for s in socks:
        # Blocking, so that a MSG_DONTWAIT read answers at once (with a timeout set, Python
        # waits up to it for the data a non-blocking read would not).
        s.settimeout(None)
    try:
        hello = HELLO.pack(b"SMDH", 200, 1, 0)  # announces a job id it then trickles
        start = time.monotonic()
        for s in socks:
            s.sendall(hello)
        # Past MAX_HANDSHAKING in their handshake, a new connection is closed at once.
        time.sleep(1.0)
        cut_at_once = sum(_closed_by_daemon(s) for s in socks)
        assert cut_at_once >= opened - MAX_HANDSHAKING, (
            f"{cut_at_once} of {opened} connections closed at once (at most {MAX_HANDSHAKING} "
            "may be in their handshake)"
        )
        assert threads(d.proc.pid) <= baseline + MAX_HANDSHAKING + 4
        # Health and a real job answer meanwhile.
        with grpc.insecure_channel("unix:" + d.socket) as channel:
            assert node_health(channel) == SERVING
        pair_all_reduce(d.socket, "job-beside-trickle")
        # A byte a second keeps no connection past the HELLO's overall deadline (5 s).
        while time.monotonic() - start < 12:
            for s in socks:
                try:
                    s.send(b"j")
                except OSError:
                    pass
            time.sleep(1.0)
        still_open = [s for s in socks if not _closed_by_daemon(s)]
        assert not still_open, f"{len(still_open)} trickling connections still open after 12 s"
    finally:
        for s in socks:
            s.close()
    count = settles(d.proc.pid, baseline + 2, 30)
    assert count <= baseline + 2, f"{count} threads after the connections left ({baseline})"
    with grpc.insecure_channel("unix:" + d.socket) as channel:
        assert node_health(channel) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.timeout(60)
def test_an_attach_whose_descriptors_were_cut_says_so(start_daemon):
    """An AttachRequest with more descriptors than a message may carry arrives with them cut
    (MSG_CTRUNC, as when the daemon is out of descriptors): the refusal says that, not that
    the rank sent the wrong number; none of them stays open in the daemon."""
    d = start_daemon(name="ctrunc")
    reg = stub(d.socket).Register(register(d.socket, job_id="ctrunc"), timeout=10)
    before = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
    fds = [os.memfd_create(f"smddp-ctrunc-{i}") for i in range(5)]
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(10)
        s.connect(d.socket + DATA_SOCKET_SUFFIX)
        req = pb.AttachRequest(session_id=reg.session_id, session_secret=reg.session_secret)
        socket.send_fds(s, [pack(MSG_ATTACH, req.SerializeToString())], fds)
        reply = pb.AttachReply.FromString(unpack(s.recv(MAX_MESSAGE_BYTES))[1])
        s.close()
    finally:
        for fd in fds:
            os.close(fd)
    assert not reply.ok
    assert "did not arrive (MSG_CTRUNC)" in reply.error, reply.error
    print(reply.error)
    deadline = time.monotonic() + 10
    while len(os.listdir(f"/proc/{d.proc.pid}/fd")) > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(os.listdir(f"/proc/{d.proc.pid}/fd")) <= before
