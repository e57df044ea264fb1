"""The demo's report of an experiment of several tasks (deploy/local/demo_tasks.py) and how
the demo asks the bootstrap and the evaluation for them; `make demo` (one task) unchanged."""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpcrl_common.config import load_config
from hpcrl_common.task import load_task
from hpcrl_learner.config import LearnerConfig
from hpcrl_scheduler.config import SchedulerConfig
from tests.support.scripts import ROOT, load_script

sys.path.insert(0, str(ROOT / "deploy" / "local"))  # demo.py imports its neighbours
demo = load_script("deploy/local/demo.py", "demo_script_tasks")
import demo_tasks  # noqa: E402  (beside demo.py, on the path just set)

MULTITASK = ROOT / "deploy" / "local" / "multitask.toml"


def gain(before: float, after: float) -> dict[str, float]:
    return {"before": before, "after": after, "gain": after - before, "low": -0.1, "high": 0.3}


EVALUATION = {
    "comparison": {
        "before": 0,
        "after": 9,
        "metrics": {"share_correct": gain(0.5, 0.75), "mean_gflops": gain(1.0, 2.0)},
    }
}


def test_the_multitask_experiment_names_the_four_tasks_apart_from_the_gemm_demo():
    multi = load_config(SchedulerConfig, MULTITASK)
    gemm = load_config(SchedulerConfig, ROOT / "deploy" / "local" / "demo.toml")
    assert demo_tasks.task_keys(multi.experiment) == ["gemv", "matmul", "spmv", "stencil"]
    assert set(multi.experiment.task_weights().values()) == {1.0}
    assert demo_tasks.task_keys(gemm.experiment) == ["matmul"]
    for key in ("name", "data_dir"):
        assert getattr(multi.experiment, key) != getattr(gemm.experiment, key)
    assert multi.broker.namespace != gemm.broker.namespace
    assert multi.db_path != gemm.db_path


def test_the_multitask_experiment_decays_the_learning_rate_over_its_own_longer_run():
    multi = load_config(LearnerConfig, MULTITASK, env={}).learner
    gemm = load_config(LearnerConfig, ROOT / "deploy" / "local" / "demo.toml", env={}).learner
    assert multi.learning_rate == gemm.learning_rate
    assert multi.min_lr_ratio == gemm.min_lr_ratio
    # 12 groups an iteration against the GEMM demo's 9, 4 a step: more steps to decay over.
    assert gemm.decay_steps > 0
    assert multi.decay_steps > gemm.decay_steps


def test_the_bootstrap_is_asked_for_every_task_only_in_a_run_of_several():
    assert demo_tasks.bootstrap_args(["matmul"]) == []
    assert demo_tasks.bootstrap_args(["gemv", "matmul", "spmv", "stencil"]) == [
        "--tasks",
        "gemv,matmul,spmv,stencil",
    ]


def test_each_task_is_evaluated_on_its_own_fixed_set(tmp_path, monkeypatch):
    calls: list[tuple[list[str], str, str]] = []

    def evaluate(argv: list[str], log: Path, samples: int, task: str) -> bool:
        calls.append((argv, log.name, task))  # instead of running hpcrl-evaluate
        return True

    monkeypatch.setattr(demo, "evaluate", evaluate)
    args = argparse.Namespace(config=MULTITASK, eval_samples=4, no_eval=False)
    stale = tmp_path / "evaluation-spmv.json"
    stale.write_text("{}")  # another run's figures
    config = load_config(SchedulerConfig, MULTITASK)
    assert demo.run_evaluation(args, config, tmp_path / "m", "transformers", tmp_path, tmp_path)
    assert not stale.exists()
    by_task = {argv[argv.index("--task") + 1]: (argv, log, name) for argv, log, name in calls}
    assert sorted(by_task) == ["gemv", "matmul", "spmv", "stencil"]
    argv, log, name = by_task["spmv"]
    assert (log, name) == ("evaluate-spmv.log", "spmv")
    assert argv[argv.index("--json") + 1] == str(tmp_path / "evaluation-spmv.json")
    assert argv[argv.index("--plot") + 1] == str(tmp_path / "evaluation-spmv.png")
    calls.clear()
    gemm = load_config(SchedulerConfig, ROOT / "deploy" / "local" / "demo.toml")
    assert demo.run_evaluation(args, gemm, tmp_path / "m", "transformers", tmp_path, tmp_path)
    [(plain, log, name)] = calls
    assert (log, name) == ("evaluate.log", "")
    assert plain[plain.index("--task") + 1] == "matmul"
    assert plain[plain.index("--json") + 1] == str(tmp_path / "evaluation.json")
    assert demo.task_references(gemm, tmp_path, ["matmul"]) is None  # nothing timed twice


@dataclass
class FakeReference:
    routine: str = "cblas_dgemv"
    gflops: float = 8.0
    core: str = "SkylakeX"
    threads: int = 1


@dataclass
class FakeTriad:
    gbytes_per_s: float = 20.0


@dataclass
class FakeReferences:
    openblas: FakeReference | None
    triad: FakeTriad | None


class FakeBenchmarker:
    """Stands in for Benchmarker.reference: what the real one returns per kind of task."""

    def reference(self, task):
        if task.name == "matmul":  # OpenBLAS dgemm; GEMM counts no bytes, so no triad
            return FakeReferences(FakeReference("cblas_dgemm", 40.0), None)
        if task.name == "gemv":  # OpenBLAS dgemv and, memory-bound, the triad too
            return FakeReferences(FakeReference(), FakeTriad())
        return FakeReferences(None, FakeTriad())


