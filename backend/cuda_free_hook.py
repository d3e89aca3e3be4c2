"""Close before free, the rank's Python side: builds the allocator hook, opens the free channel.

torch's caching allocator returns segments to the driver (``empty_cache()``, its retry after
an out-of-memory) while smddpd may have them mapped by CUDA IPC, which the driver calls
undefined and which in practice pins the memory, so the retry still fails. The hook in
``backend/csrc/`` (``segment_hook.cpp``) is a trace tracker on the allocator: for a segment about to
be freed that was exported to smddpd, it asks smddpd over this process's free channel
(``backend/csrc/free_channel.cpp``; ``smddp.server.gpu_free`` answers) to unmap it, and the free
proceeds once smddpd has, or after ``SMDDP_FREE_WAIT_MS`` at most (logged). It runs inside
the allocator's lock with the GIL possibly held by the freeing thread, so it is C++ through
and through; this module only builds it, connects it and tells it which segments are
exported (``IpcExporter.on_export``).

The hook is compiled on the first GPU op of a process with a CUDA build of torch, with the
system C++ compiler against torch's headers and libc10_cuda (``torch.utils.cpp_extension``
finds them), and cached under ``TORCH_EXTENSIONS_DIR`` (or ``~/.cache/torch_extensions``)
by a hash of the sources and the torch build. If anything fails (no compiler, no CUDA
headers, an installed package without ``backend/csrc/``, a daemon without the channel) the rank
logs it once and keeps the after-the-fact path: frees are found before each op and
smddpd unmaps them then (``client/cuda_ipc.py``). ``SMDDP_FREE_HOOK=0`` turns the hook off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from smddp.client.errors import ConnectError

if TYPE_CHECKING:
    from smddp.client.cuda_ipc import IpcExporter
    from smddp.client.session import DaemonSession

log = logging.getLogger(__name__)

ENV_HOOK = "SMDDP_FREE_HOOK"  # "0": no hook (frees are reported after the fact)
ENV_WAIT_MS = "SMDDP_FREE_WAIT_MS"  # longest a free waits for smddpd, in milliseconds
DEFAULT_WAIT_MS = 2000
# The C++ sources: beside the Python folders of a source checkout (editable install).
CSRC = Path(__file__).resolve().parent / "csrc"
CHANNEL_SOURCES = ("free_channel.cpp",)
HOOK_SOURCES = ("segment_hook.cpp", "free_channel.cpp")
HEADERS = ("free_channel.h",)
LIBRARY_NAME = "libsmddp_free_hook.so"


class FreeChannel:
    """The C entry points of ``backend/csrc/free_channel.h`` in a loaded library (ctypes releases
    the GIL around each call)."""

    NOT_MAPPED, CLOSED, DEFERRED, TIMEOUT, NO_CHANNEL = range(5)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.smddp_fc_open.argtypes = [ctypes.c_int, ctypes.c_uint32]
        lib.smddp_fc_open.restype = None
        lib.smddp_fc_close.argtypes = []
        lib.smddp_fc_close.restype = None
        lib.smddp_fc_watch.argtypes = [ctypes.c_uint64]
        lib.smddp_fc_watch.restype = None
        lib.smddp_fc_segment_free.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
        lib.smddp_fc_segment_free.restype = ctypes.c_int
        lib.smddp_fc_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
        lib.smddp_fc_stats.restype = None

    def open(self, sock: socket.socket, wait_ms: int) -> None:
        """Hands ``sock`` (an attached free channel) to the library, which owns it now."""
        self.lib.smddp_fc_open(sock.detach(), wait_ms)

    def close(self) -> None:
        """Closes the channel: later frees no longer wait."""
        self.lib.smddp_fc_close()

    def watch(self, base: int) -> None:
        """The segment at ``base`` was exported to smddpd: announce its free."""
        self.lib.smddp_fc_watch(base)

    def segment_free(self, base: int, nbytes: int) -> int:
        """What the allocator hook calls for a segment about to be freed (one of the class's
        codes); tests drive it directly."""
        return int(self.lib.smddp_fc_segment_free(base, nbytes))

    def stats(self) -> dict[str, int]:
        """The library's counters."""
        out = (ctypes.c_uint64 * 6)()
        self.lib.smddp_fc_stats(out)
        names = ("sent", "closed", "deferred", "timeouts", "failed", "watched")
        return dict(zip(names, (int(v) for v in out)))


