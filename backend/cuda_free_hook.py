"""Close before free, the rank's Python side: builds the allocator hook, opens the free channel.

torch's caching allocator returns segments to the driver (``empty_cache()``, its retry after
an out-of-memory) while smddpd may have them mapped by CUDA IPC, which the driver calls
undefined and which in practice pins the memory, so the retry still fails. The hook in
``backend/csrc/`` (``segment_hook.cpp``) is a trace tracker on the allocator: for a segment about to
be freed that was exported to smddpd, it asks smddpd over this process's free channel
(``backend/csrc/free_channel.cpp``; ``smddp.server.gpu_free`` answers) to unmap it, and the free
proceeds once smddpd has, or after ``ClientConfig.free_wait_ms`` (``SMDDP_FREE_WAIT_MS``)
at most (logged). It runs inside the allocator's lock with the GIL possibly held by the
freeing thread, so it is C++ through and through; this module only builds it, connects it
and tells it which segments are exported (``IpcExporter.on_export``).

The hook is compiled on the first GPU op of a process with a CUDA build of torch, with the
system C++ compiler against torch's headers and libc10_cuda (``torch.utils.cpp_extension``
finds them), and cached under ``TORCH_EXTENSIONS_DIR`` (or ``~/.cache/torch_extensions``)
by a hash of the sources and the torch build; ranks of a node building at once wait for
one build (a file lock beside it). The channel follows the process's daemon: the library is
built once, but the channel is reopened (logged) when a free found it broken (at the next GPU
op) and when a new group attaches to another or a restarted smddpd (``install``). If anything
fails (no compiler, no CUDA
headers, an installed package without ``backend/csrc/``, a daemon without the channel) the rank
logs it once and keeps the after-the-fact path: frees are found before each op and
smddpd unmaps them then (``client/cuda_ipc.py``). ``ClientConfig.free_hook`` False
(``SMDDP_FREE_HOOK=0``) turns the hook off. Both settings come from the configuration of the
first group that installs the hook (the C++ side reads no environment: ``install`` hands it
the bound).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from smddp.client.config import DEFAULT_FREE_WAIT_MS, ENV_FREE_HOOK

if TYPE_CHECKING:
    from smddp.client.config import ClientConfig
    from smddp.client.cuda_ipc import IpcExporter
    from smddp.client.session import DaemonSession

log = logging.getLogger(__name__)

DEFAULT_WAIT_MS = DEFAULT_FREE_WAIT_MS  # longest a free waits for smddpd, in milliseconds
# The C++ sources: beside the Python folders of a source checkout (editable install).
CSRC = Path(__file__).resolve().parent / "csrc"
CHANNEL_SOURCES = ("free_channel.cpp",)
HOOK_SOURCES = ("segment_hook.cpp", "free_channel.cpp")
HEADERS = ("free_channel.h",)
LIBRARY_NAME = "libsmddp_free_hook.so"
BUILD_TIMEOUT_S = 300  # one compile
# How long a rank waits for another's build of the same library: past one compile's bound,
# so only a holder that is stuck (not merely slow) is given up on.
LOCK_WAIT_S = BUILD_TIMEOUT_S + 30


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
        lib.smddp_fc_is_open.argtypes = []
        lib.smddp_fc_is_open.restype = ctypes.c_int
        lib.smddp_fc_check.argtypes = []
        lib.smddp_fc_check.restype = ctypes.c_int

    def open(self, sock: socket.socket, wait_ms: int) -> None:
        """Hands ``sock`` (an attached free channel) to the library, which owns it now."""
        self.lib.smddp_fc_open(sock.detach(), wait_ms)

    def close(self) -> None:
        """Closes the channel: later frees no longer wait (until ``refresh`` reopens it)."""
        self.lib.smddp_fc_close()

    def is_open(self) -> bool:
        """Whether a channel is open and no free found it broken (takes no lock)."""
        return bool(self.lib.smddp_fc_is_open())

    def check(self) -> bool:
        """Whether a channel is open with smddpd still at its other end; drops it if not."""
        return bool(self.lib.smddp_fc_check())

    def watch(self, base: int) -> None:
        """The segment at ``base`` was exported to smddpd: announce its free."""
        self.lib.smddp_fc_watch(base)

    def segment_free(self, base: int, nbytes: int) -> int:
        """What the allocator hook calls for a segment about to be freed (one of the class's
        codes); tests drive it directly."""
        return int(self.lib.smddp_fc_segment_free(base, nbytes))

    def stats(self) -> dict[str, int]:
        """The library's counters."""
        out = (ctypes.c_uint64 * 7)()
        self.lib.smddp_fc_stats(out)
        names = ("sent", "closed", "deferred", "timeouts", "failed", "watched", "opens")
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
    # The ranks of a node start their first GPU op together: one compiles, the others wait
    # for its library rather than each spending the same seconds of CPU.
    with _build_lock(folder / "build.lock"):
        if path.exists():
            return path  # built by the process we waited for
        # Built beside, then renamed: a process that does not take the lock (an older
        # smddp) never loads half a file.
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so")
        os.close(fd)
        try:
            subprocess.run(
                [cxx, *args, "-o", tmp],
                check=True,
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
            )
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


