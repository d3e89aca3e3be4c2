"""The daemon's HTTP listener: /healthz (alive), /readyz (ready for jobs) and /metrics."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from smddp.server import supervise

REQUEST_TIMEOUT_S = 10.0
RESTART_S = 1.0  # between a serve_forever that raised and the next


def parse_bind(bind: str) -> tuple[str, int]:
    """Splits ``HOST:PORT`` (``[v6]:PORT`` too).

    Raises:
        ValueError: no port, or a port that is not a number.
    """
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{bind!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


class HttpServer:
    """Serves the three endpoints from a daemon thread."""

    def __init__(
        self,
        bind: str,
        registry: CollectorRegistry,
        alive: Callable[[], bool],
        ready: Callable[[], tuple[bool, str]],
    ) -> None:
        host, port = parse_bind(bind)

        class Handler(BaseHTTPRequestHandler):
            timeout = REQUEST_TIMEOUT_S  # a connection that sends nothing must not hold its thread

            def do_GET(self) -> None:
                # A request that raises is answered 500 saying why; the server goes on.
                with supervise.unit(
                    "answering an HTTP request", f"GET {self.path[:64]}", on_error=self._failed
                ):
                    self._get()

            def _failed(self, exc: Exception) -> None:
                # The details are in the daemon's log: they may name other users' jobs.
                self._send(
                    500, f"internal error in smddpd ({type(exc).__name__}); see its log\n".encode()
                )

            def _get(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    ok = alive()
                    self._send(200 if ok else 503, b"ok\n" if ok else b"not alive\n")
                elif path == "/readyz":
                    ok, why = ready()
                    self._send(200 if ok else 503, (why + "\n").encode())
                else:
                    self._send(404, b"not found: try /healthz, /readyz or /metrics\n")

            def _send(
                self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8"
            ) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # scrapes every few seconds would drown the daemon's log

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._stopping = False

    def start(self) -> None:
        threading.Thread(target=self._serve, name="smddp-http", daemon=True).start()

    def _serve(self) -> None:
        # serve_forever itself raising (not a request: socketserver answers for those)
        # would leave the port open and unanswered: it starts again instead.
        while not self._stopping:
            with supervise.unit("serving HTTP"):
                self._server.serve_forever()
                return
            time.sleep(RESTART_S)

    def stop(self) -> None:
        self._stopping = True
        self._server.shutdown()
        self._server.server_close()
