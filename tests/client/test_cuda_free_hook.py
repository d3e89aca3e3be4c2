"""Close before free, the rank's C++ side (backend/csrc/), without a GPU.

The allocator hook (``segment_hook.cpp``) is compiled for real against the installed torch's
headers (a CPU wheel ships c10/cuda's headers; the CUDA toolkit's come from nvcc's folder),
to an object whose only unresolved names are torch's allocator and the channel; linking it
needs libc10_cuda, which only a CUDA torch has. The channel (``free_channel.cpp``) is built
and loaded alone, and driven through the entry point the hook calls, against the other end
of a socket pair that plays smddpd's part of the wire (the real daemon answers it in
tests/gpu/test_cuda_on_fake_gpu.py): what it sends, the bound on its wait, late answers, a
broken channel and when it is reopened. And the build: processes building at once compile once.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from smddp.backend import cuda_free_hook
from smddp.backend.cuda_free_hook import FreeChannel
from smddp.client.config import ClientConfig
from smddp.core.wire import MSG_FREE, MSG_FREE_REPLY, pack
from smddp.v1 import smddp_pb2 as pb

pytestmark = pytest.mark.timeout(120)

BASE = 0x7F1200000000


def _cuda_include() -> str:
    """The CUDA toolkit's include folder (cuda_runtime_api.h), where nvcc's is."""
    nvcc = shutil.which("nvcc")
    assert nvcc, "nvcc (the CUDA toolkit) is needed for cuda_runtime_api.h"
    candidates = [
        *(Path(os.environ[v]) / "include" for v in ("CUDA_HOME", "CUDA_PATH") if v in os.environ),
        Path("/usr/local/cuda/include"),
        Path(nvcc).resolve().parent.parent / "include",
    ]
    for include in candidates:
        if (include / "cuda_runtime_api.h").exists():
            return str(include)
    raise AssertionError(f"no cuda_runtime_api.h in {[str(c) for c in candidates]}")


def test_the_allocator_hook_compiles_against_torch_s_headers(tmp_path: Path) -> None:
    import torch
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), _cuda_include()]
    defines = []
    torch_include = Path(torch.__file__).parent / "include"
    if not (torch_include / "c10/cuda/impl/cuda_cmake_macros.h").exists():
        # A CPU wheel lacks this generated header (it only sets an export macro).
        defines.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    obj = tmp_path / "segment_hook.o"
    cxx = shutil.which("c++") or "g++"
    run = subprocess.run(
        [
            cxx,
            "-std=c++17",
            "-Wall",
            "-Werror=return-type",
            "-fPIC",
            "-c",
            *defines,
            *(f"-I{d}" for d in includes),
            str(cuda_free_hook.CSRC / "segment_hook.cpp"),
            "-o",
            str(obj),
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    symbols = subprocess.run(
        ["nm", "-C", str(obj)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    defined = {line.split()[-1] for line in symbols if " T " in line}
    undefined = {line.split(maxsplit=1)[-1] for line in symbols if line.lstrip().startswith("U ")}
    assert "smddp_free_hook_install" in defined
    assert "smddp_fc_segment_free" in undefined
    # The tracker is attached to torch's allocator, which libc10_cuda defines.
    assert any("CUDACachingAllocator::allocator" in name for name in undefined), undefined


@pytest.fixture
def channel(tmp_path: Path) -> FreeChannel:
    """The channel library alone, loaded from its own copy: fresh C state per test."""
    import ctypes

    built = cuda_free_hook.compile_library(cuda_free_hook.CHANNEL_SOURCES, tmp_path / "build")
    copy = tmp_path / "channel.so"
    shutil.copy(built, copy)
    return FreeChannel(ctypes.CDLL(str(copy)))


def _pair(channel: FreeChannel, wait_ms: int) -> socket.socket:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    channel.open(ours, wait_ms)
    theirs.settimeout(10)
    return theirs


def _request(daemon: socket.socket) -> pb.SegmentFree:
    data = daemon.recv(4096)
    assert data[0] == MSG_FREE, data
    return pb.SegmentFree.FromString(data[1:])


def _reply(daemon: socket.socket, seq: int, closed: int = 1, deferred: int = 0) -> None:
    msg = pb.SegmentFreeReply(seq=seq, closed=closed, deferred=deferred)
    daemon.sendall(pack(MSG_FREE_REPLY, msg.SerializeToString()))


def test_a_segment_never_exported_is_freed_without_asking(channel: FreeChannel) -> None:
    daemon = _pair(channel, 5000)
    start = time.monotonic()
    assert channel.segment_free(BASE, 1 << 21) == FreeChannel.NOT_MAPPED
    assert time.monotonic() - start < 1
    daemon.setblocking(False)
    with pytest.raises(BlockingIOError):
        daemon.recv(4096)
    assert channel.stats()["sent"] == 0


def test_an_exported_segment_waits_for_smddpd_s_answer(channel: FreeChannel) -> None:
    daemon = _pair(channel, 5000)
    channel.watch(BASE)
    seen: list[pb.SegmentFree] = []

    def smddpd() -> None:
        req = _request(daemon)
        seen.append(req)
        time.sleep(0.2)  # unmapping takes a while: the free must wait for it
        _reply(daemon, req.seq)

    t = threading.Thread(target=smddpd)
    t.start()
    start = time.monotonic()
    code = channel.segment_free(BASE, 20 << 20)
    waited = time.monotonic() - start
    t.join()
    assert code == FreeChannel.CLOSED
    assert waited >= 0.2
    (req,) = seen
    assert (req.alloc_base, req.nbytes, req.seq, req.wait_ms) == (BASE, 20 << 20, 1, 5000)
    # Announced once: a second free of the same base (not exported again) asks nothing.
    assert channel.segment_free(BASE, 20 << 20) == FreeChannel.NOT_MAPPED
    assert channel.stats() | {"watched": 0} == {
        "sent": 1,
        "closed": 1,
        "deferred": 0,
        "timeouts": 0,
        "failed": 0,
        "watched": 0,
        "opens": 1,
    }


def test_a_deferred_close_is_reported(channel: FreeChannel) -> None:
    daemon = _pair(channel, 5000)
    channel.watch(BASE)
    t = threading.Thread(target=lambda: _reply(daemon, _request(daemon).seq, 0, 1))
    t.start()
    assert channel.segment_free(BASE, 4096) == FreeChannel.DEFERRED
    t.join()


def test_no_answer_frees_after_the_bound_and_a_late_answer_is_dropped(
    channel: FreeChannel, capfd: pytest.CaptureFixture[str]
) -> None:
    daemon = _pair(channel, 300)
    channel.watch(BASE)
    start = time.monotonic()
    assert channel.segment_free(BASE, 4096) == FreeChannel.TIMEOUT
    waited = time.monotonic() - start
    assert 0.29 <= waited < 5, waited
    late = _request(daemon)
    err = capfd.readouterr().err
    assert f"did not confirm unmapping GPU segment 0x{BASE:x} (4096 bytes) within 300 ms" in err
    # The late answer arrives first, then the next request's own: only that one counts.
    _reply(daemon, late.seq, closed=1)
    channel.watch(BASE + 4096)

    def smddpd() -> None:
        req = _request(daemon)
        assert req.seq == late.seq + 1
        _reply(daemon, req.seq, closed=0, deferred=1)

    t = threading.Thread(target=smddpd)
    t.start()
    assert channel.segment_free(BASE + 4096, 4096) == FreeChannel.DEFERRED
    t.join()
    assert channel.stats()["timeouts"] == 1


def test_a_broken_channel_is_logged_once_and_never_waited_on(
    channel: FreeChannel, capfd: pytest.CaptureFixture[str]
) -> None:
    daemon = _pair(channel, 5000)
    channel.watch(BASE)
    channel.watch(BASE + 1)
    daemon.close()  # smddpd is gone
    assert channel.segment_free(BASE, 4096) == FreeChannel.NO_CHANNEL
    start = time.monotonic()
    assert channel.segment_free(BASE + 1, 4096) == FreeChannel.NO_CHANNEL
    assert time.monotonic() - start < 0.5
    err = capfd.readouterr().err
    assert err.count("the free channel to smddpd broke") == 1, err
    assert channel.stats()["failed"] == 2


def test_a_peer_that_left_is_seen_by_check_and_late_answers_are_drained(
    channel: FreeChannel, capfd: pytest.CaptureFixture[str]
) -> None:
    """is_open takes no lock and only knows what frees found; check looks at the socket:
    a late answer waiting there is dropped, a peer that left closes the channel (quietly:
    the Python side reopens and logs)."""
    assert not channel.is_open() and not channel.check()
    daemon = _pair(channel, 300)
    assert channel.is_open() and channel.check()
    channel.watch(BASE)
    assert channel.segment_free(BASE, 4096) == FreeChannel.TIMEOUT
    _reply(daemon, _request(daemon).seq)  # the late answer, now waiting on the channel
    assert channel.check() and channel.is_open()
    # Drained: the next request's answer is the one read.
    channel.watch(BASE)
    t = threading.Thread(target=lambda: _reply(daemon, _request(daemon).seq, 0, 1))
    t.start()
    assert channel.segment_free(BASE, 4096) == FreeChannel.DEFERRED
    t.join()
    daemon.close()  # smddpd exits; no free has noticed
    assert channel.is_open()
    assert not channel.check()
    assert not channel.is_open()
    assert "broke" not in capfd.readouterr().err
    # Reopened: frees wait for the new peer again, and a later break is logged again.
    daemon = _pair(channel, 5000)
    assert channel.is_open() and channel.stats()["opens"] == 2
    channel.watch(BASE)
    t = threading.Thread(target=lambda: _reply(daemon, _request(daemon).seq))
    t.start()
    assert channel.segment_free(BASE, 4096) == FreeChannel.CLOSED
    t.join()
    daemon.close()
    channel.watch(BASE)
    assert channel.segment_free(BASE, 4096) == FreeChannel.NO_CHANNEL
    assert capfd.readouterr().err.count("the free channel to smddpd broke") == 1


def test_a_reply_that_is_not_one_breaks_the_channel(channel: FreeChannel) -> None:
    daemon = _pair(channel, 5000)
    channel.watch(BASE)
    t = threading.Thread(target=lambda: (_request(daemon), daemon.sendall(b"\x04garbage")))
    t.start()
    assert channel.segment_free(BASE, 4096) == FreeChannel.NO_CHANNEL
    t.join()


def test_without_a_cuda_torch_install_logs_once_and_keeps_the_old_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from smddp.client.cuda_ipc import IpcExporter

    monkeypatch.setattr(cuda_free_hook, "_tried", False)
    monkeypatch.setattr(cuda_free_hook, "_channel", None)
    exporter = IpcExporter()

    class NoSession:
        def open_free_channel(self) -> socket.socket:
            raise AssertionError("no channel is opened without the hook")

    with caplog.at_level("WARNING", logger="smddp.backend.cuda_free_hook"):
        assert cuda_free_hook.install(NoSession(), exporter, ClientConfig()) is None  # type: ignore[arg-type]
        assert cuda_free_hook.install(NoSession(), exporter, ClientConfig()) is None  # type: ignore[arg-type]
    (record,) = caplog.records
    assert "no close before free (torch" in record.getMessage()
    assert "is not a CUDA build" in record.getMessage()
    assert exporter.on_export is None


class _Session:
    """What install asks of a session: the real wire's other end is a socket pair here (the
    real daemon's is in tests/gpu/test_cuda_on_fake_gpu.py)."""

    def __init__(self, name: str, socket_path: str, refuse: bool = False) -> None:
        self.session_id = name
        self.socket_path = socket_path
        self.job_id = "job"
        self.rank = 0
        self.refuse = refuse
        self.opened: list[socket.socket] = []  # the daemon's ends

    def open_free_channel(self) -> socket.socket:
        from smddp.client.errors import ConnectError

        if self.refuse:
            self.opened.append(socket.socket())
            raise ConnectError("smddpd refused the free channel: old daemon")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.opened.append(theirs)
        return ours


