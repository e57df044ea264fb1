"""A real Prometheus scrapes the real scheduler and benchmarker while they run a one-iteration
SQD experiment over the real RabbitMQ; the GFLOPS and reward series are read back through
Prometheus's HTTP API and compared with the scheduler's own account of the run.

The only stand-in is the scheduler engineer's scripted generator (canned C completions, the
same one tests/scheduler uses): with G = 2 the seed group gets one correct kernel and one that
does not compile.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from hpcrl_benchmarker.host import has_avx512
from hpcrl_common.broker import Consumer
from hpcrl_common.config import BrokerSettings
from hpcrl_common.messages import GenerateRequest
from hpcrl_common.topology import GENERATE_REQUESTS, Topology

from ..conftest import RunningConsumer
from ..scheduler.test_integration import scripted_generator
from ..support.waiting import wait_for
from .catalogue import PROMETHEUS_CONFIG, as_promql, dashboard_files, queries

pytestmark = [pytest.mark.broker, pytest.mark.slow]

PROMETHEUS = Path("/usr/bin/prometheus")
BIN = Path(sys.executable).parent
HAS_AVX512 = has_avx512()
DEADLINE_S = 150
# Panels that must show data once one iteration is done (the others need the learner and
# generator services, or rates over a longer run).
PANELS_WITH_DATA = {
    "hpcrl-experiment.json": {
        "Iterations done",
        "Best GFLOPS so far",
        "Reward per iteration (mean, max)",
        "Reward per iteration (table)",
        "Best GFLOPS per stage (whole run)",
        "Best GFLOPS per iteration",
        "Median GFLOPS per stage and iteration",
        "Best and median GFLOPS per stage and iteration",
        "Outcome counts",
        "Pool size per stage",
        "Service busy fraction",
        "Wall / busiest service",
    },
    "hpcrl-benchmarkers.json": {"Replicas up", "In flight", "Hosts", "In flight per replica"},
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def experiment_toml(settings: BrokerSettings, tmp: Path) -> str:
    # The namespace comes from HPCRL__BROKER__NAMESPACE, as an operator would set it per run.
    return f"""
[broker]
url = "{settings.url}"
heartbeat_s = {settings.heartbeat_s}
delivery_limit = {settings.delivery_limit}
reconnect_initial_s = {settings.reconnect_initial_s}
reconnect_max_s = {settings.reconnect_max_s}
[experiment]
name = "observability"
seed = 3
opt_level = "O3"
[scheduler]
iterations = 1
group_size = 2
node_budget = 1
max_staleness = 0
isa = "{"avx512" if HAS_AVX512 else "avx2"}"
tick_s = 0.2
exit_when_done = false
db_path = "{tmp / "scheduler.sqlite"}"
[benchmarker]
concurrency = 1
work_dir = "{tmp / "bench"}"
lock_path = "{tmp / "bench" / "timing.lock"}"
"""


def scrape_config(targets: dict[str, str]) -> dict:
    """The shipped deploy/prometheus/prometheus.yml with its targets pointed at the running
    services (same job names, so the dashboards' job selectors are exercised too)."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    jobs = []
    for job in config["scrape_configs"]:
        if job["job_name"] in targets:
            job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
            jobs.append(job)
    assert {job["job_name"] for job in jobs} == set(targets), "a job name changed"
    config["scrape_configs"] = jobs
    return config


class PrometheusApi:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: str) -> dict:
        url = f"{self.base}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:  # a bad query answers 400 with the reason
            raise AssertionError(f"{path} {params}: {exc.code} {exc.read().decode()}") from None

    def query(self, expr: str) -> list[dict]:
        body = self.get("/api/v1/query", query=expr)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False


@dataclass
class Run:
    api: PrometheusApi
    config: Path
    logs: Path
    ports: dict[str, int]


def last_logs(logs: Path) -> Callable[[], str]:
    return lambda: "last logs:\n" + logs.read_text()[-6000:]


@contextmanager
def process(cmd: list[str], log, env: dict[str, str]) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def run(broker_settings: BrokerSettings, tmp_path: Path) -> Iterator[Run]:
    if not PROMETHEUS.exists():
        pytest.fail(
            f"{PROMETHEUS} is missing: install Debian's `prometheus` package (`make install` does)"
        )
    ports = {
        "hpcrl-benchmarker": free_port(),
        "hpcrl-scheduler": free_port(),
        "prometheus": free_port(),
    }
    config = tmp_path / "experiment.toml"
    config.write_text(experiment_toml(broker_settings, tmp_path))
    prometheus_yml = tmp_path / "prometheus.yml"
    prometheus_yml.write_text(
        yaml.safe_dump(
            scrape_config(
                {job: f"127.0.0.1:{ports[job]}" for job in ("hpcrl-benchmarker", "hpcrl-scheduler")}
            )
        )
    )
    env = {
        **os.environ,
        "HPCRL__LOGGING__FORMAT": "json",
        "HPCRL__BROKER__NAMESPACE": broker_settings.namespace,
        "HPCRL__BENCHMARKER__METRICS_PORT": str(ports["hpcrl-benchmarker"]),
        "HPCRL__SCHEDULER__METRICS_PORT": str(ports["hpcrl-scheduler"]),
    }
    bench_cmd = [str(BIN / "hpcrl-benchmarker"), "serve", "--config", str(config)]
    if not HAS_AVX512:
        bench_cmd += ["--allow-isa", "avx2"]
    logs = tmp_path / "logs.txt"
    seen: list[GenerateRequest] = []
    generator = Consumer(broker_settings, "scripted-generator")
    generator.subscribe(
        GENERATE_REQUESTS,
        scripted_generator(
            Topology(broker_settings.namespace, broker_settings.delivery_limit), seen
        ),
    )
    api = PrometheusApi(ports["prometheus"])
    with logs.open("w") as log, ExitStack() as stack:
        stack.enter_context(
            process(
                [
                    str(PROMETHEUS),
                    f"--config.file={prometheus_yml}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{ports['prometheus']}",
                ],
                log,
                env,
            )
        )
        stack.enter_context(process(bench_cmd, log, env))
        stack.enter_context(RunningConsumer(generator))
        stack.enter_context(
            process([str(BIN / "hpcrl-scheduler"), "serve", "--config", str(config)], log, env)
        )
        wait_for(api.ready, 30, "Prometheus to be ready", last_logs(logs), every=0.5)
        yield Run(api, config, logs, ports)


