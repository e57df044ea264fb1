"""The demo's overlap figure: the run's wall time against the busiest service's busy time.

A service's busy time is ``hpcrl_service_busy_seconds_total`` from its own ``/metrics``: the
wall-clock time during which it worked on at least one item (a handler, a periodic task),
overlapping items counted once (the generator's requests, the benchmarker's concurrent
candidates), a request's wait for the engine or for a policy version left out. A process
with several consumers (clients) counts as busy as its busiest one; a service with several
replicas as busy as their mean, since work spread over replicas shares one queue: a replica
busy all the time beside an idle one means the queue ran dry, not that the service is slow.

The run's wall time goes from the generator's first request (its
``hpcrl_service_first_busy_timestamp_seconds``: past model loading, and past start-up of
the other services, which load in parallel) to the last version committed, or to the last
group closed if that came later. wall / max(busy) is 1.0 when the slowest service never
waited for another; the target is ≤ 1.1. Per iteration, both divide by the iterations run.

Every service is scraped every few seconds while the run goes on and once more before the
services are stopped: the scheduler exits by itself when the run is done, so its figure is
its last scrape. A service that could not be scraped is reported with the reason; the demo
never fails because of this figure.
"""

from __future__ import annotations

import json
import math
import socket
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_common.metrics import BUSY_SECONDS_NAME, FIRST_BUSY_NAME

TARGET = 1.1
SERVICES = ("generator", "benchmarker", "learner", "scheduler")
# Where the loop starts: the head of the pipeline taking its first request.
START_SERVICE = "generator"
DEFINITION = (
    "busy: wall time with at least one item in progress "
    "(hpcrl_service_busy_seconds_total, overlapping items once); "
    "wall: the generator's first request to the last version committed (or the last "
    "group closed); ratio: wall / the busiest service's busy time"
)


class ScrapeError(RuntimeError):
    """A /metrics endpoint that did not answer, or answered without the busy counter."""


@dataclass(frozen=True)
class Reading:
    """One scrape of one process."""

    busy_s: float  # its busiest client's
    first_busy: float | None  # Unix time of its first item, None if it never worked
    clients: dict[str, float]
    at: float  # Unix time of the scrape


def parse(text: str, at: float) -> Reading:
    """The busy figures of one /metrics exposition."""
    clients: dict[str, float] = {}
    firsts: list[float] = []
    for family in text_string_to_metric_families(text):
        if family.name == BUSY_SECONDS_NAME:
            for sample in family.samples:
                if sample.name == f"{BUSY_SECONDS_NAME}_total":
                    clients[sample.labels.get("client", "")] = sample.value
        elif family.name == FIRST_BUSY_NAME:
            firsts += [s.value for s in family.samples if s.value > 0]
    if not clients:
        raise ScrapeError(f"no {BUSY_SECONDS_NAME}_total in its metrics (an older build?)")
    return Reading(
        busy_s=max(clients.values()),
        first_busy=min(firsts) if firsts else None,
        clients=clients,
        at=at,
    )