def test_install_reopens_only_when_the_channel_or_its_daemon_is_gone(
    channel: FreeChannel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from smddp.client.cuda_ipc import IpcExporter

    for name, value in (("_tried", False), ("_channel", None), ("_open_on", None)):
        monkeypatch.setattr(cuda_free_hook, name, value)
    monkeypatch.setattr(cuda_free_hook, "_refused", set())
    loads: list[int] = []

    def library() -> object:
        loads.append(1)
        return channel.lib

    def install(session: _Session) -> FreeChannel | None:
        return cuda_free_hook.install(session, IpcExporter(), ClientConfig(), library=library)  # type: ignore[arg-type, return-value]

    def reopened() -> list[str]:
        return [r.getMessage() for r in caplog.records if "reopened" in r.getMessage()]

    caplog.set_level("INFO", logger="smddp.backend.cuda_free_hook")
    a = _Session("a", "/run/smddp.sock")
    first = install(a)
    assert first is not None and first.stats()["opens"] == 1 and len(a.opened) == 1
    # Another group of the process on the same, live daemon: the channel stays.
    b = _Session("b", "/run/smddp.sock")
    assert install(b) is first and not b.opened and not reopened()
    # The process's daemon is now another one: the channel goes there.
    c = _Session("c", "/run/other.sock")
    assert install(c) is first and len(c.opened) == 1
    (message,) = reopened()
    assert "the process's smddpd is now the one at /run/other.sock" in message
    assert "session c (job job, rank 0)" in message
    # c's daemon exits. An op does not look at the socket (no lock, no syscall) ...
    c.opened[0].close()
    cuda_free_hook.refresh(c)
    assert len(c.opened) == 1 and first.is_open()
    # ... the next group's attach does.
    d = _Session("d", "/run/other.sock")
    assert install(d) is first and len(d.opened) == 1 and len(reopened()) == 2
    assert "broke or smddpd restarted" in reopened()[1]
    # A daemon that refuses the channel is asked once, at the attach, not at every op.
    d.opened[0].close()
    e = _Session("e", "/run/other.sock", refuse=True)
    assert install(e) is None
    for _ in range(3):
        cuda_free_hook.refresh(e)
    assert len(e.opened) == 1 and not first.is_open()
    assert any("could not be opened" in r.getMessage() for r in caplog.records)
    # An op on a group whose session works reopens the broken channel.
    cuda_free_hook.refresh(d)
    assert len(d.opened) == 2 and first.is_open() and len(reopened()) == 3
    assert loads == [1], "the library is built once per process"


_BUILD_ONE = """
import sys
from pathlib import Path
from smddp.backend import cuda_free_hook
print(cuda_free_hook.compile_library(cuda_free_hook.CHANNEL_SOURCES, Path(sys.argv[1])))
"""


def test_processes_building_at_once_compile_once(tmp_path: Path) -> None:
    """The ranks of a node reach their first GPU op together: the second waits on the lock
    beside the first's build and loads its library rather than compiling it again."""
    import ctypes
    import sys

    log = tmp_path / "compiles"
    release = tmp_path / "release"
    real = shutil.which("c++") or shutil.which("g++")
    assert real
    cxx = tmp_path / "cxx"
    # Holds the first compile until the test has seen the second process wait.
    cxx.write_text(
        f'#!/bin/sh\necho "$$" >> "{log}"\n'
        f'n=0; while [ ! -e "{release}" ] && [ $n -lt 600 ]; do sleep 0.1; n=$((n+1)); done\n'
        f'exec "{real}" "$@"\n'
    )
    cxx.chmod(0o755)
    env = dict(os.environ, CXX=str(cxx))
    out = tmp_path / "cache"

    def start() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", _BUILD_ONE, str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def wait_for(what: str, cond: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 60
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    first = start()
    try:
        wait_for("the first compile", lambda: log.exists())
        second = start()
        try:
            # The second has the lock file open: it is waiting for the first's build.
            def waiting() -> bool:
                fds = Path(f"/proc/{second.pid}/fd")
                try:
                    return any(os.readlink(fd).endswith("build.lock") for fd in fds.iterdir())
                except OSError:
                    return False

            wait_for("the second process to wait on the lock", waiting)
            time.sleep(0.3)
            assert second.poll() is None, second.communicate()
            release.touch()
            out1, err1 = first.communicate(timeout=100)
            out2, err2 = second.communicate(timeout=100)
        finally:
            second.kill()
    finally:
        first.kill()
    assert first.returncode == 0 and second.returncode == 0, (err1, err2)
    assert out1 == out2 and out1.strip().endswith(cuda_free_hook.LIBRARY_NAME)
    assert len(log.read_text().splitlines()) == 1, log.read_text()
    FreeChannel(ctypes.CDLL(out1.strip()))
    # A later process finds it without taking the lock or compiling.
    third = subprocess.run(
        [sys.executable, "-c", _BUILD_ONE, str(out)], env=env, capture_output=True, text=True
    )
    assert third.stdout == out1 and len(log.read_text().splitlines()) == 1


def test_a_build_lock_held_too_long_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl

    monkeypatch.setattr(cuda_free_hook, "LOCK_WAIT_S", 0.3)
    lock = tmp_path / "build.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        # Another process holds it (flock locks belong to the open file, not the process).
        start = time.monotonic()
        with (
            pytest.raises(OSError, match="another process has been building"),
            cuda_free_hook._build_lock(lock),
        ):
            pass
        assert time.monotonic() - start >= 0.3
    finally:
        os.close(fd)
    with cuda_free_hook._build_lock(lock):
        pass  # free again once its holder let go


_FOREIGN_ATTACH = """
import socket, sys
from smddp.v1 import smddp_pb2 as pb
from smddp.core.wire import MSG_FREE_ATTACH, pack, unpack
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.sendall(pack(MSG_FREE_ATTACH, pb.AttachRequest(session_id=sys.argv[2],
          session_secret=bytes.fromhex(sys.argv[3])).SerializeToString()))
s.settimeout(30)
kind, payload = unpack(s.recv(1 << 20))
print(pb.AttachReply.FromString(payload).error)
"""


def test_the_free_channel_belongs_to_its_process_and_its_loss_fails_nothing(daemon) -> None:
    """smddpd answers a SegmentFree on the channel (nothing mapped: closes none), refuses a
    channel claimed by another process with a session's secret, and the communicator goes
    on when the channel closes."""
    import sys

    import numpy as np

    from smddp.client import connect
    from smddp.core.wire import DATA_SOCKET_SUFFIX, unpack

    comm = connect("free-channel", b"t" * 16, 0, 1, socket_path=daemon.socket, timeout_s=30)
    try:
        sock = comm.session.open_free_channel()
        req = pb.SegmentFree(alloc_base=BASE, nbytes=4096, seq=7, wait_ms=1000)
        sock.sendall(pack(MSG_FREE, req.SerializeToString()))
        sock.settimeout(30)
        kind, payload = unpack(sock.recv(4096))
        assert kind == MSG_FREE_REPLY
        assert pb.SegmentFreeReply.FromString(payload) == pb.SegmentFreeReply(seq=7)
        foreign = subprocess.run(
            [
                sys.executable,
                "-c",
                _FOREIGN_ATTACH,
                daemon.socket + DATA_SOCKET_SUFFIX,
                comm.session.session_id,
                comm.session._secret.hex(),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "a free channel must come from the process of an attached session" in (
            foreign.stdout
        ), foreign
        sock.close()
        x = np.arange(8, dtype=np.float32)
        comm.all_reduce(x).wait()
        assert (x == np.arange(8, dtype=np.float32)).all()
    finally:
        comm.close()
