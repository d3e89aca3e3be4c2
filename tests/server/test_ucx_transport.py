"""Tests for smddp.server.ucx_transport over real UCX (TCP transport on loopback).

Two nodes in this process talk to each other for most tests; a peer in a subprocess (``PEER``)
stands in where a process must die or where the bytes must cross processes. UCX reads
``UCX_TLS`` when a node creates its context, so the fixture sets it first.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

# ucxx comes with the test extras (scripts/setup.sh): where it is missing or broken, this module
# fails to import with ucxx's own error instead of skipping (ucx_transport would only say why).
import ucxx._lib.libucxx  # noqa: F401
from ports import free_port

from smddp.server import ucx_transport as ut

pytestmark = pytest.mark.timeout(60)

LENGTH = struct.Struct("!Q")
# Like peer_transport's frame header: magic, type, payload bytes.
HEADER = struct.Struct("!4sBQ")
BIG = 64 << 20

# A node in another process. "echo": accepts one connection and sends every length-prefixed
# message back until the connection ends. "hold": accepts one connection and waits to be killed.
PEER = """
import queue, struct, sys
import numpy as np
from smddp.server import ucx_transport as ut
LENGTH = struct.Struct("!Q")
accepted = queue.Queue()
node = ut.UcxNode(0, lambda conn, peer: accepted.put(conn))
print(node.port, flush=True)
conn = accepted.get(timeout=30)
print("accepted", flush=True)
if sys.argv[1] == "echo":
    head = bytearray(LENGTH.size)
    while True:
        try:
            conn.recv_into(memoryview(head))
        except ConnectionError:
            break
        (n,) = LENGTH.unpack(head)
        payload = np.empty(n, dtype=np.uint8)
        conn.recv_into(memoryview(payload))
        conn.sendall(head)
        conn.sendall(memoryview(payload))
    conn.close()
    node.stop()
else:
    sys.stdin.read()
"""


@pytest.fixture
def make_node(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[..., tuple[ut.UcxNode, queue.Queue]]]:
    """Starts nodes on ephemeral ports, each with the queue of (connection, peer) it accepts."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    nodes: list[ut.UcxNode] = []

    def make(
        on_connection: Callable[[ut.UcxConnection, str], None] | None = None,
    ) -> tuple[ut.UcxNode, queue.Queue]:
        accepted: queue.Queue = queue.Queue()
        node = ut.UcxNode(0, on_connection or (lambda conn, peer: accepted.put((conn, peer))))
        nodes.append(node)
        return node, accepted

    yield make
    for node in nodes:
        node.stop()


@pytest.fixture
def pair(
    make_node: Callable[..., tuple[ut.UcxNode, queue.Queue]],
) -> tuple[ut.UcxConnection, ut.UcxConnection]:
    """A connection between two nodes of this process: (connecting side, accepting side)."""
    server, accepted = make_node()
    client, _ = make_node()
    conn = client.connect("127.0.0.1", server.port, timeout=10)
    other, _ = accepted.get(timeout=10)
    return conn, other


