"""Prometheus metrics and a health endpoint on one HTTP port, the same for every service.

``GET /metrics`` is the Prometheus exposition; ``GET /healthz`` answers 200 with a JSON
body while the service's health check passes and 503 otherwise.

:class:`BusyTime` is how long a service was working: the wall-clock time during which at least
one item (a message's handler, a periodic task) was in progress, overlapping items counted
once. Wall time of a run divided by the busiest service's busy time says how well the
services overlap (1.0: the slowest one never waited).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Info, make_wsgi_app

HealthCheck = Callable[[], tuple[bool, dict[str, Any]]]

SERVICE_INFO = Info("hpcrl_service", "Which hpcrl service runs in this process")
# Names that readers of a scrape (deploy/local/overlap_report.py) look up.
BUSY_SECONDS_NAME = "hpcrl_service_busy_seconds"
FIRST_BUSY_NAME = "hpcrl_service_first_busy_timestamp_seconds"
BUSY_SECONDS = Counter(
    BUSY_SECONDS_NAME,
    "Wall time with at least one item in progress (handlers, periodic tasks; overlapping "
    "items counted once; waits for another item's engine or a policy version excluded)",
    ["client"],
)
FIRST_BUSY = Gauge(
    FIRST_BUSY_NAME,
    "Unix time at which this client started its first item: past model loading and start-up",
    ["client"],
)


class BusyTime:
    """Wall-clock time during which at least one item is being worked on.

    :meth:`working` brackets one item, from any number of threads at once: the time counts
    while one or more are open, so two overlapping items of 10 s each starting 5 s apart
    make 15 s, not 20. :meth:`idle` brackets a wait inside an item (for a lock another item
    holds, for a policy version): that item does not count meanwhile. With a ``client``, the
    time goes to ``hpcrl_service_busy_seconds_total{client}`` as it accrues (a scrape during a
    long item sees the time so far, see :func:`flush_busy`); without, it is only kept here.
    """

    def __init__(
        self,
        client: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._counter = None if client is None else BUSY_SECONDS.labels(client)
        self._clock, self._wall_clock = clock, wall_clock
        self._lock = threading.Lock()
        self._open = 0  # items counting now
        self._since = 0.0  # clock() when the time not yet added started
        self._seconds = 0.0
        self._mine = threading.local()  # this thread's open items, so idle() knows it has one
        self.first_started: float | None = None  # wall-clock time of the first item
        _TRACKERS.add(self)

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        self._enter()
        self._mine.depth = getattr(self._mine, "depth", 0) + 1
        try:
            yield
        finally:
            self._mine.depth -= 1
            self._leave()

    @contextlib.contextmanager
    def idle(self) -> Iterator[None]:
        """Within :meth:`working` on this thread: this item waits and does not count. Elsewhere
        (no item open on this thread, e.g. a handler called directly by a test) it does
        nothing, so it can never take away another thread's item."""
        if getattr(self._mine, "depth", 0) <= 0 or getattr(self._mine, "idle", False):
            yield
            return
        self._mine.idle = True
        self._leave()
        try:
            yield
        finally:
            self._enter()
            self._mine.idle = False

    def seconds(self) -> float:
        """Busy seconds so far, an open stretch included."""
        with self._lock:
            return self._seconds + (self._clock() - self._since if self._open else 0.0)

    def flush(self) -> None:
        """Add the open stretch to the counter now instead of when it ends."""
        with self._lock:
            if self._open:
                self._add(self._clock())

    def _enter(self) -> None:
        with self._lock:
            if self._open == 0:
                self._since = self._clock()
                if self.first_started is None:
                    self.first_started = self._wall_clock()
                    # Created here, not with the counter: a 0 would read as 1970.
                    if self._client is not None:
                        FIRST_BUSY.labels(self._client).set(self.first_started)
            self._open += 1

    def _leave(self) -> None:
        with self._lock:
            self._open -= 1
            if self._open == 0:
                self._add(self._clock())

    def _add(self, now: float) -> None:  # lock held
        elapsed = max(0.0, now - self._since)
        self._seconds += elapsed
        self._since = now
        if self._counter is not None:
            self._counter.inc(elapsed)


_TRACKERS: weakref.WeakSet[BusyTime] = weakref.WeakSet()


def flush_busy() -> None:
    """Bring every busy counter of this process up to now (before a scrape)."""
    for tracker in list(_TRACKERS):
        tracker.flush()


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
            # A learner step can last minutes: count it up to now, not only once it ends.
            flush_busy()
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