@pytest.mark.parametrize(
    ("key", "kind", "label"),
    [
        ("matmul", "openblas", "OpenBLAS dgemm"),
        ("gemv", "openblas", "OpenBLAS dgemv"),
        ("stencil", "triad", "STREAM-triad roof"),
        ("spmv", "triad", "STREAM-triad roof"),
    ],
)
def test_each_task_is_measured_against_its_own_reference(key, kind, label):
    reference = demo_tasks.time_reference(key, FakeBenchmarker())
    assert reference["kind"] == kind
    best = {"id": f"{key}/0", "stage": 2, "gflops": 4.0, "iteration": 3}
    task = load_task(key)
    moved = 8.0 * task.flop_count(task.sizes.reward)  # 8 bytes per FLOP: 32 GB/s at 4 GFLOPS
    row = demo_tasks.task_row(key, best, EVALUATION, reference, moved)
    if kind == "openblas":
        assert row["share_of_reference"] == pytest.approx(4.0 / reference["gflops"])
    else:
        assert row["gbytes_per_s"] == pytest.approx(32.0)
        assert row["share_of_reference"] == pytest.approx(32.0 / 20.0)
        assert row["roof_gflops"] == pytest.approx(2.5)  # 20 GB/s at 8 bytes per FLOP
    line = demo_tasks.reference_line(row)
    assert line is not None and line[1] == label
    cells = demo_tasks.row_cells(row)
    assert cells[0] == key and "0.5 -> 0.75" in cells[1] and "[-0.1, +0.3]" in cells[1]
    assert "4.00 GFLOPS (stage 2)" in cells[3]
    assert f"{row['share_of_reference']:.0%} of it" in cells[4]


def test_a_task_without_evaluation_or_best_still_has_its_row():
    row = demo_tasks.task_row("stencil", None, None, {"kind": "none", "why": "no roof"})
    cells = demo_tasks.row_cells(row)
    assert cells == ["stencil", "not evaluated", "-", "-", "none (no roof)"]
    assert demo_tasks.reference_line(row) is None


def test_each_tasks_pool_is_plotted_on_its_own():
    data = {
        "iterations": [
            {
                "iteration": 0,
                "pool": {"1": {"best_gflops": 9.0}},
                "by_task": {
                    "gemv": {"1": {"best_gflops": 1.0}},
                    "matmul": {"1": {"best_gflops": 9.0}},
                },
            }
        ]
    }
    [it] = demo_tasks.task_iterations(data, "gemv")
    assert it["pool"] == {"1": {"best_gflops": 1.0}} and it["iteration"] == 0


def test_a_run_of_several_tasks_has_iteration_rows_per_task(tmp_path):
    def pool(best: float, count: int) -> dict:
        share = {"success": 0.5, "compile_error": 0.5}
        return {
            "1": {"best_gflops": best, "median_gflops": best, "count": count, "status_share": share}
        }

    def totals(groups: int, mean: float) -> dict:
        return {"groups": groups, "reward_mean": mean, "reward_max": 2 * mean}

    data = {
        "tasks": ["gemv", "matmul"],
        "iterations": [
            {
                "iteration": 0,
                "groups": 3,
                "reward_mean": 30.0,
                "reward_max": 90.0,
                "pool": pool(9.0, 6),
                "by_task": {"gemv": pool(1.0, 2), "matmul": pool(9.0, 4)},
                "groups_by_task": {"gemv": totals(1, 10.0), "matmul": totals(2, 40.0)},
            }
        ],
    }
    [it] = demo_tasks.task_iterations(data, "matmul")
    assert (it["groups"], it["reward_mean"]) == (2, 40.0)  # the task's, not the pooled 3, 30
    demo.write_iterations_csv(tmp_path / "iterations.csv", data)
    rows = list(csv.DictReader((tmp_path / "iterations.csv").open()))
    assert [(r["task"], r["groups"], r["best_gflops"], r["n_success"]) for r in rows] == [
        ("gemv", "1", "1.0", "1"),
        ("matmul", "2", "9.0", "2"),
    ]


def test_the_report_of_a_run_of_several_tasks_has_a_row_per_task(tmp_path):
    (tmp_path / "evaluation-gemv.json").write_text(__import__("json").dumps(EVALUATION))
    data = {
        "tasks": ["gemv", "spmv"],
        "by_task": {
            "gemv": {"best": {"id": "g/0", "stage": 1, "gflops": 2.0, "iteration": 0}},
            "spmv": {"best": None},
        },
    }
    references = {
        "gemv": {"reference": {"kind": "openblas", "routine": "dgemv", "gflops": 8.0}},
        "spmv": {"reference": {"kind": "triad", "gbytes_per_s": 20.0}},
    }
    rows = demo.task_rows(Path(tmp_path), data, references)
    assert [r["task"] for r in rows] == ["gemv", "spmv"]
    assert rows[0]["share_of_reference"] == pytest.approx(0.25)
    assert rows[0]["gains"]["share_correct"]["after"] == 0.75
    assert rows[1]["gains"] is None and "share_of_reference" not in rows[1]


def test_the_single_task_demo_reports_dgemm_as_the_benchmarker_times_it():
    figure = demo.openblas_gflops(FakeBenchmarker(), load_task("matmul"))
    assert figure == {"gflops": 40.0, "threads": 1, "core": "SkylakeX"}
    # a task without an OpenBLAS routine: no figure, said, not an error
    assert demo.openblas_gflops(FakeBenchmarker(), load_task("spmv")) is None
