"""Close before free, the rank's C++ side (backend/csrc/), without a GPU.

The allocator hook (``segment_hook.cpp``) is compiled for real against the installed torch's
headers (a CPU wheel ships c10/cuda's headers; the CUDA toolkit's come from nvcc's folder),
to an object whose only unresolved names are torch's allocator and the channel; linking it
needs libc10_cuda, which only a CUDA torch has. The channel (``free_channel.cpp``) is built
and loaded alone, and driven through the entry point the hook calls, against the other end
of a socket pair that plays smddpd's part of the wire (the real daemon answers it in
tests/gpu/test_cuda_on_fake_gpu.py): what it sends, the bound on its wait, late answers, a
broken channel.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from smddp.backend import cuda_free_hook
from smddp.backend.cuda_free_hook import FreeChannel
from smddp.v1 import smddp_pb2 as pb
from smddp.wire import MSG_FREE, MSG_FREE_REPLY, pack

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
        assert cuda_free_hook.install(NoSession(), exporter) is None  # type: ignore[arg-type]
        assert cuda_free_hook.install(NoSession(), exporter) is None  # type: ignore[arg-type]
    (record,) = caplog.records
    assert "no close before free (torch" in record.getMessage()
    assert "is not a CUDA build" in record.getMessage()
    assert exporter.on_export is None


_FOREIGN_ATTACH = """
import socket, sys
from smddp.v1 import smddp_pb2 as pb
from smddp.wire import MSG_FREE_ATTACH, pack, unpack
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
    from smddp.wire import DATA_SOCKET_SUFFIX, unpack

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
