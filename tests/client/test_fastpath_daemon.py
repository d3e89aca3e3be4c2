"""The shared-memory path against a real daemon: metric sums per op path, and its failures.

Ranks are numpy clients (two in this process, or one in a spawned process that the test
kills); the daemon is a real smddpd with an HTTP port for /metrics.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import signal
import threading
import time
import urllib.request

import numpy as np
import pytest

from smddp.client import connect
from smddp.client.errors import DaemonLostError, RankFailedError
from smddp.v1 import smddp_pb2 as pb


def _scrape(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        if "{" in name_labels:
            name, rest = name_labels.split("{", 1)
            labels = frozenset(
                tuple(kv.split("=", 1)) for kv in rest.rstrip("}").replace('"', "").split(",") if kv
            )
        else:
            name, labels = name_labels, frozenset()
        out[(name, labels)] = float(value)
    return out


def _v(series: dict, name: str, **labels: str) -> float:
    return series.get((name, frozenset(labels.items())), 0.0)


def _job() -> tuple[str, bytes]:
    return f"fast-{secrets.token_hex(4)}", secrets.token_bytes(16)


def _both(f0, f1) -> None:
    """Starts an op on both ranks (this thread), then waits for both."""
    h0, h1 = f0(), f1()
    h0.wait()
    h1.wait()


@pytest.mark.timeout(120)
def test_metric_sums_equal_what_the_job_did_on_every_path(start_daemon) -> None:
    d = start_daemon(args=["--http-bind", "127.0.0.1:0"])
    port = d.http_port()
    job, token = _job()
    c0 = connect(job, token, 0, 2, socket_path=d.socket)
    c1 = connect(job, token, 1, 2, socket_path=d.socket)
    paths = {
        # name: (op label, dtype label, elements per rank, run both ranks)
        "region": ("all_reduce", "float32", 1000),
        "direct": ("all_reduce", "float32", 1 << 20),  # 4 MiB: chunked through the arenas
        "chunked": ("reduce", "float64", 1 << 20),  # 8 MiB: through the daemon, in chunks
    }
    for name, (op, dtype, n) in paths.items():
        before = _scrape(port)
        a = np.ones(n, dtype=dtype)
        b = np.full(n, 2, dtype=dtype)
        if op == "all_reduce":
            _both(lambda a=a: c0.all_reduce(a), lambda b=b: c1.all_reduce(b))
            assert (a == 3).all() and (b == 3).all()
        else:
            _both(lambda a=a: c0.reduce(a, 0), lambda b=b: c1.reduce(b, 0))
            assert (a == 3).all()
        after = _scrape(port)
        labels = {"op": op, "dtype": dtype}
        assert (
            _v(after, "smddp_ops_total", **labels) - _v(before, "smddp_ops_total", **labels) == 1
        ), name
        grown = _v(after, "smddp_op_bytes_total", **labels) - _v(
            before, "smddp_op_bytes_total", **labels
        )
        assert grown == 2 * a.nbytes, (name, grown)
        count = "smddp_op_duration_seconds_count"
        assert _v(after, count, **labels) - _v(before, count, **labels) == 1, name
    # p2p: the sender's bytes, counted once per message.
    before = _scrape(port)
    x, y = np.arange(5000, dtype=np.int32), np.zeros(5000, dtype=np.int32)
    _both(lambda: c0.send(x, 1), lambda: c1.recv(y, 0))
    assert (x == y).all()
    _both(c0.barrier, c1.barrier)
    after = _scrape(port)
    sent = _v(after, "smddp_op_bytes_total", op="send", dtype="int32") - _v(
        before, "smddp_op_bytes_total", op="send", dtype="int32"
    )
    assert sent == x.nbytes
    assert (
        _v(after, "smddp_ops_total", op="barrier", dtype="none")
        - _v(before, "smddp_ops_total", op="barrier", dtype="none")
        == 1
    )
    c0.close()
    c1.close()


@pytest.mark.timeout(60)
def test_daemon_killed_mid_op_fails_the_waiting_rank_fast(start_daemon) -> None:
    d = start_daemon()
    job, token = _job()
    c0 = connect(job, token, 0, 2, socket_path=d.socket)
    c1 = connect(job, token, 1, 2, socket_path=d.socket)
    _both(c0.barrier, c1.barrier)  # both have the region mapped
    h = c0.all_reduce(np.ones(16, np.float32))  # rank 1 never joins
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            h.wait()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.3)  # rank 0 is asleep on rank 1's step word
    d.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    t.join(10)
    assert not t.is_alive(), "rank 0 never noticed the daemon's death"
    assert time.monotonic() - killed < 2.0
    assert len(errors) == 1 and isinstance(errors[0], DaemonLostError), errors
    assert f"smddpd at {d.socket}" in str(errors[0])
    with pytest.raises(DaemonLostError):
        c0.all_reduce(np.ones(4, np.float32)).wait()
    c0.session.close(deregister=False)
    c1.session.close(deregister=False)


def _spinning_victim(
    socket_path: str, job: str, token: bytes, ready: multiprocessing.Event
) -> None:
    c = connect(job, token, 1, 2, socket_path=socket_path)
    x = np.ones(4, np.float32)
    c.all_reduce(x).wait()
    ready.set()
    while True:
        c.all_reduce(x, pb.MAX).wait()  # MAX: the values stay put however many ops run


@pytest.mark.timeout(90)
@pytest.mark.parametrize("victim_busy", [True, False], ids=["spinning", "sleeping"])
def test_rank_killed_while_others_spin_or_sleep(start_daemon, victim_busy: bool) -> None:
    d = start_daemon()
    job, token = _job()
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    victim = ctx.Process(target=_spinning_victim, args=(d.socket, job, token, ready))
    victim.start()
    c0 = connect(job, token, 0, 2, socket_path=d.socket)
    x = np.ones(4, np.float32)
    c0.all_reduce(x).wait()
    assert ready.wait(30)
    if not victim_busy:
        os.kill(victim.pid, signal.SIGSTOP)  # it stops between ops: rank 0 will sleep
    killed: list[float] = []

    def kill() -> None:
        killed.append(time.monotonic())
        os.kill(victim.pid, signal.SIGKILL)

    threading.Timer(0.5, kill).start()  # while rank 0 is inside an op (spinning or asleep)
    try:
        while True:
            c0.all_reduce(x, pb.MAX).wait()
    except RankFailedError as exc:
        message = str(exc)
    assert killed and time.monotonic() - killed[0] < 2.0
    assert f"job {job} comm 0: rank 1 (pid {victim.pid}, node " in message, message
    assert "disconnected" in message, message
    with pytest.raises(RankFailedError):
        c0.barrier().wait()
    victim.join(10)
    c0.close()


@pytest.mark.timeout(60)
def test_async_large_ops_from_one_thread(start_daemon) -> None:
    """Two ranks driven from one thread: large ops return at once (the progress thread runs
    them), so each rank's handle completes once the other has started its op."""
    d = start_daemon()
    job, token = _job()
    c0 = connect(job, token, 0, 2, socket_path=d.socket)
    c1 = connect(job, token, 1, 2, socket_path=d.socket)
    a, b = np.ones(1 << 20, np.float32), np.full(1 << 20, 2.0, np.float32)
    handles = [c0.all_reduce(a), c1.all_reduce(b), c0.all_reduce(a), c1.all_reduce(b)]
    small = [
        c0.all_reduce(np.ones(3, np.int64), pb.MAX),
        c1.all_reduce(np.full(3, 5, np.int64), pb.MAX),
    ]
    for h in handles + small:
        h.wait()
    assert (a == 6).all() and (b == 6).all()
    c0.close()
    c1.close()
