"""The demo's best kernel against OpenBLAS: the run's fastest children and the catalogue's
best per stage timed again after the run, side by side with OpenBLAS dgemm, by the real
benchmarker (a run's own figures are taken minutes apart on a node whose speed drifts)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hpcrl_common.task import builtin_seed
from hpcrl_scheduler.config import SchedulerConfig
from hpcrl_scheduler.report import fastest_children
from hpcrl_scheduler.selection import Program
from hpcrl_scheduler.store import Store
from tests.support.scripts import ROOT, load_script

sys.path.insert(0, str(ROOT / "deploy" / "local"))  # demo.py imports its neighbours
demo = load_script("deploy/local/demo.py", "demo_script")

SEED = builtin_seed("matmul") or ""


def child(cid: str, source: str, gflops: float, iteration: int = 1) -> Program:
    return Program(
        id=cid, stage=1, status="success", source=source, gflops=gflops, iteration=iteration
    )


def test_fastest_children_are_distinct_and_leave_out_the_seed(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    for program, group in (
        (child("seed", "seed text", 99.0, iteration=-1), None),
        (child("a", "kernel a", 40.0), "g1"),
        (child("a2", "kernel a", 42.0, iteration=4), "g4"),
        (child("b", "kernel b", 30.0), "g1"),
        (Program(id="w", stage=1, status="verification_error", source="kernel w"), "g1"),
        (child("c", "kernel c", 20.0), "g2"),
    ):
        store.add_program(program, group)
    fastest = fastest_children(store, 2)
    assert [(p.source, p.gflops) for p in fastest] == [("kernel a", 42.0), ("kernel b", 30.0)]
    assert len(fastest_children(store, 10)) == 3


def test_the_runs_best_is_timed_again_beside_openblas_and_the_catalogue(
    tmp_path: Path,
) -> None:
    db = tmp_path / "run.sqlite"
    store = Store(db)
    store.add_program(child("fast", SEED, 500.0), "g1")  # as a disturbed run might read it
    store.close()
    model = tmp_path / "policy"
    model.mkdir()
    (model / "corpus.json").write_text(
        json.dumps([{"status": "success", "stage": 1, "source": SEED, "gflops": 2.0}])
    )
    config = SchedulerConfig()
    best = demo.benchmark_corpus_best(config, model, db=db)
    assert best is not None
    run, blas = best["run"], best["openblas"]
    assert run["in_run"] == 500.0 and 0 < run["gflops"] < blas["gflops"]
    assert blas["rounds"] == 3 and blas["core"]
    assert set(best["per_stage"]) == {"1"} and best["stage"] == 1


def test_the_headline_says_how_the_best_kernel_was_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from rich.console import Console

    printed = io.StringIO()
    monkeypatch.setattr(demo, "console", Console(file=printed, width=200, color_system=None))
    blas = {"gflops": 100.0, "rounds": 3, "core": "SkylakeX"}
    data = {"best": {"gflops": 90.0, "stage": 4, "iteration": 3}}
    demo.print_headline(None, data, {"openblas": blas, "run": {"gflops": 70.0, "stage": 4}})
    demo.print_headline(None, data, {"openblas": blas})  # a run's database not read
    first, second = printed.getvalue().splitlines()
    assert "70.0 GFLOPS (stage 4) = 70% of OpenBLAS" in first and "side by side" in first
    assert "90.0 GFLOPS (stage 4) = 90% of OpenBLAS" in second and "as the run timed" in second
