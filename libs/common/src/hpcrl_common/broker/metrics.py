"""The broker layer's Prometheus metrics (one place, so their order in the generated
reference tables stays as it is)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

CONSUMED = Counter(
    "hpcrl_broker_consumed_total",
    "Messages taken off a queue, by how they were settled",
    ["queue", "outcome"],
)
PUBLISHED = Counter(
    "hpcrl_broker_published_total", "Messages confirmed by the broker", ["routing_key"]
)
RECONNECTS = Counter("hpcrl_broker_reconnects_total", "Connection losses recovered", ["client"])
PERIODIC_FAILURES = Counter(
    "hpcrl_broker_periodic_failures_total",
    "Runs of a periodic task (e.g. the scheduler's tick) that raised",
    ["client", "task"],
)
CONNECTED = Gauge("hpcrl_broker_connected", "1 while connected to the broker", ["client"])
HANDLER_SECONDS = Histogram(
    "hpcrl_broker_handler_seconds",
    "Time a handler took per message",
    ["queue"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
)
