"""A reduced `make demo` end to end: four real services over the real broker, one iteration,
then the fixed-set evaluation of version 0 and the final version (one sample per prompt).

The policy is a quickly bootstrapped (weak) one; this checks the whole system runs and
reports, not that it learns (bench/learning.py measures that).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_reduced_demo_runs_end_to_end(broker_settings, tmp_path):
    """The shipped demo config, shrunk by environment overrides (as an operator would)."""
    overrides = {
        "HPCRL__BROKER__NAMESPACE": broker_settings.namespace,
        "HPCRL__EXPERIMENT__DATA_DIR": str(tmp_path / "data" / "demo"),
        "HPCRL__SCHEDULER__ITERATIONS": "1",
        "HPCRL__SCHEDULER__GROUP_SIZE": "2",
        "HPCRL__SCHEDULER__NODE_BUDGET": "1",
        # One node is all SQD gets here, so none is an anchor (tests/scheduler/test_anchors.py).
        "HPCRL__SCHEDULER__ANCHOR_NODES": "0",
        "HPCRL__SCHEDULER__MAX_TOKENS": "256",
        "HPCRL__SCHEDULER__INITIAL_GROUPS_PER_STEP": "1",
        "HPCRL__LEARNER__GROUPS_PER_STEP": "1",
        **{
            f"HPCRL__{svc}__METRICS_PORT": "0"
            for svc in ("GENERATOR", "BENCHMARKER", "LEARNER", "SCHEDULER")
        },
    }
    runs = tmp_path / "runs"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "deploy/local/demo.py"),
            "--runs",
            str(runs),
            "--policy-data-dir",
            str(tmp_path / "data"),
            "--bootstrap-arg=--steps=4",
            "--bootstrap-arg=--examples=64",
            "--bootstrap-arg=--kernels-per-stage=2,2,1,1,1,1",
            "--eval-samples",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env={**os.environ, **overrides},
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    run_dir = runs / "demo"
    assert str(run_dir) in result.stdout
    metrics = json.loads((run_dir / "metrics.json").read_text())
    scheduler = metrics["scheduler"]
    assert scheduler["done"] and scheduler["iterations_done"] == 1
    iteration = scheduler["iterations"][0]
    assert iteration["groups"] == 1 and iteration["closed"] == 1
    assert metrics["learner"]["policy_version"] == 1  # one group, one step, one version
    for name in (
        "iterations.csv",
        "reward_curve.png",
        "best_gflops.png",
        "learner.png",
        "kernels/index.json",
    ):
        assert (run_dir / name).stat().st_size > 0, name
    for service in ("benchmarker", "learner", "generator", "scheduler"):
        assert (run_dir / "logs" / f"{service}.log").exists()
    assert "SQD iterations" in result.stdout
    evaluation = json.loads((run_dir / "evaluation.json").read_text())
    assert [v["version"] for v in evaluation["versions"]] == [0, 1]
    assert evaluation["sampling"]["samples"] == 1
    for version in evaluation["versions"]:  # every prompt of the set, one judged sample each
        assert len(version["samples"]) == len(evaluation["prompts"])
        assert all(sample["status"] for sample in version["samples"])
    assert set(evaluation["comparison"]["metrics"]) >= {
        "share_correct",
        "mean_reward",
        "mean_gflops",
    }
    assert (run_dir / "evaluation.png").stat().st_size > 0
    assert (
        metrics["evaluation"]["gains"]["mean_reward"]
        == evaluation["comparison"]["metrics"]["mean_reward"]
    )
    assert "Fixed evaluation set" in result.stdout and "sampler KL" in result.stdout
    # The summary leads with v0 -> final and the best kernel against OpenBLAS.
    headline = result.stdout.index("v0 -> v1:")
    assert headline < result.stdout.index("SQD iterations")
    assert "learner, last step: entropy" in result.stdout
    corpus = metrics["corpus_best"]
    assert corpus is None or set(corpus["per_stage"]) <= {str(s) for s in range(1, 7)}
