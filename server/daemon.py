"""Wires the daemon together: registry, gRPC and data sockets, health, watchdog."""

from __future__ import annotations

import grp
import logging
import os
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from smddp.server.config import DaemonConfig
from smddp.server.data_socket import DataSocketServer
from smddp.server.registry import Registry
from smddp.server.service import NodeService
from smddp.v1 import smddp_pb2 as pb
from smddp.v1 import smddp_pb2_grpc as pb_grpc
from smddp.wire import DATA_SOCKET_SUFFIX

log = logging.getLogger(__name__)

NODE_SERVICE = pb.DESCRIPTOR.services_by_name["Node"].full_name
WATCHDOG_PERIOD_S = 0.2
# An embedded daemon whose owner is gone waits this long for its last ranks to leave.
ORPHAN_GRACE_S = 30.0


class Daemon:
    """One smddpd: start(), then stop() from a signal handler or a test."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.registry = Registry(config)
        self.health = health.HealthServicer(experimental_non_blocking=True)
        self.stopped = threading.Event()
        self._grpc: grpc.Server | None = None
        self._data: DataSocketServer | None = None
        self._orphaned_at: float | None = None

    @property
    def data_socket_path(self) -> str:
        return self.config.socket + DATA_SOCKET_SUFFIX

    def start(self) -> None:
        """Binds every listener and starts serving; returns once ready."""
        cfg = self.config
        gid = grp.getgrnam(cfg.socket_group).gr_gid if cfg.socket_group else None
        mode = 0o660 if gid is not None else 0o600
        folder = os.path.dirname(cfg.socket) or "."
        os.makedirs(folder, mode=0o750 if gid is not None else 0o700, exist_ok=True)
        if os.path.exists(cfg.socket):
            os.unlink(cfg.socket)  # a stale socket of a previous run; nobody answers on it
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=256, thread_name_prefix="smddp-grpc"),
            options=[("grpc.max_receive_message_length", 4 << 20), ("grpc.so_reuseport", 0)],
        )
        pb_grpc.add_NodeServicer_to_server(NodeService(self.registry), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (NODE_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        server.add_insecure_port("unix:" + cfg.socket)
        if cfg.grpc_bind:
            server.add_insecure_port(cfg.grpc_bind)
        server.start()
        if gid is not None:
            os.chown(cfg.socket, -1, gid)
        os.chmod(cfg.socket, mode)
        self._grpc = server
        self._data = DataSocketServer(self.data_socket_path, self.registry, mode, gid)
        self._data.start()
        threading.Thread(target=self._watchdog, name="smddp-watchdog", daemon=True).start()
        for service in ("", NODE_SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("smddpd serving on %s (node %s, pid %d)", cfg.socket, cfg.node_id, os.getpid())

    def stop(self, grace_s: float = 2.0) -> None:
        """Reports NOT_SERVING, fails every job's ops with a clear error, closes the sockets."""
        if self.stopped.is_set():
            return
        self.health.enter_graceful_shutdown()
        self.registry.shutdown("smddpd is shutting down")
        if self._data is not None:
            self._data.stop()
        if self._grpc is not None:
            self._grpc.stop(grace_s).wait()
        if self.config.owner_pid:
            # An embedded daemon owns its private folder; leave nothing behind.
            for path in (self.config.socket, os.path.dirname(self.config.socket)):
                try:
                    os.rmdir(path) if os.path.isdir(path) else os.unlink(path)
                except OSError:
                    pass
        self.stopped.set()
        log.info("smddpd stopped")

    def _watchdog(self) -> None:
        while not self.stopped.wait(WATCHDOG_PERIOD_S):
            now = time.monotonic()
            for comm in self.registry.comms():
                comm.check_timeouts(now)
            if self.config.owner_pid and self._owner_gone(now):
                log.info("the job that started this embedded smddpd has ended; exiting")
                threading.Thread(target=self.stop, daemon=True).start()
                return

    def _owner_gone(self, now: float) -> bool:
        try:
            os.kill(self.config.owner_pid, 0)
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
