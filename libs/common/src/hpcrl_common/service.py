"""What every service's `serve` does around its own logic: config, logs, metrics, signals."""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import Field

from hpcrl_common.broker import Consumer
from hpcrl_common.config import ConfigError, Section, ServiceConfig, load_config
from hpcrl_common.metrics import MetricsServer

CONFIG_ENV = "HPCRL_CONFIG"
C = TypeVar("C", bound=ServiceConfig)


class ServiceSection(Section):
    """Fields every service section has; each service sets its own default port."""

    metrics_host: str = Field(
        "127.0.0.1", description="address of /metrics and /healthz: 127.0.0.1 keeps them on "
        "this host; 0.0.0.0 (or the node's address) lets a Prometheus elsewhere scrape them")
    metrics_port: int = Field(0, ge=0, le=65535, description="0 picks a free port")


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=os.environ.get(CONFIG_ENV),
        metavar="TOML",
        help=f"experiment config file (default: ${CONFIG_ENV}, else built-in defaults; "
        "HPCRL__SECTION__KEY environment variables override it)",
    )


def load_or_exit(model: type[C], path: Path | None) -> C:
    try:
        return load_config(model, path)
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None


def run_consumer(
    consumer: Consumer,
    service: str,
    section: ServiceSection,
    extra_health: Callable[[], tuple[bool, dict[str, Any]]] | None = None,
) -> None:
    """Serve metrics and health, stop cleanly on SIGINT/SIGTERM, run the consumer loop."""

    def health() -> tuple[bool, dict[str, Any]]:
        ok, detail = consumer.healthy()
        if extra_health is not None:
            extra_ok, extra = extra_health()
            ok, detail = ok and extra_ok, {**detail, **extra}
        return ok, detail

    server = MetricsServer(service, health, section.metrics_host, section.metrics_port).start()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: consumer.stop())
    try:
        consumer.run()
    finally:
        server.stop()
