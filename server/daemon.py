"""Wires the daemon together: registry, gRPC and data sockets, health, watchdog."""

from __future__ import annotations

import functools
import grp
import logging
import os
import resource
import socket
import threading
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from smddp.core.wire import DATA_SOCKET_SUFFIX
from smddp.server import notify, supervise, tls
from smddp.server.config import DaemonConfig
from smddp.server.data_socket import DataSocketServer
from smddp.server.errors import SmddpError
from smddp.server.gpu_supply import DaemonGpu, RuntimeFactory
from smddp.server.http import HttpServer
from smddp.server.metrics import Metrics
from smddp.server.peer_control import PeerControl
from smddp.server.peer_service import PeerService, server_credentials
from smddp.server.peer_transport import CommPeers, PeerNetwork
from smddp.server.peer_wire import parse_address
from smddp.server.registry import Registry
from smddp.server.service import NodeService
from smddp.server.topology import advertise_address
from smddp.server.undecodable import RefuseUndecodable
from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

NODE_SERVICE = pb.DESCRIPTOR.services_by_name["Node"].full_name
WATCHDOG_PERIOD_S = 0.2
# An embedded daemon whose owner is gone waits this long for its last ranks to leave.
ORPHAN_GRACE_S = 30.0
# Node-service threads beyond the waiting Rendezvous calls and Ops streams: for Register,
# Status, health and the rest, which must answer however many of those wait.
SPARE_GRPC_THREADS = 32
# Descriptors a new job needs (gRPC and data connections, an arena per rank): below this
# many free ones the daemon says it cannot take jobs.
SPARE_FDS = 64
FD_CHECK_PERIOD_S = 1.0


def _free_fds() -> int:
    """Descriptors this process may still open (RLIMIT_NOFILE minus those open)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    try:
        return soft - len(os.listdir("/proc/self/fd"))
    except OSError:  # EMFILE itself: no descriptor left to list them with
        return 0


def _zombie(pid: int) -> bool:
    """True when ``pid`` has exited and only waits to be reaped.

    Its parent may be waiting for us: ``subprocess.run(..., capture_output=True)`` reaps the
    job only at EOF on the pipes that we, started by the job, inherited.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    end = stat.rfind(b")")  # the command name may contain spaces and parentheses
    return stat[end + 2 : end + 3] == b"Z"


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks after boot, /proc/PID/stat field 22), or
    None when there is no such process: with the pid, it names one process, whereas a pid
    alone may since have been given to another."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    end = stat.rfind(b")")  # the command name may contain spaces and parentheses
    fields = stat[end + 2 :].split()
    try:
        return int(fields[19])  # field 22; fields[0] is field 3 (the state)
    except (IndexError, ValueError):
        return None


