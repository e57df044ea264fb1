"""What every service's `serve` does around its own logic: config, logs, metrics, signals."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import structlog
from pydantic import Field

from hpcrl_common.broker import Consumer
from hpcrl_common.config import ConfigError, Section, ServiceConfig, load_config
from hpcrl_common.metrics import MetricsServer

CONFIG_ENV = "HPCRL_CONFIG"
C = TypeVar("C", bound=ServiceConfig)
log = structlog.get_logger()


class ServiceSection(Section):
    """Fields every service section has; each service sets its own default port."""

    metrics_host: str = Field(
        "127.0.0.1",
        description="address of /metrics and /healthz: 127.0.0.1 keeps them on "
        "this host; 0.0.0.0 (or the node's address) lets a Prometheus elsewhere scrape them",
    )
    metrics_port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    stop_grace_s: float = Field(
        30.0,
        ge=0,
        description="on SIGTERM/SIGINT, how long work already running may take "
        "to finish and send its results; then the service exits and the broker hands what "
        "is left to another replica (keep it below the kill wait of what stops it: systemd's "
        "TimeoutStopSec, the lead of Slurm's --signal)",
    )
    cpu_priority: Literal["normal", "idle"] = Field(
        "normal",
        description="idle: the service's threads and the processes it starts run under "
        "Linux's SCHED_IDLE, taking only CPU time nothing else asks for (a generator or learner "
        "on a benchmarker's node yields the cores to kernels being timed; "
        "bench/timing_priority.py measures what that buys)",
    )


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=os.environ.get(CONFIG_ENV),
        metavar="TOML",
        help=f"experiment config file (default: ${CONFIG_ENV}, else built-in defaults; "
        "HPCRL__SECTION__KEY environment variables override it)",
    )


def apply_cpu_priority(priority: str) -> None:
    """Put every thread of this process under ``priority`` (``ServiceSection.cpu_priority``);
    threads and processes started afterwards inherit it. Called first thing in `serve`, so
    the backends' thread pools and engine processes are born with it."""
    if priority == "normal":
        return
    try:
        for tid in os.listdir("/proc/self/task"):
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError) as exc:  # AttributeError: no SCHED_IDLE off Linux
        raise SystemExit(f"error: cannot set cpu_priority = {priority!r}: {exc}") from None


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
    """Serve metrics and health, stop cleanly on SIGINT/SIGTERM, run the consumer loop.

    A stop is bounded: work still running after ``stop_grace_s`` is left behind (its
    messages are back in the queue) and the process exits without waiting for it. SIGUSR1
    writes every thread's stack to stderr, for a service that seems stuck.
    """

    def health() -> tuple[bool, dict[str, Any]]:
        ok, detail = consumer.healthy()
        if extra_health is not None:
            extra_ok, extra = extra_health()
            ok, detail = ok and extra_ok, {**detail, **extra}
        return ok, detail

    server = MetricsServer(service, health, section.metrics_host, section.metrics_port).start()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: consumer.stop())
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    consumer.stop_grace_s = section.stop_grace_s
    try:
        consumer.run()
    finally:
        server.stop()
    if consumer.running:
        leave_running_work(consumer.running)


def leave_running_work(running: int) -> None:
    """Exit now, without joining the worker threads (the interpreter would wait for them):
    their results can no longer be sent, and the broker has requeued their messages. The
    children get SIGTERM first: nothing else would stop them (vLLM's engine process would
    stay, holding its memory)."""
    children = end_children()
    log.warning(
        "exiting with work still running; where each thread was follows",
        running=running,
        children_terminated=children,
    )
    sys.stdout.flush()
    faulthandler.dump_traceback(all_threads=True)
    sys.stderr.flush()
    os._exit(0)


def end_children() -> list[int]:
    """SIGTERM to every child of this process (of any of its threads); their pids."""
    children: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            children.update(int(pid) for pid in (task / "children").read_text().split())
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    return sorted(children)