def scrape(url: str, timeout_s: float = 3.0) -> Reading:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ScrapeError(f"{url}: {reason}") from None
    try:
        return parse(text, time.time())
    except ScrapeError as exc:
        raise ScrapeError(f"{url}: {exc}") from None
    except ValueError as exc:  # not the exposition format
        raise ScrapeError(f"{url}: unreadable metrics ({exc})") from None


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def scrape_host(host: str) -> str:
    """The address to scrape a server bound to ``host`` at."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def metrics_endpoints(
    config_path: Path,
    env: Mapping[str, str],
) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """Each service's /metrics URL as it will run with ``config_path`` and ``env``.

    Returns (urls, env overrides, errors). A ``metrics_port`` of 0 (pick a free port, as the
    reduced demo test sets to run beside another demo) is replaced by a free port chosen here
    and passed as an override, since the service would not tell which one it took.
    """
    from hpcrl_benchmarker.config import BenchmarkerConfig
    from hpcrl_common.config import load_config
    from hpcrl_generator.config import GeneratorConfig
    from hpcrl_learner.config import LearnerConfig
    from hpcrl_scheduler.config import SchedulerConfig

    models: dict[str, type[Any]] = {
        "generator": GeneratorConfig,
        "benchmarker": BenchmarkerConfig,
        "learner": LearnerConfig,
        "scheduler": SchedulerConfig,
    }
    urls: dict[str, str] = {}
    overrides: dict[str, str] = {}
    errors: dict[str, str] = {}
    for service, model in models.items():
        try:
            section = getattr(load_config(model, config_path, env), service)
            host, port = section.metrics_host, section.metrics_port
            if port == 0:
                port = free_port(host)
                overrides[f"HPCRL__{service.upper()}__METRICS_PORT"] = str(port)
        except Exception as exc:  # the service itself will say what is wrong with its config
            errors[service] = f"metrics address unknown: {exc}"
            continue
        urls[service] = f"http://{scrape_host(host)}:{port}/metrics"
    return urls, overrides, errors


@dataclass
class OverlapProbe:
    """Scrapes every service's busy time while the demo runs; keeps the latest of each."""

    urls: dict[str, str]
    errors: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # for the services: chosen ports
    every_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    readings: dict[str, Reading] = field(default_factory=dict)
    _due: float = 0.0

    @classmethod
    def for_services(cls, config_path: Path, env: Mapping[str, str]) -> OverlapProbe:
        urls, overrides, errors = metrics_endpoints(config_path, env)
        return cls(urls, errors, overrides)

    def poll(self, *, force: bool = False, timeout_s: float = 3.0) -> None:
        """Scrape every service if due (or ``force``); a failure keeps the earlier reading."""
        if not force and self.clock() < self._due:
            return
        self._due = self.clock() + self.every_s
        for service, url in self.urls.items():
            try:
                self.readings[service] = scrape(url, timeout_s)
                self.errors.pop(service, None)
            except ScrapeError as exc:
                self.errors[service] = str(exc)

    def finish(self) -> None:
        """The last scrape, after the run and the learner's last steps, before the stop."""
        self.poll(force=True, timeout_s=10.0)

    def summary(
        self, data: dict[str, Any], db: Path, checkpoints: Path, resumed: bool
    ) -> dict[str, Any]:
        """metrics.json's "overlap"; never raises (the figure must not break the report)."""
        try:
            end, end_is = loop_end(data, db, checkpoints)
            iterations = None if resumed else int(data["iterations_done"]) or None
            out = overlap_summary(
                {s: [r] for s, r in self.readings.items()}, self.errors, end, end_is, iterations
            )
        except Exception as exc:
            return not_measured(f"could not be computed: {exc!r}")
        if resumed:
            out["note"] = (
                "resumed run: figures of this session only (the services' counters "
                "start with their processes); no per-iteration figures"
            )
        return out


def loop_end(data: dict[str, Any], db: Path, checkpoints: Path) -> tuple[float | None, str]:
    """Unix time at which the loop's last work ended: the last version committed, or the
    last group closed if later (a remainder too small for a step is not trained)."""
    from hpcrl_scheduler.store import Store

    committed = None
    latest = CheckpointStore(checkpoints).latest()
    if latest is not None and latest.created_at > 0:
        committed = latest.created_at
    closed = None
    if db.exists():
        store = Store(db, read_only=True)
        try:
            times = [
                g.closed_at
                for it in data["iterations"]
                for g in store.groups_of_iteration(int(it["iteration"]))
                if g.closed_at is not None
            ]
        finally:
            store.close()
        closed = max(times) if times else None
    if committed is not None and (closed is None or committed >= closed):
        return committed, "the last version committed"
    if closed is not None:
        return closed, "the last group closed"
    return None, "no version committed and no group closed"


def not_measured(reason: str) -> dict[str, Any]:
    return {"measured": False, "reason": reason, "target": TARGET}


def service_busy(replicas: list[Reading]) -> float:
    """A service's busy time: the mean over its replicas (see the module's docstring)."""
    return statistics.fmean(r.busy_s for r in replicas)


