"""Finding a daemon, or starting a private one for the job when none answers.

A system daemon (``/run/smddp/smddpd.sock``, or ``ClientConfig.socket``) is used whenever it
answers its health check. Otherwise the job's local leader starts ``smddpd`` on a socket in
a private temporary folder; it lives as long as the job: it exits once its owner process is
gone and no rank is registered, or at once when the job's launcher (torchrun, the parent of
the rank that started it) is gone, and removes its folder on the way out. A daemon that could
not (SIGKILL, OOM kill) leaves the folder behind; the next embedded start of the same user
removes such folders once nothing listens on their socket.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from smddp.client.config import ENV_EMBEDDED, ENV_SOCKET, ClientConfig
from smddp.client.discovery import candidates as socket_candidates
from smddp.client.errors import ConnectError
from smddp.client.session import grpc_channel

log = logging.getLogger("smddp")

START_TIMEOUT_S = 60.0
FOLDER_PREFIX = "smddp-job-"
SOCKET_NAME = "smddpd.sock"
BIND_GRACE_S = 5.0  # a socket this young may belong to a daemon between bind() and listen()


def daemon_answers(path: str, timeout_s: float = 2.0) -> bool:
    """True when a daemon at ``path`` reports SERVING on its health service."""
    if not os.path.exists(path):
        return False
    try:
        stub = health_pb2_grpc.HealthStub(grpc_channel(path))
        # typeshed's HealthStub declares no methods (a lapse of the stub): Check, typed here.
        check: grpc.UnaryUnaryMultiCallable[
            health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
        ] = stub.Check  # type: ignore[attr-defined]
        reply = check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    except grpc.RpcError:
        return False
    serving: bool = reply.status == health_pb2.HealthCheckResponse.SERVING
    return serving


def find_or_start_daemon(peer_host: str | None = None, config: ClientConfig | None = None) -> str:
    """The socket of a daemon for this node: a running one, or a new embedded one.

    Args:
        peer_host: for a job that spans nodes, the address other nodes reach this one at;
            an embedded daemon then listens for peers on an ephemeral port.
        config: the client's configuration (default: from the environment).

    Raises:
        ConnectError: none answers and starting one is forbidden or fails.
    """
    config = config or ClientConfig.from_env()
    candidates = socket_candidates(config)
    for path in candidates:
        if daemon_answers(path):
            log.warning(
                "smddp: "
                "using the smddpd that answers at %s (a daemon of this node, not started by this job)",  # noqa: E501
                path,
            )
            return path
    if not config.embedded:
        raise ConnectError(
            f"no smddpd answers at {', '.join(candidates)} and {ENV_EMBEDDED}=0 forbids starting one"  # noqa: E501
        )
    return _start(config, candidates, peer_host)


def _listening(path: str) -> bool:
    """Whether a process accepts connections on the unix socket ``path`` (a daemon that is
    alive but busy still counts: only a refused or missing socket means it is gone)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError as exc:
            return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    return True


def clean_stale_folders(tmp: str | None = None, now: float | None = None) -> list[str]:
    """Removes this user's embedded-daemon folders whose daemon is gone.

    A folder counts as stale when it is a real directory owned by this uid that holds
    nothing but the daemon's unix sockets (``smddpd.sock``, ``smddpd.sock.data``), none of
    which accepts a connection any more and all older than BIND_GRACE_S, or that is empty
    and older than START_TIMEOUT_S (a daemon that died before it bound; a younger one may
    still be starting). Other users' folders, and folders holding anything else, are left
    alone.

    Returns:
        The folders removed.
    """
    tmp = tmp or tempfile.gettempdir()
    now = time.time() if now is None else now
    removed = []
    for folder in glob.glob(os.path.join(glob.escape(tmp), FOLDER_PREFIX + "*")):
        try:
            st = os.lstat(folder)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            sockets = [os.path.join(folder, name) for name in os.listdir(folder)]
            if not sockets and now - st.st_mtime < START_TIMEOUT_S:
                continue
            if not all(_dead_socket(path, now) for path in sockets):
                continue
            for path in sockets:
                os.unlink(path)
            os.rmdir(folder)
        except OSError:
            continue
        removed.append(folder)
    if removed:
        log.info(
            "smddp: removed %d folder(s) of embedded daemons that are gone: %s",
            len(removed),
            ", ".join(removed),
        )
    return removed


def _dead_socket(path: str, now: float) -> bool:
    """Whether ``path`` is a daemon's socket, old enough and refusing connections."""
    st = os.lstat(path)
    return (
        os.path.basename(path).startswith(SOCKET_NAME)
        and stat.S_ISSOCK(st.st_mode)
        and now - st.st_mtime >= BIND_GRACE_S
        and not _listening(path)
    )


def _launcher_pid() -> int:
    """The job's launcher for the embedded daemon to watch: this rank's parent when a launcher
    started it (LOCAL_RANK set, as torchrun and its kin do) and the parent is not init (the
    launcher already gone, or a process that daemonized itself); 0 otherwise. A rank started
    from a shell (``nohup python train.py &``) must outlive that shell, so it is not watched.
    The owner (this process) may outlive a SIGKILLed torchrun with the other ranks; the daemon
    then exits and they fail with DaemonLostError instead of running on unsupervised."""
    if os.environ.get("LOCAL_RANK") is None:
        return 0
    parent = os.getppid()
    return parent if parent > 1 else 0


def start_embedded_daemon(
    tried: list[str] | None = None,
    peer_host: str | None = None,
    config: ClientConfig | None = None,
) -> str:
    """Starts smddpd for this job on a private socket and waits until it serves.

    Args:
        tried: the sockets where no daemon answered, for the log line.
        peer_host: as for ``find_or_start_daemon``.
        config: the client's configuration (default: from the environment).

    Returns:
        The new daemon's socket path.

    Raises:
        ConnectError: the daemon exited or did not become ready in time.
    """
    return _start(config or ClientConfig.from_env(), tried, peer_host)


def _start(config: ClientConfig, tried: list[str] | None, peer_host: str | None) -> str:
    """``start_embedded_daemon`` with the configuration its caller built."""
    clean_stale_folders()
    folder = tempfile.mkdtemp(prefix=FOLDER_PREFIX)  # mode 0700: only this user reaches it
    path = os.path.join(folder, SOCKET_NAME)
    env = dict(os.environ)
    env.pop(ENV_SOCKET, None)
    cmd = [
        sys.executable,
        "-m",
        "smddp.server",
        "--socket",
        path,
        "--owner-pid",
        str(os.getpid()),
        "--http-bind",
        "off",
        *(
            [
                "--peer-bind",
                "0.0.0.0:0",
                "--data-port",
                "0",
                "--ucx-port",
                "0",
                "--advertise",
                peer_host,
            ]
            if peer_host
            else ["--peer-bind", "off"]
        ),
        "--log-level",
        config.embedded_log_level,
    ]
    launcher = _launcher_pid()
    if launcher:
        cmd += ["--launcher-pid", str(launcher)]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not daemon_answers(path, timeout_s=1.0):
        if proc.poll() is not None:
            raise ConnectError(
                f"the embedded smddpd exited with status {proc.returncode} before serving"
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise ConnectError(
                f"the embedded smddpd did not serve on {path} within {START_TIMEOUT_S:.0f} s"
            )
        time.sleep(0.05)
    where = f" at {', '.join(tried)}" if tried else ""
    log.warning(
        "smddp: no smddpd answers%s; started an embedded daemon for this job on %s (pid %d)",
        where,
        path,
        proc.pid,
    )
    return path
