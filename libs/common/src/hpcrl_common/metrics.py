"""Prometheus metrics and a health endpoint on one HTTP port, the same for every service.

``GET /metrics`` is the Prometheus exposition; ``GET /healthz`` answers 200 with a JSON
body while the service's health check passes and 503 otherwise.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, Info, make_wsgi_app

HealthCheck = Callable[[], tuple[bool, dict[str, Any]]]

SERVICE_INFO = Info("hpcrl_service", "Which hpcrl service runs in this process")


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class MetricsServer:
    """Serves /metrics and /healthz from a daemon thread."""

    def __init__(
        self,
        service: str,
        health: HealthCheck,
        host: str = "0.0.0.0",
        port: int = 0,
        registry: CollectorRegistry = REGISTRY,
    ) -> None:
        SERVICE_INFO.info({"service": service})
        metrics_app = make_wsgi_app(registry)
        self._health = health

        def app(environ: dict[str, Any], start_response: Callable) -> list[bytes]:
            if environ.get("PATH_INFO") == "/healthz":
                return self._healthz(start_response)
            return metrics_app(environ, start_response)

        self._server = make_server(
            host, port, app, server_class=_ThreadingWSGIServer, handler_class=_QuietHandler
        )
        self.port = self._server.server_port
        self._thread = threading.Thread(
            target=self._server.serve_forever, name=f"{service}-metrics", daemon=True
        )

    def _healthz(self, start_response: Callable) -> list[bytes]:
        try:
            ok, detail = self._health()
        except Exception as exc:  # a broken check is itself unhealthy
            ok, detail = False, {"error": repr(exc)}
        status = "200 OK" if ok else "503 Service Unavailable"
        body = json.dumps({"healthy": ok, **detail}, default=str).encode()
        start_response(status, [("Content-Type", "application/json")])
        return [body]

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