def overlap_summary(
    readings: Mapping[str, list[Reading]],
    errors: Mapping[str, str],
    end: float | None,
    end_is: str,
    iterations: int | None,
) -> dict[str, Any]:
    """The overlap figures from each service's readings (one per replica)."""
    heads = readings.get(START_SERVICE) or []
    firsts = [r.first_busy for r in heads if r.first_busy is not None]
    if not heads:
        return not_measured(
            f"{START_SERVICE} not scraped: {errors.get(START_SERVICE, 'no address')}"
        )
    if not firsts:
        return not_measured(f"the {START_SERVICE} never took a request")
    start = min(firsts)
    if end is None or not math.isfinite(end) or end <= start:
        return not_measured(f"no end of the loop after its start ({end_is})")
    wall = end - start
    services: dict[str, dict[str, Any]] = {}
    for service in SERVICES:
        replicas = readings.get(service) or []
        if not replicas:
            services[service] = {"measured": False, "reason": errors.get(service, "not scraped")}
            continue
        busy = service_busy(replicas)
        entry: dict[str, Any] = {
            "measured": True,
            "busy_s": busy,
            "busy_share": busy / wall,
            "busy_per_iteration_s": busy / iterations if iterations else None,
            "replicas": len(replicas),
            "scraped_at": max(r.at for r in replicas),
        }
        if service in errors:  # e.g. the scheduler, which exits when the run is done
            entry["note"] = f"figure from the last scrape that answered; then {errors[service]}"
        services[service] = entry
    busy_of = {s: e["busy_s"] for s, e in services.items() if e["measured"]}
    busiest = max(busy_of, key=lambda s: busy_of[s])
    ratio = wall / busy_of[busiest] if busy_of[busiest] > 0 else None
    # A short run is mostly filling and draining the pipeline: the same figure from the
    # busiest service's first item says how well it was fed once the loop was running.
    fed = [r.first_busy for r in readings[busiest] if r.first_busy is not None]
    filled = min(fed) if fed else None
    steady = (
        None
        if filled is None or end <= filled or busy_of[busiest] <= 0
        else (end - filled) / busy_of[busiest]
    )
    missing = sorted(s for s, e in services.items() if not e["measured"])
    return {
        "measured": True,
        "ratio": ratio,
        "target": TARGET,
        "met": ratio is not None and ratio <= TARGET,
        "busiest": busiest,
        "wall_s": wall,
        "ratio_after_fill": steady,
        "filled": filled,
        "start": start,
        "end": end,
        "start_is": f"the {START_SERVICE}'s first request",
        "end_is": end_is,
        "iterations": iterations,
        "wall_per_iteration_s": wall / iterations if iterations else None,
        "services": services,
        "complete": not missing,
        "definition": DEFINITION,
    }


def print_overlap(console: Console, overlap: dict[str, Any] | None) -> None:
    if overlap is None or not overlap.get("measured"):
        reason = "no figure" if overlap is None else overlap.get("reason", "?")
        console.print(f"overlap (wall / busiest service): not measured ({reason})")
        return
    iterations = overlap["iterations"]
    table = Table(
        title="Overlap: busy time per service (wall-clock time working on at least one item)"
    )
    for column in ("service", "busy s", "busy s / iteration", "share of wall"):
        table.add_column(column)
    for service, entry in overlap["services"].items():
        if not entry["measured"]:
            table.add_row(service, "-", "-", f"not measured: {entry['reason']}")
            continue
        per = entry["busy_per_iteration_s"]
        table.add_row(
            service + (" *" if "note" in entry else ""),
            f"{entry['busy_s']:.1f}",
            "-" if per is None else f"{per:.1f}",
            f"{entry['busy_share']:.0%}",
        )
    console.print(table)
    if any("note" in e for e in overlap["services"].values()):
        console.print(
            "  * last scrape before it stopped answering (the scheduler exits when the run is done)"
        )
    each = (
        ""
        if not iterations
        else f" ({iterations} iterations, {overlap['wall_per_iteration_s']:.1f} s each)"
    )
    console.print(
        f"wall: {overlap['wall_s']:.1f} s from {overlap['start_is']} to {overlap['end_is']}{each}"
    )
    busiest = overlap["busiest"]
    if overlap["ratio"] is None:
        console.print("wall / busiest service: no service was busy")
        return
    target = f"target ≤ {overlap['target']:g}"
    verdict = f"[green]{target} met[/]" if overlap["met"] else f"[yellow]{target} not met[/]"
    partial = "" if overlap["complete"] else " (not every service was measured)"
    console.print(
        f"wall / busiest service ({busiest}, "
        f"{overlap['services'][busiest]['busy_s']:.1f} s) = "
        f"[bold]{overlap['ratio']:.2f}[/]: {verdict}{partial}"
    )
    if overlap.get("ratio_after_fill") is not None:
        console.print(
            f"  after the pipeline filled (from the {busiest}'s first item): "
            f"{overlap['ratio_after_fill']:.2f}"
        )
    if "note" in overlap:
        console.print(f"  {overlap['note']}")


def earlier_overlap(metrics_json: Path) -> dict[str, Any]:
    """The figure an earlier report measured (``--report-only`` starts no service)."""
    try:
        found = json.loads(metrics_json.read_text()).get("overlap")
    except (OSError, ValueError, AttributeError):
        found = None
    if isinstance(found, dict):
        return found
    return not_measured(
        "--report-only: measured only while the services run, and no "
        "earlier report of this run has it"
    )