def _answers(data_socket: str) -> bool:
    """True when a live daemon accepts connections on ``data_socket``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.connect(data_socket)
        return True
    except OSError:
        return False
    finally:
        probe.close()


class Daemon:
    """One smddpd: start(), then stop() from a signal handler or a test.

    Args:
        config: its configuration.
        gpu_runtime: makes the CUDA runtime of its GPU ops at the first GPU op (or at start
            with ``--gpu-warm start``); CuPy's when None. Tests pass a fake one
            (``tests/gpu/fake_smddpd.py``).
    """

    def __init__(self, config: DaemonConfig, gpu_runtime: RuntimeFactory | None = None) -> None:
        self.config = config
        # Its one GPU side, handed to the registry and the data socket; CuPy (or the given
        # runtime) waits for the first GPU op.
        self.gpu = DaemonGpu(config.gpu_chunk_bytes, runtime_factory=gpu_runtime)
        self.metrics = Metrics()
        # Made by start(), once the peer listener (if any) knows its address.
        self.registry: Registry
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self.stopped = threading.Event()
        self.stopping = False
        self.last_tick = time.monotonic()
        self.http: HttpServer | None = None
        self._grpc: grpc.Server | None = None
        self._tcp: grpc.Server | None = None
        self._peers: PeerNetwork | None = None
        self._peer_grpc: grpc.Server | None = None
        self._watchdog_pinger = notify.Watchdog(healthy=self.alive)
        self._data: DataSocketServer | None = None
        self._orphaned_at: float | None = None
        # The launcher's start time, taken now while it runs: a later process given its pid
        # has another (None: it was already gone, and the first tick says so).
        self._launcher_start = (
            _start_time(self.config.launcher_pid) if self.config.launcher_pid else None
        )
        self._free_fds = 1 << 30
        self._fds_checked = 0.0
        self._serving: bool | None = None  # what health last said about the Node service
        self.listeners: list[str] = []  # "what at where", for the startup line

    @property
    def data_socket_path(self) -> str:
        return self.config.socket + DATA_SOCKET_SUFFIX

    def start(self) -> None:
        """Binds every listener and starts serving; returns once ready."""
        cfg = self.config
        gid = grp.getgrnam(cfg.socket_group).gr_gid if cfg.socket_group else None
        mode = 0o660 if gid is not None else 0o600
        folder = os.path.dirname(cfg.socket) or "."
        if not os.path.isdir(folder):
            # A folder we create must let the socket group reach the socket: its group, and
            # its mode whatever the umask (systemd's UMask=0077 would make it 0700).
            os.makedirs(folder, exist_ok=True)
            if gid is not None:
                os.chown(folder, -1, gid)
            os.chmod(folder, 0o750 if gid is not None else 0o700)
        if _answers(self.data_socket_path):
            raise RuntimeError(f"another smddpd is already serving on {cfg.socket}")
        if os.path.exists(cfg.socket):
            os.unlink(cfg.socket)  # a stale socket of a previous run; nobody answers on it
        workers = cfg.max_pending_rendezvous + cfg.max_op_streams + SPARE_GRPC_THREADS
        server = grpc.server(
            supervise.named_pool(workers, "smddp-grpc"),
            options=[("grpc.max_receive_message_length", 4 << 20), ("grpc.so_reuseport", 0)],
            interceptors=[RefuseUndecodable()],
        )
        peer_server, address = None, ""
        if cfg.peer_bind and cfg.peer_bind != "off":
            peer_server, address = self._bind_peers()
        self.registry = Registry(cfg, self.metrics, self.gpu, self._peers, address)
        self.metrics.watch(
            self.registry.session_count, self.registry.job_count, self.registry.arena_bytes,
            self.registry.drain_metrics,
        )  # fmt: skip
        if peer_server is not None:
            self._serve_peers(peer_server)
        pb_grpc.add_NodeServicer_to_server(NodeService(self.registry), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                NODE_SERVICE,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        server.add_insecure_port("unix:" + cfg.socket)
        self.listeners.append(f"gRPC {cfg.socket}")
        server.start()
        if gid is not None:
            os.chown(cfg.socket, -1, gid)
        os.chmod(cfg.socket, mode)
        self._grpc = server
        if cfg.grpc_bind:
            # The TCP listener is for probes and monitoring: health and reflection only, never
            # the Node service (registration and ops stay on the local socket).
            # No SO_REUSEPORT: a second daemon on the same port must fail to start, not split
            # the probes between two daemons.
            tcp = grpc.server(
                supervise.named_pool(8, "smddp-probe"),
                options=[("grpc.so_reuseport", 0)],
                interceptors=[RefuseUndecodable()],
            )
            health_pb2_grpc.add_HealthServicer_to_server(self.health, tcp)
            reflection.enable_server_reflection(
                (
                    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                    reflection.SERVICE_NAME,
                ),
                tcp,
            )
            port = tcp.add_insecure_port(cfg.grpc_bind)
            self.listeners.append(f"gRPC health {cfg.grpc_bind.rpartition(':')[0]}:{port}")
            tcp.start()
            self._tcp = tcp
        self._data = DataSocketServer(self.data_socket_path, self.registry, self.gpu, mode, gid)
        self._data.start()
        self.listeners.append(f"data {self.data_socket_path}")
        if cfg.http_bind and cfg.http_bind != "off":
            self.http = HttpServer(cfg.http_bind, self.metrics.registry, self.alive, self.ready)
            self.http.start()
            self.listeners.append(f"HTTP {cfg.http_bind.rpartition(':')[0]}:{self.http.port}")
        threading.Thread(target=self._watchdog, name="smddp-watchdog", daemon=True).start()
        if cfg.gpu_warm == "start":
            threading.Thread(target=self._warm_gpus, name="smddp-gpu-start", daemon=True).start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._update_health()
        notify.notify(notify.READY)
        self._watchdog_pinger.start()
        log.info(
            "smddpd serving on %s (node %s, pid %d, peers %s); listening: %s",
            cfg.socket,
            cfg.node_id,
            os.getpid(),
            f"{self.registry.peer_address}, data over {cfg.peer_transport} port {self._peers.data_port}"  # noqa: E501
            if self._peers is not None
            else "off (--peer-bind off)",
            ", ".join(self.listeners),
        )

    def _warm_gpus(self) -> None:
        """--gpu-warm start: the GPU ops made now (CuPy imported, the common kernels compiled
        on every GPU in the background), not at the first GPU op; a node where that fails
        serves on, and its GPU ops fail with the same message."""
        started = time.monotonic()
        try:
            self.gpu.ops(self.config.node_id)
        except SmddpError as exc:
            log.warning("--gpu-warm start: no GPU ops at start: %s", exc)
            return
        log.info(
            "--gpu-warm start: "
            "GPU ops ready in %.2f s; "
            "the common kernels compile in the background",
            time.monotonic() - started,
        )

    def _find_peers(self, job_id: str, comm_id: str, proof: bytes) -> CommPeers | None:
        """The peers of the communicator a data connection's HELLO names, if it is here."""
        comm = self.registry.find_comm(job_id, comm_id, proof)
        return comm.peers if comm is not None else None

    def _bind_peers(self) -> tuple[grpc.Server, str]:
        """Binds the Peer service's port (gRPC) on --peer-bind and makes the data listener on
        its host; returns the server, not yet serving, and the address to advertise."""
        cfg = self.config
        host = parse_address(cfg.peer_bind)[0]
        tls_files = (cfg.tls_cert, cfg.tls_key, cfg.tls_ca) if cfg.tls_cert else None
        transport = pb.UCX if cfg.peer_transport == "ucx" else pb.TCP
        self._peers = PeerNetwork(
            host,
            cfg.data_port,
            transport,
            self._find_peers,
            PeerControl(tls_files),
            cfg.ucx_port,
            tls=tls.contexts(*tls_files) if tls_files else None,
            exchange=cfg.exchange_settings(),
        )
        server = grpc.server(
            # Meet holds a thread per rank of a rendezvous until every rank arrived.
            supervise.named_pool(256, "smddp-peer-rpc"),
            options=[("grpc.max_receive_message_length", 1 << 20), ("grpc.so_reuseport", 0)],
            interceptors=[RefuseUndecodable()],
        )
        try:
            if tls_files:
                port = server.add_secure_port(cfg.peer_bind, server_credentials(*tls_files))
            else:
                port = server.add_insecure_port(cfg.peer_bind)
        except RuntimeError as exc:
            port, detail = 0, f": {exc}"
        else:
            detail = ""
        if not port:
            self._peers.stop()
            raise RuntimeError(
                f"cannot listen for other daemons on {cfg.peer_bind} (--peer-bind){detail}"
            )
        self._peer_grpc = server
        address = advertise_address(host, port, cfg.advertise)
        self.listeners.append(f"peer control {host}:{port} (advertised {address})")
        return server, address

    def _serve_peers(self, server: grpc.Server) -> None:
        """Starts the Peer service and the data listener that ``_bind_peers`` made."""
        assert self._peers is not None
        pb_grpc.add_PeerServicer_to_server(PeerService(self.registry, self._peers), server)
        server.start()
        self._peers.start()
        host = parse_address(self.config.peer_bind)[0]
        self.listeners.append(f"peer data tcp {host}:{self._peers.tcp_port}")
        if self._peers.transport == pb.UCX:
            self.listeners.append(f"peer data ucx port {self._peers.data_port}")

    def stop(self, grace_s: float = 2.0) -> None:
        """Reports NOT_SERVING, fails every job's ops with a clear error, closes the sockets."""
        if self.stopped.is_set() or self.stopping:
            return
        self.stopping = True
        notify.notify(notify.STOPPING)
        self._watchdog_pinger.stop()
        self.health.enter_graceful_shutdown()
        self.registry.shutdown("smddpd is shutting down")
        if self._data is not None:
            self._data.stop()
        if self._grpc is not None:
            self._grpc.stop(grace_s).wait()
        if self._tcp is not None:
            self._tcp.stop(0).wait()
        if self._peer_grpc is not None:
            self._peer_grpc.stop(0).wait()
        if self._peers is not None:
            self._peers.stop()
        if self.http is not None:
            self.http.stop()
        if self.config.owner_pid:
            # An embedded daemon owns its private folder; leave nothing behind.
            for path in (self.config.socket, os.path.dirname(self.config.socket)):
                try:
                    os.rmdir(path) if os.path.isdir(path) else os.unlink(path)
                except OSError:
                    pass
        self.stopped.set()
        log.info("smddpd stopped")

    def alive(self) -> bool:
        """True while the daemon's own watchdog loop keeps ticking."""
        return (
            not self.stopped.is_set()
            and time.monotonic() - self.last_tick < 10 * WATCHDOG_PERIOD_S + 5
        )

    def ready(self) -> tuple[bool, str]:
        """Whether new jobs are welcome, and why not."""
        if self.stopping or self.stopped.is_set():
            return False, "shutting down"
        if not self.alive():
            return False, "the daemon's watchdog loop is stuck"
        if self.registry.job_count() >= self.config.max_jobs:
            return False, f"serving the maximum of {self.config.max_jobs} jobs (--max-jobs)"
        if self._data is not None:
            ok, why = self._data.healthy()
            if not ok:
                return False, why
        if self._free_fds < SPARE_FDS:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            return (
                False,
                f"out of file descriptors ({max(self._free_fds, 0)} of RLIMIT_NOFILE {soft} left)",
            )
        return True, "ready"

    def _update_health(self) -> None:
        """The Node service's health follows ready(): NOT_SERVING while no job can start."""
        ok, why = self.ready()
        if ok != self._serving and not self.stopping:
            # None before the first check: only a return from NOT_SERVING is a recovery.
            recovered = self._serving is False
            self._serving = ok
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if ok
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            self.health.set(NODE_SERVICE, status)
            if ok and recovered:
                log.info("ready for new jobs again")
            elif ok:
                log.info("ready for new jobs")
            else:
                log.warning("cannot take new jobs: %s", why)

    def _watchdog(self) -> None:
        while not self.stopped.wait(WATCHDOG_PERIOD_S):
            with supervise.unit("the watchdog ticked"):
                if self._tick():
                    return

    def _tick(self) -> bool:
        """One round of the watchdog; True when the daemon is to stop (its owner is gone).

        Each piece of work is a unit of its own (``supervise.unit``): a communicator whose
        check raises fails alone, on all its ranks; the others are still timed, and the tick
        goes on to health, which stays SERVING (the watchdog still ticks).
        """
        now = time.monotonic()
        self.last_tick = now
        for comm in self.registry.comms():
            if comm.failed() is not None:
                continue  # nothing left to time; a check that raised is not run again
            with supervise.unit(
                "the watchdog checked a communicator's timeouts",
                comm.name(),
                {"job": comm.job_id, "comm": comm.comm_id},
                on_error=functools.partial(comm.internal_error, "checking its timeouts"),
            ):
                comm.check_timeouts(now)
        with supervise.unit("the watchdog expired registrations"):
            self.registry.expire(now)
        if now - self._fds_checked >= FD_CHECK_PERIOD_S:
            self._fds_checked = now
            with supervise.unit("the watchdog counted free descriptors"):
                self._free_fds = _free_fds()
        with supervise.unit("the watchdog updated health"):
            self._update_health()
        if self.config.launcher_pid and self._launcher_gone():
            log.warning(
                "the launcher (pid %d) of the job that started this embedded smddpd has gone; "
                "exiting",
                self.config.launcher_pid,
            )
            threading.Thread(target=self.stop, daemon=True).start()
            return True
        if self.config.owner_pid and self._owner_gone(now):
            log.info("the job that started this embedded smddpd has ended; exiting")
            threading.Thread(target=self.stop, daemon=True).start()
            return True
        return False

    def _launcher_gone(self) -> bool:
        """True once the job's launcher has exited (or is a zombie), or its pid now names
        another process. Its ranks may live on (torchrun SIGKILLed leaves them running): they
        lose this daemon and raise DaemonLostError rather than wait on a job nobody runs."""
        pid = self.config.launcher_pid
        if self._launcher_start is None or _zombie(pid):
            return True
        return _start_time(pid) != self._launcher_start

    def _owner_gone(self, now: float) -> bool:
        try:
            os.kill(self.config.owner_pid, 0)
            if not _zombie(self.config.owner_pid):
                return False
        except ProcessLookupError:
            pass
        except PermissionError:
            return False
        if self.registry.session_count() == 0:
            return True
        if self._orphaned_at is None:
            self._orphaned_at = now
        return now - self._orphaned_at > ORPHAN_GRACE_S
