"""Tests for smddp.server.notify against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import uuid
from collections.abc import Iterator

import pytest

from smddp.server import notify as sd

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start every test outside systemd, whatever environment pytest itself runs in."""
    for name in (sd.NOTIFY_SOCKET_ENV, sd.WATCHDOG_USEC_ENV, sd.WATCHDOG_PID_ENV):
        monkeypatch.delenv(name, raising=False)


def _receiver(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5.0)
    return sock


@pytest.fixture
def manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A notification socket on the filesystem, named in $NOTIFY_SOCKET."""
    # A short private directory: sun_path holds 108 bytes, and pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="smddp-") as tmp:
        path = os.path.join(tmp, "notify")
        with _receiver(path) as sock:
            monkeypatch.setenv(sd.NOTIFY_SOCKET_ENV, path)
            yield sock


@pytest.fixture
def abstract_manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A notification socket in the abstract namespace, named ``@name`` as systemd does."""
    name = f"smddp-test-{uuid.uuid4().hex}"
    with _receiver("\0" + name) as sock:
        monkeypatch.setenv(sd.NOTIFY_SOCKET_ENV, "@" + name)
        yield sock


def _recv(sock: socket.socket) -> str:
    return sock.recv(4096).decode("utf-8")


def test_notify_without_socket_is_a_no_op() -> None:
    assert sd.notify(sd.READY) is False


@pytest.mark.parametrize("state", [sd.READY, sd.STOPPING, sd.WATCHDOG, "STATUS=serving 2 jobs"])
def test_notify_sends_datagram(manager: socket.socket, state: str) -> None:
    assert sd.notify(state) is True
    assert _recv(manager) == state


def test_notify_abstract_namespace(abstract_manager: socket.socket) -> None:
    assert sd.notify(sd.READY) is True
    assert _recv(abstract_manager) == sd.READY
    assert sd.notify(sd.STOPPING) is True
    assert _recv(abstract_manager) == sd.STOPPING


def test_notify_multiline_state(manager: socket.socket) -> None:
    state = "READY=1\nSTATUS=listening on /run/smddp/smddpd.sock"
    assert sd.notify(state) is True
    assert _recv(manager) == state


def test_notify_to_missing_socket_returns_false(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sd.NOTIFY_SOCKET_ENV, f"/nonexistent/smddp-{uuid.uuid4().hex}")
    assert sd.notify(sd.READY) is False


def test_notify_ignores_unknown_address_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sd.NOTIFY_SOCKET_ENV, "vsock:2:1234")
    assert sd.notify(sd.READY) is False


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        (None, None, None),
        ("2000000", None, 2.0),
        ("500", None, 0.0005),
        ("2000000", "self", 2.0),
        ("2000000", "other", None),
        ("2000000", "garbage", None),
        ("0", None, None),
        ("-5", None, None),
        ("soon", None, None),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: float | None
) -> None:
    if usec is not None:
        monkeypatch.setenv(sd.WATCHDOG_USEC_ENV, usec)
    if pid is not None:
        value = {"self": str(os.getpid()), "other": str(os.getpid() + 1)}.get(pid, pid)
        monkeypatch.setenv(sd.WATCHDOG_PID_ENV, value)
    assert sd.watchdog_interval() == expected


def test_watchdog_without_interval_does_not_start() -> None:
    watchdog = sd.Watchdog(healthy=lambda: True)
    assert watchdog.interval is None
    assert watchdog.start() is False
    watchdog.stop()


def test_watchdog_reads_interval_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sd.WATCHDOG_USEC_ENV, "3000000")
    monkeypatch.setenv(sd.WATCHDOG_PID_ENV, str(os.getpid()))
    assert sd.Watchdog(healthy=lambda: True).interval == 3.0


def test_watchdog_pings_while_healthy(manager: socket.socket) -> None:
    watchdog = sd.Watchdog(healthy=lambda: True, interval=0.1)
    assert watchdog.start() is True
    try:
        # Several pings in a row prove it keeps going, not just pings once at start.
        for _ in range(3):
            assert _recv(manager) == sd.WATCHDOG
    finally:
        watchdog.stop()


def test_watchdog_withholds_ping_while_unhealthy(manager: socket.socket) -> None:
    healthy = threading.Event()
    checked = threading.Event()

    def is_healthy() -> bool:
        checked.set()
        return healthy.is_set()

    watchdog = sd.Watchdog(healthy=is_healthy, interval=0.1)
    watchdog.start()
    try:
        assert checked.wait(5.0)
        manager.settimeout(0.3)
        with pytest.raises(socket.timeout):
            manager.recv(4096)
        healthy.set()
        manager.settimeout(5.0)
        assert _recv(manager) == sd.WATCHDOG
    finally:
        watchdog.stop()


def test_watchdog_treats_exception_as_unhealthy(manager: socket.socket) -> None:
    calls = threading.Event()

    def broken() -> bool:
        calls.set()
        raise RuntimeError("health check crashed")

    watchdog = sd.Watchdog(healthy=broken, interval=0.1)
    watchdog.start()
    try:
        assert calls.wait(5.0)
        manager.settimeout(0.3)
        with pytest.raises(socket.timeout):
            manager.recv(4096)
    finally:
        watchdog.stop()


def test_watchdog_stop_ends_thread_and_pings(manager: socket.socket) -> None:
    watchdog = sd.Watchdog(healthy=lambda: True, interval=0.1)
    watchdog.start()
    assert _recv(manager) == sd.WATCHDOG
    watchdog.stop()
    assert not any(t.name == "smddp-sd-watchdog" for t in threading.enumerate())
    # Drain what was sent before stop() returned; nothing may follow.
    manager.setblocking(False)
    try:
        while True:
            manager.recv(4096)
    except BlockingIOError:
        pass
    manager.settimeout(0.3)
    with pytest.raises(socket.timeout):
        manager.recv(4096)


def test_watchdog_start_twice_keeps_one_thread(manager: socket.socket) -> None:
    watchdog = sd.Watchdog(healthy=lambda: True, interval=10.0)
    try:
        assert watchdog.start() is True
        assert watchdog.start() is True
        assert sum(t.name == "smddp-sd-watchdog" for t in threading.enumerate()) == 1
    finally:
        watchdog.stop()
