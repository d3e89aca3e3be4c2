"""Finding a daemon, or starting a private one for the job when none answers.

A system daemon (``/run/smddp/smddpd.sock``, or ``SMDDP_SOCKET``) is used whenever it
answers its health check. Otherwise the job's local leader starts ``smddpd`` on a socket in
a private temporary folder; it lives as long as the job: it exits once its owner process is
gone and no rank is registered.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from smddp.client.errors import ConnectError
from smddp.client.session import grpc_channel
from smddp.wire import socket_candidates

log = logging.getLogger("smddp")

ENV_EMBEDDED = "SMDDP_EMBEDDED"  # "0" forbids starting a private daemon
START_TIMEOUT_S = 60.0


def daemon_answers(path: str, timeout_s: float = 2.0) -> bool:
    """True when a daemon at ``path`` reports SERVING on its health service."""
    if not os.path.exists(path):
        return False
    try:
        stub = health_pb2_grpc.HealthStub(grpc_channel(path))
        reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def find_or_start_daemon(peer_host: str | None = None) -> str:
    """The socket of a daemon for this node: a running one, or a new embedded one.

    Args:
        peer_host: for a job that spans nodes, the address other nodes reach this one at;
            an embedded daemon then listens for peers on an ephemeral port.

    Raises:
        ConnectError: none answers and starting one is forbidden or fails.
    """
    candidates = socket_candidates()
    for path in candidates:
        if daemon_answers(path):
            log.warning("smddp: using the smddpd that answers at %s (a daemon of this node, not started by this job)", path)
            return path
    if os.environ.get(ENV_EMBEDDED) == "0":
        raise ConnectError(
            f"no smddpd answers at {', '.join(candidates)} and {ENV_EMBEDDED}=0 forbids starting one"
        )
    return start_embedded_daemon(tried=candidates, peer_host=peer_host)


def start_embedded_daemon(tried: list[str] | None = None, peer_host: str | None = None) -> str:
    """Starts smddpd for this job on a private socket and waits until it serves.

    Returns:
        The new daemon's socket path.

    Raises:
        ConnectError: the daemon exited or did not become ready in time.
    """
    folder = tempfile.mkdtemp(prefix="smddp-job-")  # mode 0700: only this user reaches it
    path = os.path.join(folder, "smddpd.sock")
    env = dict(os.environ)
    env.pop("SMDDP_SOCKET", None)
    cmd = [
        sys.executable, "-m", "smddp.server",
        "--socket", path,
        "--owner-pid", str(os.getpid()),
        "--http-bind", "off",
        *(
            ["--peer-bind", "0.0.0.0:0", "--data-port", "0", "--ucx-port", "0", "--advertise", peer_host]
            if peer_host else ["--peer-bind", "off"]
        ),
        "--log-level", os.environ.get("SMDDP_EMBEDDED_LOG_LEVEL", "WARNING"),
    ]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not daemon_answers(path, timeout_s=1.0):
        if proc.poll() is not None:
            raise ConnectError(f"the embedded smddpd exited with status {proc.returncode} before serving")
        if time.monotonic() > deadline:
            proc.kill()
            raise ConnectError(f"the embedded smddpd did not serve on {path} within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.05)
    where = f" at {', '.join(tried)}" if tried else ""
    log.warning(
        "smddp: no smddpd answers%s; started an embedded daemon for this job on %s (pid %d)",
        where, path, proc.pid,
    )
    return path