@contextlib.contextmanager
def _build_lock(lock_path: Path) -> Iterator[None]:
    """Holds an exclusive flock on ``lock_path`` (as torch's extensions hold their
    ``FileBaton``, but released by the kernel if the holder dies, so never stale).

    Raises:
        OSError: another process held it past LOCK_WAIT_S.
    """
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise OSError(
                        f"another process has been building {lock_path.parent} for more than {LOCK_WAIT_S:.0f} s"  # noqa: E501
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


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
            "no CUDA headers (cuda_runtime_api.h) under CUDA_HOME or the nvidia-* wheels of this Python: "  # noqa: E501
            "the hook needs them (install the CUDA toolkit, or set CUDA_HOME)"
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
_tried = False  # the build was tried: once per process, whatever came of it
_channel: FreeChannel | None = None  # the loaded library, once built and its tracker attached
_wait_ms = DEFAULT_WAIT_MS
_open_on: str | None = None  # the socket of the smddpd the channel was last opened on
_refused: set[str] = set()  # sessions that could not open a channel: not asked again


def installed() -> FreeChannel | None:
    """The process's free channel library, once ``install`` built it."""
    return _channel


def install(
    session: DaemonSession,
    exporter: IpcExporter,
    config: ClientConfig,
    library: Callable[[], ctypes.CDLL] = build_hook,
) -> FreeChannel | None:
    """Builds and attaches the hook (once per process), makes sure the free channel is open on
    ``session``'s daemon and watches ``exporter``'s exports. Called by each new group (an
    attach): the channel is reopened on ``session`` when it broke, when its smddpd went away
    (a restart: the socket is looked at), or when ``session`` is another daemon's. Never
    raises: on failure logs once and returns None (frees are then reported after the fact).

    Args:
        session: an attached session of this process.
        exporter: the exporter of the group's CUDA IPC handles.
        config: the group's configuration: ``free_hook`` and ``free_wait_ms`` (the first
            install's decide, for the process's life).
        library: loads the library (tests pass the channel alone, without torch's hook).
    """
    global _tried, _channel, _wait_ms
    with _lock:
        if not _tried:
            _tried = True
            if not config.free_hook:
                log.info(
                    "smddp: %s=0: GPU frees are reported to smddpd after the fact", ENV_FREE_HOOK
                )
                return None
            _wait_ms = max(1, config.free_wait_ms)
            try:
                _channel = _load(library)
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _no_hook(exc)
                return None
        channel = _channel
        if channel is None:
            return None
        # Watched first, then the exports so far: none falls between (watching is idempotent).
        # Watched even if no channel opens now: a later reopen announces their frees.
        if exporter.on_export != channel.watch:
            exporter.on_export = channel.watch
            for base in exporter.bases():
                channel.watch(base)
        return channel if _ensure_open(channel, session, look=True) else None


def refresh(session: DaemonSession) -> None:
    """Before a GPU op of a group on ``session``: reopens the free channel there if a free
    found it broken. Costs one call that takes no lock when all is well; never raises."""
    channel = _channel
    if channel is None or channel.is_open() or not hasattr(session, "open_free_channel"):
        return
    try:
        with _lock:
            _ensure_open(channel, session, look=False)
    except Exception as exc:  # the user's op must not fail for this
        log.warning("smddp: could not reopen the free channel: %r", exc)


def _load(library: Callable[[], ctypes.CDLL]) -> FreeChannel:
    """Builds (or finds) the library and attaches torch's tracker where it has one."""
    lib = library()
    channel = FreeChannel(lib)
    hook = getattr(lib, "smddp_free_hook_install", None)
    if hook is not None:
        import torch

        # trackers attach to the device allocators that exist
        torch.cuda.init()  # type: ignore[no-untyped-call]  # torch: no annotations
        hook.restype = ctypes.c_int
        if hook() != 0:
            raise RuntimeError("torch refused the allocator trace tracker")
    return channel


def _no_hook(exc: BaseException) -> None:
    detail = getattr(exc, "stderr", None) or ""
    log.warning(
        "smddp: "
        "no close before free (%s%s); "
        "smddpd unmaps freed GPU memory at the rank's next op instead",
        exc,
        f": {detail.strip()[-500:]}" if detail else "",
    )


def _ensure_open(channel: FreeChannel, session: DaemonSession, look: bool) -> bool:
    """Opens the channel on ``session`` unless it is open, on ``session``'s smddpd, and (with
    ``look``) its socket still has a peer; logs each (re)open once. ``_lock`` held.
    Returns whether a channel is open."""
    global _open_on
    alive = channel.check() if look else channel.is_open()
    if alive and _open_on == session.socket_path:
        return True
    if session.session_id in _refused:
        return alive
    if _open_on is None:
        why = None
    elif not alive:
        why = "the channel to smddpd broke or smddpd restarted"
    else:
        why = f"the process's smddpd is now the one at {session.socket_path}"
    try:
        channel.open(session.open_free_channel(), _wait_ms)
    except Exception as exc:  # whatever it was (ConnectError mostly), the ops carry on without
        _refused.add(session.session_id)
        if why is None:
            _no_hook(exc)
        else:
            log.warning(
                "smddp: "
                "%s, and a new free channel could not be opened (%s); "
                "smddpd unmaps freed GPU memory at the rank's next op instead",
                why,
                exc,
            )
        return alive
    _open_on = session.socket_path
    if why is not None:
        log.warning(
            "smddp: %s: free channel reopened on session %s (job %s, rank %d)",
            why,
            session.session_id,
            session.job_id,
            session.rank,
        )
    return True