def scheduler_status(config: Path) -> dict:
    out = subprocess.run(
        [str(BIN / "hpcrl-scheduler"), "status", "--json", "--config", str(config)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def values(result: list[dict], label: str) -> dict[str, float]:
    return {series["metric"][label]: float(series["value"][1]) for series in result}


def test_prometheus_serves_the_gflops_and_reward_series_of_a_real_run(run: Run):
    done = 'hpcrl_scheduler_iterations_done{job="hpcrl-scheduler"} == 1'
    wait_for(
        lambda: run.api.query(done),
        DEADLINE_S,
        "the iteration to be done and scraped",
        last_logs(run.logs),
        every=0.5,
    )
    # a few scrapes more, so that every gauge set when the iteration closed is in the TSDB
    time.sleep(2.5)
    check_series(run)
    check_dashboards(run)


def check_series(run: Run) -> None:
    api = run.api

    targets = api.get("/api/v1/targets")["data"]["activeTargets"]
    assert {t["labels"]["job"]: t["health"] for t in targets} == {
        "hpcrl-benchmarker": "up",
        "hpcrl-scheduler": "up",
    }

    status = scheduler_status(run.config)
    assert status["iterations_done"] == 1
    truth = status["pool"]["1"]["best_gflops"]
    assert truth > 0

    best = values(api.query('hpcrl_scheduler_best_gflops_overall{job="hpcrl-scheduler"}'), "stage")
    assert best == {"1": pytest.approx(truth, rel=1e-9)}
    per_iteration = api.query("hpcrl_scheduler_best_gflops")
    assert [(s["metric"]["stage"], s["metric"]["iteration"]) for s in per_iteration] == [("1", "0")]
    assert float(per_iteration[0]["value"][1]) == pytest.approx(truth, rel=1e-9)
    # one success among the two: the median of the successes is the best
    median = api.query("hpcrl_scheduler_median_gflops")
    assert float(median[0]["value"][1]) == pytest.approx(truth, rel=1e-9)

    # group-normalised: the only success scores 100, the compile error -40
    reward_max = values(api.query("hpcrl_scheduler_iteration_reward_max"), "iteration")
    reward_mean = values(api.query("hpcrl_scheduler_iteration_reward_mean"), "iteration")
    assert reward_max == {"0": pytest.approx(100.0)}
    assert reward_mean == {"0": pytest.approx((100.0 - 40.0) / 2)}
    groups = api.query("hpcrl_scheduler_group_reward_max_count")
    assert float(groups[0]["value"][1]) == 1.0

    outcomes = values(api.query("hpcrl_scheduler_results_total"), "status")
    assert outcomes == {"success": 1.0, "compile_error": 1.0}
    bench_outcomes = values(
        api.query('hpcrl_benchmarker_results_total{job="hpcrl-benchmarker"}'), "status"
    )
    assert bench_outcomes == {"success": 1.0, "compile_error": 1.0}
    # the benchmarker measured the same kernel the scheduler filed; the scheduler files a
    # confirmed winner at the lower of its two measurements (scheduler.confirm_winners), the
    # benchmarker counts the first one only, and the two agree within confirm_tolerance
    measured = api.query('hpcrl_benchmarker_gflops_sum{job="hpcrl-benchmarker"}')
    assert [s["metric"]["stage"] for s in measured] == ["1"]
    first = float(measured[0]["value"][1])
    assert truth * (1 - 1e-6) <= first <= truth * 3.0
    host = api.query("hpcrl_benchmarker_host_info")
    assert host and host[0]["metric"]["isa"]


def check_dashboards(run: Run) -> None:
    """Every dashboard query evaluates on the real Prometheus, and the panels that one
    iteration should fill have data."""
    api = run.api
    empty: list[str] = []
    for path in dashboard_files():
        wanted = PANELS_WITH_DATA.get(path.name, set())
        for query in queries(path):
            # a query Prometheus cannot evaluate answers 400 and fails here
            result = api.query(as_promql(query.expr))
            if query.panel in wanted and not result:
                empty.append(f"{path.name} / {query.panel}: {query.expr}")
    assert not empty, "panels without data after a real run:\n" + "\n".join(empty)