@pytest.fixture
def peer_process() -> Iterator[Callable[[str], tuple[subprocess.Popen, int]]]:
    """Starts ``PEER`` in a subprocess in the given mode; returns it and its port."""
    procs: list[subprocess.Popen] = []

    def start(mode: str) -> tuple[subprocess.Popen, int]:
        env = dict(os.environ, UCX_TLS="tcp")
        proc = subprocess.Popen(
            [sys.executable, "-c", PEER, mode],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.strip().isdigit():
            proc.kill()
            pytest.fail(f"the peer process did not start (it printed {line!r}, exit {proc.wait()})")
        return proc, int(line)

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def _call_in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, queue.Queue]:
    """Runs ``fn`` on a thread; the queue gets ("ok", result) or ("error", exception)."""
    out: queue.Queue = queue.Queue()

    def run() -> None:
        try:
            out.put(("ok", fn()))
        except BaseException as exc:
            out.put(("error", exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# -- data ---------------------------------------------------------------------------------------


def test_round_trip_across_processes_is_exact_including_64_mib_into_a_slice(
    make_node: Callable[..., tuple[ut.UcxNode, queue.Queue]],
    peer_process: Callable[[str], tuple[subprocess.Popen, int]],
) -> None:
    proc, port = peer_process("echo")
    node, _ = make_node()
    conn = node.connect("127.0.0.1", port, timeout=10)
    assert conn.getpeername() == f"127.0.0.1:{port}"
    conn.settimeout(20)
    rng = np.random.default_rng(7)
    big = rng.integers(0, 256, BIG, dtype=np.uint8)
    messages: list[bytes | bytearray | memoryview] = [
        b"x",
        bytearray(b"\x00\xff" * 1000),
        b"",
        memoryview(big),
    ]
    for message in messages:
        n = len(message)
        conn.sendall(LENGTH.pack(n))
        conn.sendall(message)
        head = bytearray(LENGTH.size)
        assert conn.recv_into(memoryview(head)) == LENGTH.size
        assert LENGTH.unpack(head) == (n,)
        # Into the middle of a larger buffer: the bytes around the slice must stay untouched.
        landing = np.full(n + 16, 0xAB, dtype=np.uint8)
        assert conn.recv_into(memoryview(landing)[8 : 8 + n]) == n
        assert landing[8 : 8 + n].tobytes() == bytes(message)
        assert (landing[:8] == 0xAB).all() and (landing[8 + n :] == 0xAB).all()
    conn.close()
    assert proc.wait(20) == 0  # the peer saw a clean end of the stream


def test_frames_of_header_and_payload_arrive_intact_while_another_thread_sends_heartbeats(
    pair: tuple[ut.UcxConnection, ut.UcxConnection],
) -> None:
    sender, receiver = pair
    lock = threading.Lock()  # what peer_transport holds around a frame
    sizes = [0, 1, 7, 1000, 65536, (5 << 20) + 3, 12, ut.PIECE_BYTES * 2 + 1] * 3
    rng = np.random.default_rng(1)
    payloads = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.is_set():
            with lock:
                sender.sendall(HEADER.pack(b"SMDP", 3, 0))
            time.sleep(0.001)

    def send_frames() -> None:
        for payload in payloads:
            with lock:
                sender.sendall(HEADER.pack(b"SMDP", 1, payload.nbytes))
                sender.sendall(memoryview(payload))

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    thread, result = _call_in_thread(send_frames)
    receiver.settimeout(10)
    got: list[np.ndarray] = []
    heartbeats = 0
    while len(got) < len(payloads):
        head = bytearray(HEADER.size)
        receiver.recv_into(memoryview(head))
        magic, ftype, nbytes = HEADER.unpack(head)
        assert magic == b"SMDP"
        if ftype == 3:
            heartbeats += 1
            continue
        payload = np.empty(nbytes, dtype=np.uint8)
        assert receiver.recv_into(memoryview(payload)) == nbytes
        got.append(payload)
    stop.set()
    beat.join(10)
    assert result.get(timeout=10) == ("ok", None)
    assert heartbeats > 0
    for want, have in zip(payloads, got):
        assert np.array_equal(want, have)


def test_a_thread_sends_while_another_is_blocked_receiving_on_the_same_connection(
    pair: tuple[ut.UcxConnection, ut.UcxConnection],
) -> None:
    a, b = pair
    a.settimeout(10)
    b.settimeout(10)
    answer = bytearray(5)
    thread, result = _call_in_thread(lambda: a.recv_into(memoryview(answer)))
    time.sleep(0.2)  # the receive is posted and waiting
    assert thread.is_alive()
    a.sendall(b"ping!")  # from this thread, on the connection the other thread receives on
    question = bytearray(5)
    b.recv_into(memoryview(question))
    assert question == b"ping!"
    b.sendall(b"pong!")
    assert result.get(timeout=10) == ("ok", 5)
    assert answer == b"pong!"


def test_empty_and_read_only_buffers(pair: tuple[ut.UcxConnection, ut.UcxConnection]) -> None:
    a, _ = pair
    assert a.recv_into(memoryview(bytearray())) == 0
    with pytest.raises(TypeError):
        a.recv_into(memoryview(b"read-only"))
    a.sendall(b"")


# -- failures -----------------------------------------------------------------------------------


def test_receive_timeout_raises_and_leaves_the_connection_broken(
    pair: tuple[ut.UcxConnection, ut.UcxConnection],
) -> None:
    a, b = pair
    a.settimeout(0.3)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="no progress receiving for 0.3 s"):
        a.recv_into(memoryview(bytearray(16)))
    assert 0.25 < time.monotonic() - start < 3
    # The abandoned receive is still posted; whatever arrives now must not count as data.
    b.settimeout(5)
    b.sendall(b"late" * 4)
    for call in (lambda: a.recv_into(memoryview(bytearray(4))), lambda: a.sendall(b"x")):
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="broke"):
            call()
        assert time.monotonic() - start < 0.1
    a.close()
    a.close()
    with pytest.raises(ConnectionError, match="closed"):
        a.sendall(b"x")


