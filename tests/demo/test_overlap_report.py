"""The demo's overlap figure (deploy/local/overlap_report.py): real prometheus_client
registries served over HTTP by the services' own MetricsServer, scraped and parsed by the
parser Prometheus's Python client ships; the ratio and its fallbacks."""

from __future__ import annotations

import io
import socket
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge
from rich.console import Console

from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_common.metrics import BUSY_SECONDS_NAME, FIRST_BUSY_NAME, MetricsServer
from hpcrl_scheduler.store import Store
from tests.support.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


report = load_script("deploy/local/overlap_report.py", "overlap_report")


class Service:
    """One service's metrics as it exports them: its own registry on its own HTTP port."""

    def __init__(
        self, busy: dict[str, float], first_busy: float | None = None, with_busy: bool = True
    ) -> None:
        self.registry = CollectorRegistry()
        if with_busy:
            counter = Counter(BUSY_SECONDS_NAME, "busy", ["client"], registry=self.registry)
            for client, seconds in busy.items():
                counter.labels(client).inc(seconds)
        gauge = Gauge(FIRST_BUSY_NAME, "first", ["client"], registry=self.registry)
        if first_busy is not None:
            gauge.labels(next(iter(busy))).set(first_busy)
        Counter("hpcrl_other_total", "something else", registry=self.registry).inc()
        self.server = MetricsServer(
            "test", lambda: (True, {}), "127.0.0.1", 0, registry=self.registry
        ).start()
        self.url = f"http://127.0.0.1:{self.server.port}/metrics"

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def services():
    running = {
        "generator": Service({"generator": 90.0}, first_busy=1_000.0),
        # two consumers in one process: the busier one counts
        "benchmarker": Service({"benchmarker-a": 100.0, "benchmarker-b": 40.0}, 1_004.0),
        "learner": Service({"learner-demo": 50.0}, 1_030.0),
        "scheduler": Service({"scheduler": 3.0}, 990.0),
    }
    yield running
    for service in running.values():
        service.stop()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_busy_times_are_scraped_and_the_ratio_uses_the_busiest_service(services):
    probe = report.OverlapProbe({name: s.url for name, s in services.items()})
    probe.poll()
    assert set(probe.readings) == set(services) and not probe.errors
    services["scheduler"].stop()  # it exits by itself when the run is done
    probe.finish()
    assert "scheduler" in probe.errors and probe.readings["scheduler"].busy_s == 3.0
    bench = probe.readings["benchmarker"]
    assert bench.clients == {"benchmarker-a": 100.0, "benchmarker-b": 40.0}
    assert bench.busy_s == 100.0 and bench.first_busy == 1_004.0

    out = report.overlap_summary(
        {s: [r] for s, r in probe.readings.items()},
        probe.errors,
        end=1_105.0,
        end_is="the last version committed",
        iterations=4,
    )
    assert out["measured"] and out["complete"]
    assert out["start"] == 1_000.0  # the generator's first request, not the scheduler's tick
    assert out["wall_s"] == 105.0 and out["wall_per_iteration_s"] == 26.25
    assert out["busiest"] == "benchmarker"
    assert out["ratio"] == pytest.approx(1.05) and out["met"]
    assert out["services"]["generator"]["busy_per_iteration_s"] == 22.5
    assert out["services"]["learner"]["busy_share"] == pytest.approx(50 / 105)
    assert "note" in out["services"]["scheduler"] and "note" not in out["services"]["learner"]

    console = Console(file=io.StringIO(), width=120)
    report.print_overlap(console, out)
    text = console.file.getvalue()
    assert "wall / busiest service (benchmarker, 100.0 s) = 1.05" in text
    assert "target ≤ 1.1 met" in text and "26.2 s each" in text


def test_several_replicas_count_as_their_mean():
    def reading(busy: float, first: float | None = None) -> object:
        return report.Reading(busy_s=busy, first_busy=first, clients={"c": busy}, at=0.0)

    out = report.overlap_summary(
        {
            "generator": [reading(60.0, 10.0), reading(20.0, 5.0)],
            "benchmarker": [reading(90.0), reading(30.0)],
            "learner": [reading(10.0)],
        },
        {"scheduler": "no address"},
        end=105.0,
        end_is="x",
        iterations=None,
    )
    assert out["start"] == 5.0 and out["wall_s"] == 100.0
    assert out["services"]["benchmarker"]["busy_s"] == 60.0
    assert out["services"]["generator"]["busy_s"] == 40.0
    assert out["busiest"] == "benchmarker" and out["ratio"] == pytest.approx(100 / 60)
    assert not out["met"] and not out["complete"]
    assert out["services"]["scheduler"] == {"measured": False, "reason": "no address"}
    assert out["wall_per_iteration_s"] is None