def compile_library(
    sources: Sequence[str],
    out_dir: Path,
    include_dirs: Sequence[str] = (),
    library_dirs: Sequence[str] = (),
    libraries: Sequence[str] = (),
    defines: Sequence[str] = (),
) -> Path:
    """Compiles ``backend/csrc/`` ``sources`` into a shared library in ``out_dir`` (reused when the
    sources, flags and compiler are unchanged); returns its path.

    Raises:
        OSError, subprocess.CalledProcessError: no compiler, or the compile failed.
    """
    cxx = os.environ.get("CXX") or shutil.which("c++") or "g++"
    args = [
        "-std=c++17",
        "-O2",
        "-fPIC",
        "-shared",
        *(f"-D{d}" for d in defines),
        *(f"-I{d}" for d in include_dirs),
        *(str(CSRC / s) for s in sources),
        *(f"-L{d}" for d in library_dirs),
        *(f"-Wl,-rpath,{d}" for d in library_dirs),
        *(f"-l{name}" for name in libraries),
    ]
    digest = hashlib.sha256(" ".join([cxx, *args]).encode())
    for name in (*sources, *HEADERS):
        digest.update((CSRC / name).read_bytes())
    folder = out_dir / f"smddp_free_hook_{digest.hexdigest()[:16]}"
    path = folder / LIBRARY_NAME
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    # Built beside, then renamed: two ranks building at once never load half a file.
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so")
    os.close(fd)
    try:
        subprocess.run(
            [cxx, *args, "-o", tmp], check=True, capture_output=True, text=True, timeout=300
        )
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def cache_dir() -> Path:
    """Where built hooks are kept (torch's convention for its own extensions)."""
    return Path(
        os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    )


def build_hook() -> ctypes.CDLL:
    """Compiles (or finds) and loads the hook against this process's CUDA torch.

    Raises:
        RuntimeError: torch has no CUDA; OSError, subprocess.CalledProcessError: the build.
    """
    import torch
    from torch.utils import cpp_extension

    if not torch.version.cuda:
        raise RuntimeError(f"torch {torch.__version__} is not a CUDA build")
    cuda_include = _cuda_headers(cpp_extension.CUDA_HOME)
    if cuda_include is None:
        raise RuntimeError(
            "no CUDA headers (cuda_runtime_api.h) under CUDA_HOME or the nvidia-* wheels of "
            "this Python: the hook needs them (install the CUDA toolkit, or set CUDA_HOME)"
        )
    includes = [*cpp_extension.include_paths(), cuda_include]
    lib_dirs = [os.path.join(os.path.dirname(torch.__file__), "lib")]
    path = compile_library(HOOK_SOURCES, cache_dir(), includes, lib_dirs, ["c10_cuda", "c10"])
    return ctypes.CDLL(str(path))


def _cuda_headers(cuda_home: str | None) -> str | None:
    """A folder holding cuda_runtime_api.h: the toolkit's, else that of the nvidia-* wheels
    a CUDA torch brings (nvidia/cuda_runtime/include, nvidia/cu13/include)."""
    folders = [Path(cuda_home) / "include"] if cuda_home else []
    try:
        import nvidia  # the namespace package of NVIDIA's wheels

        for root in nvidia.__path__:
            folders += sorted(Path(root).glob("*/include"))
    except ImportError:
        pass
    for folder in folders:
        if (folder / "cuda_runtime_api.h").exists():
            return str(folder)
    return None


_lock = threading.Lock()
_tried = False
_channel: FreeChannel | None = None


def installed() -> FreeChannel | None:
    """The process's free channel, once ``install`` succeeded."""
    return _channel


def install(
    session: DaemonSession,
    exporter: IpcExporter,
    library: Callable[[], ctypes.CDLL] = build_hook,
) -> FreeChannel | None:
    """Builds and attaches the hook (once per process), opens the free channel on
    ``session``'s daemon and watches ``exporter``'s exports. Never raises: on failure logs
    once and returns None (frees are then reported after the fact).

    Args:
        session: an attached session of this process.
        exporter: the process's CUDA IPC exporter.
        library: loads the library (tests pass the channel alone, without torch's hook).
    """
    global _tried, _channel
    with _lock:
        if _tried:
            return _channel
        _tried = True
        if os.environ.get(ENV_HOOK, "1") == "0":
            log.info("smddp: %s=0: GPU frees are reported to smddpd after the fact", ENV_HOOK)
            return None
        try:
            wait_ms = int(os.environ.get(ENV_WAIT_MS, DEFAULT_WAIT_MS))
        except ValueError:
            wait_ms = DEFAULT_WAIT_MS
        try:
            lib = library()
            channel = FreeChannel(lib)
            hook = getattr(lib, "smddp_free_hook_install", None)
            if hook is not None:
                import torch

                torch.cuda.init()  # trackers attach to the device allocators that exist
                hook.restype = ctypes.c_int
                if hook() != 0:
                    raise RuntimeError("torch refused the allocator trace tracker")
            channel.open(session.open_free_channel(), max(1, wait_ms))
        except (OSError, RuntimeError, ConnectError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", None) or ""
            log.warning(
                "smddp: no close before free (%s%s); smddpd unmaps freed GPU memory at the "
                "rank's next op instead",
                exc,
                f": {detail.strip()[-500:]}" if detail else "",
            )
            return None
        # Hooked first, then the exports so far: none falls between (watching is idempotent).
        exporter.on_export = channel.watch
        for base in exporter.bases():
            channel.watch(base)
        _channel = channel
        return channel