def test_close_cancels_a_receive_abandoned_by_its_timeout(
    make_node: Callable[..., tuple[ut.UcxNode, queue.Queue]],
) -> None:
    server, accepted = make_node()
    client, _ = make_node()
    a = client.connect("127.0.0.1", server.port, timeout=10)
    b, _ = accepted.get(timeout=10)
    a.settimeout(0.2)
    landing = bytearray(16)
    with pytest.raises(TimeoutError):
        a.recv_into(memoryview(landing))
    # White box: the receive is still posted, and the connection holds its buffer.
    abandoned = [request for request, _ in a._requests if not request.completed]
    assert abandoned
    a.close()
    assert all(request.completed for request in abandoned), "close() must cancel what is posted"
    assert not client._in_flight
    try:
        b.sendall(b"late" * 4)
    except ConnectionError:
        pass  # b may already know that a is gone
    time.sleep(0.3)
    assert landing == bytearray(16), "UCX wrote into a buffer after its receive was given up"


def test_a_killed_peer_fails_a_blocked_receive_promptly(
    make_node: Callable[..., tuple[ut.UcxNode, queue.Queue]],
    peer_process: Callable[[str], tuple[subprocess.Popen, int]],
) -> None:
    proc, port = peer_process("hold")
    node, _ = make_node()
    conn = node.connect("127.0.0.1", port, timeout=10)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "accepted"
    conn.settimeout(20)
    thread, result = _call_in_thread(lambda: conn.recv_into(memoryview(bytearray(64))))
    time.sleep(0.3)
    assert thread.is_alive()
    proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    kind, exc = result.get(timeout=20)
    assert kind == "error" and isinstance(exc, (ConnectionError, TimeoutError)), exc
    assert time.monotonic() - killed < 5, "a dead peer should be noticed long before the timeout"
    with pytest.raises(ConnectionError):
        conn.sendall(b"x")
    conn.close()


def test_connecting_where_no_node_listens_fails_within_the_timeout(
    make_node: Callable[..., tuple[ut.UcxNode, queue.Queue]],
) -> None:
    node, _ = make_node()
    port = free_port()
    start = time.monotonic()
    with pytest.raises((ConnectionError, TimeoutError), match=f"127.0.0.1:{port}"):
        node.connect("127.0.0.1", port, timeout=3)
    assert time.monotonic() - start < 4
    with pytest.raises(ConnectionError, match="no-such-host.invalid:1"):
        node.connect("no-such-host.invalid", 1, timeout=3)
    # A TCP server that is not a UCX node: the handshake never completes.
    with socket.socket() as plain:
        plain.bind(("127.0.0.1", 0))
        plain.listen()
        port = plain.getsockname()[1]
        start = time.monotonic()
        with pytest.raises((ConnectionError, TimeoutError), match=f"127.0.0.1:{port}"):
            node.connect("127.0.0.1", port, timeout=1)
        assert time.monotonic() - start < 2


def test_listening_on_a_port_in_use_names_the_port(
    make_node: Callable[..., tuple[ut.UcxNode, queue.Queue]],
) -> None:
    node, _ = make_node()
    with pytest.raises(OSError, match=f"port {node.port}"):
        ut.UcxNode(node.port, lambda conn, peer: None).stop()


# -- ends ---------------------------------------------------------------------------------------


def test_shutdown_ends_the_peers_stream_after_the_bytes_sent_before_it(
    pair: tuple[ut.UcxConnection, ut.UcxConnection],
) -> None:
    a, b = pair
    a.settimeout(10)
    b.settimeout(10)
    payload = np.arange(3 << 20, dtype=np.uint32).view(np.uint8)  # spans several pieces
    a.sendall(memoryview(payload))
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(BrokenPipeError):
        a.sendall(b"x")
    got = np.empty_like(payload)
    time.sleep(0.2)  # the end arrives before the reader gets to the bytes
    b.recv_into(memoryview(got))
    assert np.array_equal(got, payload)
    with pytest.raises(ConnectionError, match="closed by the peer"):
        b.recv_into(memoryview(bytearray(1)))
    # Half-closed: the other direction still carries data.
    b.sendall(b"still here")
    answer = bytearray(10)
    a.recv_into(memoryview(answer))
    assert answer == b"still here"
    start = time.monotonic()
    b.close()
    a.close()
    assert time.monotonic() - start < 1, "each side confirmed the other's end: no lingering"