def test_what_cannot_be_measured_is_said_not_raised(services):
    down = f"http://127.0.0.1:{closed_port()}/metrics"
    probe = report.OverlapProbe({"generator": down, "learner": services["learner"].url})
    probe.finish()
    out = report.overlap_summary(
        {s: [r] for s, r in probe.readings.items()},
        probe.errors,
        end=2_000.0,
        end_is="x",
        iterations=1,
    )
    assert not out["measured"] and down in out["reason"]

    idle = Service({"generator": 0.0})  # started, never took a request
    old = Service({"generator": 5.0}, with_busy=False)  # a build without the counter
    try:
        reading = report.scrape(idle.url)
        out = report.overlap_summary({"generator": [reading]}, {}, 2_000.0, "x", 1)
        assert not out["measured"] and "never took a request" in out["reason"]
        with pytest.raises(report.ScrapeError, match=f"no {BUSY_SECONDS_NAME}_total"):
            report.scrape(old.url)
    finally:
        idle.stop()
        old.stop()
    start = report.Reading(busy_s=1.0, first_busy=100.0, clients={}, at=0.0)
    out = report.overlap_summary({"generator": [start]}, {}, None, "nothing done", 1)
    assert not out["measured"] and "nothing done" in out["reason"]

    console = Console(file=io.StringIO(), width=120)
    report.print_overlap(console, out)
    assert "not measured" in console.file.getvalue()


def test_the_probe_scrapes_at_most_every_few_seconds(services):
    now = [0.0]
    probe = report.OverlapProbe(
        {"learner": services["learner"].url}, every_s=5.0, clock=lambda: now[0]
    )
    probe.poll()
    first = probe.readings["learner"].at
    time.sleep(0.01)
    now[0] = 4.0
    probe.poll()
    assert probe.readings["learner"].at == first
    now[0] = 5.0
    probe.poll()
    assert probe.readings["learner"].at > first


def test_ports_come_from_the_config_and_a_port_0_is_chosen_here(tmp_path):
    config = ROOT / "deploy" / "local" / "demo.toml"
    urls, overrides, errors = report.metrics_endpoints(config, {})
    assert not errors and not overrides
    assert urls == {
        "generator": "http://127.0.0.1:9101/metrics",
        "benchmarker": "http://127.0.0.1:9102/metrics",
        "learner": "http://127.0.0.1:9103/metrics",
        "scheduler": "http://127.0.0.1:9104/metrics",
    }
    env = {"HPCRL__LEARNER__METRICS_PORT": "0", "HPCRL__GENERATOR__METRICS_HOST": "0.0.0.0"}
    urls, overrides, errors = report.metrics_endpoints(config, env)
    port = int(overrides["HPCRL__LEARNER__METRICS_PORT"])
    assert port > 0 and list(overrides) == ["HPCRL__LEARNER__METRICS_PORT"]
    assert urls["learner"] == f"http://127.0.0.1:{port}/metrics"
    assert urls["generator"] == "http://127.0.0.1:9101/metrics"
    broken = tmp_path / "broken.toml"
    broken.write_text("[generator]\nmetrics_port = -1\n")
    urls, _, errors = report.metrics_endpoints(broken, {})
    assert "generator" in errors and "generator" not in urls


def test_the_loop_ends_with_the_last_commit_or_the_last_group_closed(tmp_path):
    db, checkpoints = tmp_path / "scheduler.db", tmp_path / "checkpoints"
    data = {"iterations": [{"iteration": 0}], "iterations_done": 1}
    assert report.loop_end(data, db, checkpoints)[0] is None
    store = Store(db)
    for ordinal, closed in enumerate((1_050.0, 1_080.0)):
        group = f"g{ordinal}"
        store.plan_group(
            group,
            iteration=0,
            ordinal=ordinal,
            parent_id="seed",
            mode="seed",
            target_stage=1,
            group_size=2,
            prompt=[],
        )
        store.mark_published(group, min_policy_version=0, at=1_000.0)
        store.mark_closed(
            group,
            at=closed,
            reason="complete",
            outcome="sent",
            host_class="h",
            excluded=0,
            reward_mean=None,
            reward_max=None,
        )
    store.close()
    assert report.loop_end(data, db, checkpoints) == (1_080.0, "the last group closed")
    checkpoints.mkdir()
    versions = CheckpointStore(checkpoints)
    staging = versions.staging_dir(1)
    (staging / "weights.bin").write_bytes(b"w")
    info = versions.commit(staging, 1, 0, "full")
    assert report.loop_end(data, db, checkpoints) == (info.created_at, "the last version committed")
    probe = report.OverlapProbe({})
    out = probe.summary(data, db, checkpoints, resumed=True)
    assert not out["measured"] and "not scraped" in out["reason"]


def test_the_ratio_after_the_pipeline_filled_starts_at_the_busiest_services_first_item():
    def reading(busy: float, first: float) -> object:
        return report.Reading(busy_s=busy, first_busy=first, clients={"c": busy}, at=0.0)

    out = report.overlap_summary(
        {"generator": [reading(50.0, 0.0)], "learner": [reading(80.0, 30.0)]},
        {},
        end=120.0,
        end_is="x",
        iterations=4,
    )
    assert out["busiest"] == "learner" and out["ratio"] == pytest.approx(120 / 80)
    assert out["filled"] == 30.0 and out["ratio_after_fill"] == pytest.approx(90 / 80)