def test_close_delivers_what_was_sent_before_it_to_a_slow_reader(
    pair: tuple[ut.UcxConnection, ut.UcxConnection],
) -> None:
    a, b = pair
    b.settimeout(10)
    payload = np.random.default_rng(3).integers(0, 256, 8 << 20, dtype=np.uint8)
    header = HEADER.pack(b"SMDP", 4, payload.nbytes)
    closed, result = _call_in_thread(
        lambda: (a.sendall(header), a.sendall(memoryview(payload)), a.close())
    )
    time.sleep(0.5)  # the reader comes late; a's close waits for it
    head = bytearray(HEADER.size)
    b.recv_into(memoryview(head))
    assert HEADER.unpack(head) == (b"SMDP", 4, payload.nbytes)
    got = np.empty_like(payload)
    b.recv_into(memoryview(got))
    assert np.array_equal(got, payload)
    with pytest.raises(ConnectionError, match="closed by the peer"):
        b.recv_into(memoryview(head))
    assert result.get(timeout=10)[0] == "ok"
    b.close()


def test_closing_one_side_fails_the_others_blocked_receive(
    pair: tuple[ut.UcxConnection, ut.UcxConnection],
) -> None:
    a, b = pair
    b.settimeout(10)
    thread, result = _call_in_thread(lambda: b.recv_into(memoryview(bytearray(8))))
    time.sleep(0.2)
    start = time.monotonic()
    a.close()
    kind, exc = result.get(timeout=10)
    assert kind == "error" and isinstance(exc, ConnectionError), exc
    assert time.monotonic() - start < 2
    b.close()


# -- nodes --------------------------------------------------------------------------------------


def test_on_connection_runs_on_a_thread_of_its_own_and_may_block(
    make_node: Callable[..., tuple[ut.UcxNode, queue.Queue]],
) -> None:
    release = threading.Event()
    calls: queue.Queue = queue.Queue()

    def on_connection(conn: ut.UcxConnection, peer: str) -> None:
        calls.put((threading.current_thread(), peer))
        release.wait(10)  # a handshake that takes a while must not hold up other connections
        conn.close()

    server, _ = make_node(on_connection)
    client, _ = make_node()
    first = client.connect("127.0.0.1", server.port, timeout=5)
    second = client.connect("127.0.0.1", server.port, timeout=5)
    (thread1, peer1), (thread2, peer2) = calls.get(timeout=5), calls.get(timeout=5)
    assert thread1 is not thread2 and threading.main_thread() not in (thread1, thread2)
    assert peer1.startswith("127.0.0.1:") and peer2.startswith("127.0.0.1:")
    release.set()
    first.close()
    second.close()


def test_accepted_peer_is_described_by_its_address(
    pair: tuple[ut.UcxConnection, ut.UcxConnection],
) -> None:
    _, accepted = pair
    host, _, port = accepted.getpeername().rpartition(":")
    assert host == "127.0.0.1" and port.isdigit()


def _foreign_threads() -> dict[int, str]:
    """Threads of this process that Python did not start (UCX's), by id, with their names."""
    python = {t.native_id for t in threading.enumerate()}
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # it ended meanwhile
        if int(tid) not in python:
            found[int(tid)] = name
    return found


def test_stop_is_idempotent_closes_connections_and_ends_the_progress_thread(
    make_node: Callable[..., tuple[ut.UcxNode, queue.Queue]],
) -> None:
    before = _foreign_threads()
    server, accepted = make_node()
    client, _ = make_node()
    started = {tid: name for tid, name in _foreign_threads().items() if tid not in before}
    progress = {
        tid for tid, name in started.items() if name != "async"
    }  # UCX's async thread lives with the context
    assert len(progress) == 2, started
    conn = client.connect("127.0.0.1", server.port, timeout=5)
    other, _ = accepted.get(timeout=5)
    thread, result = _call_in_thread(lambda: other.recv_into(memoryview(bytearray(8))))
    time.sleep(0.2)
    server.stop()
    server.stop()
    kind, exc = result.get(timeout=5)
    assert kind == "error" and isinstance(exc, ConnectionError), exc
    client.stop()
    client.stop()
    assert not progress & set(_foreign_threads()), "a progress thread is still running"
    with pytest.raises(ConnectionError, match="stopped"):
        client.connect("127.0.0.1", server.port, timeout=1)
    with pytest.raises(ConnectionError):
        conn.sendall(b"x")
    conn.close()
