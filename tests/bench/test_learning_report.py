"""bench/learning.py's report (the paper's Experiment 2): the per-iteration bests per stage read
out of a run's metrics.json, the run's best GFLOPS trained against lr 0, and the target
verdicts, on synthetic metrics dicts shaped as deploy/local/demo.py writes them."""

from __future__ import annotations

import argparse
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from hpcrl_evaluate.retime import Entry, Retimed
from hpcrl_evaluate.stats import Interval
from tests.support.scripts import load_script

bench = load_script("bench/learning.py", "bench_learning")


def stage(best: float | None) -> dict[str, Any]:
    return {"count": 8, "best_gflops": best, "median_gflops": best, "status_share": {"ok": 1.0}}


def metrics(
    pools: list[dict[str, float | None]],
    best: dict[str, Any] | None = None,
    total: int | None = None,
) -> dict[str, Any]:
    """A metrics.json: one pool per iteration, {stage: best GFLOPS}."""
    iterations = [
        {"iteration": i, "pool": {s: stage(v) for s, v in pool.items()}}
        for i, pool in enumerate(pools)
    ]
    return {
        "scheduler": {
            "iterations": iterations,
            "best": best,
            "iterations_total": total or len(pools),
        },
        "learner": {},
        "evaluation": None,
    }


def render(table: Any) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(table)
    return out.getvalue()


def test_stage_bests_fills_every_iteration_of_every_stage() -> None:
    data = metrics([{"1": 2.0}, {"1": 3.5, "2": None}, {"1": 3.5, "2": 7.0, "10": 1.0}])
    assert bench.stage_bests(data) == {
        1: {0: 2.0, 1: 3.5, 2: 3.5},
        2: {0: None, 1: None, 2: 7.0},  # not reached, then no correct kernel, then 7
        10: {0: None, 1: None, 2: 1.0},  # stages sort as numbers, not strings
    }
    assert list(bench.stage_bests(data)) == [1, 2, 10]


def test_stage_bests_of_a_run_without_iterations() -> None:
    assert bench.stage_bests(metrics([])) == {}


def test_run_best() -> None:
    best = {"id": 7, "gflops": 12.5, "stage": 3, "iteration": 4}
    assert bench.run_best(metrics([{"1": 1.0}], best)) == 12.5
    assert bench.run_best(metrics([{"1": 1.0}], None)) is None
    assert bench.run_best(None) is None  # the run has no metrics.json


def test_relative_gain_and_higher() -> None:
    c = bench.BestComparison(0, trained=23.0, control=20.0)
    assert c.higher and c.relative_gain == pytest.approx(0.15)
    c = bench.BestComparison(0, trained=10.0, control=20.0)
    assert not c.higher and c.relative_gain == pytest.approx(-0.5)
    # a run without a correct kernel counts 0 GFLOPS
    assert bench.BestComparison(0, trained=None, control=5.0).relative_gain == -1.0
    assert bench.BestComparison(0, trained=5.0, control=None).relative_gain == math.inf
    tie = bench.BestComparison(0, trained=None, control=None)
    assert not tie.higher and tie.relative_gain == 0.0


def comparisons(*pairs: tuple[float | None, float | None]) -> list[Any]:
    return [bench.BestComparison(i, t, c) for i, (t, c) in enumerate(pairs)]


def test_best_verdict_passes_two_of_three_by_sixteen_percent_on_average() -> None:
    verdict = bench.best_verdict(comparisons((13.0, 10.0), (12.0, 10.0), (9.9, 10.0)))
    assert (verdict.higher, verdict.required, verdict.seeds) == (2, 2, 3)
    assert verdict.mean_gain == pytest.approx((0.3 + 0.2 - 0.01) / 3)
    assert verdict.passed


def test_best_verdict_misses_a_small_average() -> None:
    verdict = bench.best_verdict(comparisons((11.0, 10.0), (12.0, 10.0), (10.0, 10.0)))
    assert verdict.higher == 2 and verdict.mean_gain == pytest.approx(0.1)
    assert not verdict.passed


def test_best_verdict_misses_one_seed_however_large() -> None:
    verdict = bench.best_verdict(comparisons((50.0, 10.0), (9.0, 10.0), (10.0, 10.0)))
    assert verdict.higher == 1 and verdict.mean_gain > 1
    assert not verdict.passed


@pytest.mark.parametrize(("seeds", "required"), [(1, 1), (2, 2), (3, 2), (4, 3), (6, 4)])
def test_best_verdict_wants_two_thirds_of_the_seeds(seeds: int, required: int) -> None:
    verdict = bench.best_verdict(comparisons(*[(20.0, 10.0)] * seeds))
    assert verdict.required == required and verdict.passed


def test_best_verdict_without_seeds() -> None:
    with pytest.raises(ValueError):
        bench.best_verdict([])


def differences(*lows: tuple[float, float]) -> list[dict[str, Interval]]:
    """Per seed, (share correct, mean GFLOPS) CI low ends; mean reward always above 0."""
    return [
        {
            "share_correct": Interval(sc + 0.1, sc, sc + 0.2),
            "mean_reward": Interval(5.0, 1.0, 9.0),
            "mean_gflops": Interval(gf + 1.0, gf, gf + 2.0),
        }
        for sc, gf in lows
    ]


def test_ci_verdicts_want_the_low_end_above_zero() -> None:
    verdicts = bench.ci_verdicts(differences((0.01, 0.5), (0.0, 2.0), (-0.1, -0.2)))
    assert verdicts == [
        {"share_correct": True, "mean_gflops": True},
        {"share_correct": False, "mean_gflops": True},  # a CI touching 0 is not above it
        {"share_correct": False, "mean_gflops": False},
    ]


def test_iterations_run(tmp_path: Path) -> None:
    assert bench.iterations_run(tmp_path) is None
    (tmp_path / "metrics.json").write_text(json.dumps(metrics([{}] * 4, total=9)))
    assert bench.iterations_run(tmp_path) == 9


def test_stage_table_shows_trained_over_control() -> None:
    trained = metrics([{"1": 2.0}, {"1": 4.0, "2": 8.0}])
    control = metrics([{"1": 2.0}, {"1": 3.0}])
    text = render(bench.stage_table(trained, control, 0, bench.Arm(2e-4, "group_normalized")))
    assert "4.0/3.0" in text and "8.0/-" in text and "-/-" in text


def test_targets_table_prints_pass_and_miss() -> None:
    text = render(
        bench.targets_table(
            differences((0.01, 0.5), (-0.1, 0.5)),
            comparisons((12.0, 10.0), (None, 10.0)),
            bench.Arm(2e-4),
        )
    )
    assert "+20%" in text and "-100%" in text
    assert text.count("PASS") == 3 and text.count("MISS") == 1


def test_plot_writes_one_png(tmp_path: Path) -> None:
    out = tmp_path / "fig8" / "seed0.png"
    bench.plot_stage_bests(
        metrics([{"1": 2.0}, {"1": 4.0, "2": 8.0}]),
        metrics([{"1": 2.0}, {"1": 3.0}]),
        out,
        "seed 0",
    )
    assert out.read_bytes().startswith(b"\x89PNG")


def test_report_plots_every_seed_and_judges(tmp_path: Path, capsys: Any) -> None:
    control, trained = bench.Arm(0.0), bench.Arm(2e-4, "group_normalized")
    for seed, (t_best, c_best) in enumerate([(12.0, 10.0), (13.0, 10.0), (9.0, 10.0)]):
        for arm, best in ((trained, t_best), (control, c_best)):
            run = tmp_path / arm.run_name(seed)
            run.mkdir()
            (run / "metrics.json").write_text(
                json.dumps(
                    metrics(
                        [{"1": best / 2}, {"1": best / 2, "2": best}],
                        {"gflops": best, "stage": 2, "iteration": 1},
                    )
                )
            )
    bench.report_best_gflops(
        tmp_path, [0, 1, 2], control, trained, differences((0.1, 0.1), (0.1, 0.1), (0.1, 0.1))
    )
    pngs = sorted(p.name for p in tmp_path.glob("fig8-*.png"))
    assert pngs == [f"fig8-{trained.run_name(seed)}.png" for seed in range(3)]
    assert "in 2 of 3 seeds" in capsys.readouterr().out


def test_report_does_not_judge_a_run_without_metrics(tmp_path: Path, capsys: Any) -> None:
    control, trained = bench.Arm(0.0), bench.Arm(2e-4)
    bench.report_best_gflops(tmp_path, [0], control, trained, differences((0.1, 0.1)))
    out = capsys.readouterr().out
    assert "not judged" in out and "PASS" in out  # the CI targets still are
    assert not list(tmp_path.glob("*.png"))


def test_a_variant_arm_runs_under_its_own_name_with_its_settings_in_the_environment() -> None:
    variant = bench.Variant.parse(
        "dapo:learner.skip_zero_variance_groups=true,learner.clip_eps_high=0.28"
    )
    arm = bench.Arm(2e-4, "group_normalized", variant)
    assert arm.run_name(1) == "learning-group-normalized-dapo-lr0p0002-s1"
    assert arm.run_name(1) != bench.Arm(2e-4, "group_normalized").run_name(1)
    assert arm.environment() == {
        "HPCRL__LEARNER__LEARNING_RATE": "0.0002",
        "HPCRL__SCHEDULER__REWARD_MODE": "group_normalized",
        "HPCRL__LEARNER__SKIP_ZERO_VARIANCE_GROUPS": "true",
        "HPCRL__LEARNER__CLIP_EPS_HIGH": "0.28",
    }
    assert "dapo" in arm.label


def test_variants_only_leaves_out_the_arm_with_the_demos_own_settings() -> None:
    clip = bench.Variant.parse("clip02:learner.max_grad_norm=0.2")
    both = bench.trained_arms([2e-4], ["group_normalized"], [clip])
    assert [arm.variant for arm in both] == [None, clip]
    only = bench.trained_arms([2e-4, 1e-4], ["group_normalized"], [clip], variants_only=True)
    assert [(arm.lr, arm.variant) for arm in only] == [(2e-4, clip), (1e-4, clip)]
    assert only[0].run_name(1) == "learning-group-normalized-clip02-lr0p0002-s1"


@pytest.mark.parametrize("text", ["dapo", "Dapo:learner.beta=0", "x:beta=0", "x:learner.beta"])
def test_a_malformed_variant_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        bench.Variant.parse(text)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("x:learner.no_such_key=1", "unknown key"),
        ("x:learner.beta=-1", "greater than or equal"),
        ("x:generator.dtype=float32", "only learner and scheduler"),
    ],
)
def test_a_variant_the_services_would_refuse_stops_the_bench_before_any_run(
    text: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    with pytest.raises(SystemExit):
        bench.check_variant(bench.Variant.parse(text), parser)
    assert why in capsys.readouterr().err


def test_children_are_classed_by_their_strongest_technique() -> None:
    assert bench.technique_class(["simd", "openmp", "prefetch"]) == "openmp"
    assert bench.technique_class(["cache_blocking", "simd"]) == "simd"
    assert bench.technique_class(["register_blocking", "prefetch"]) == "scalar"
    assert bench.technique_class([]) == "scalar"


def test_the_children_table_shows_a_policy_trading_speed_for_safety() -> None:
    """Rows as the scheduler's programs table holds them: early OpenMP attempts that mostly
    fail, late scalar kernels that all pass, slower."""
    rows = [
        (0, "success", 100.0, 45.0, '["openmp", "simd"]'),
        (1, "compile_error", -40.0, None, '["openmp"]'),
        (2, "stage_violation", -100.0, None, '["openmp"]'),
        (3, "success", 90.0, 15.0, "[]"),
        (5, "success", 100.0, 16.0, '["cache_blocking"]'),
        (6, "success", 80.0, 12.0, "[]"),
        (8, "success", 95.0, 14.0, "[]"),
    ]
    figures = bench.children_by_class(rows, late_from=5)
    omp = figures[("early", "openmp")]
    assert (omp.children, omp.correct, omp.reward, omp.gflops) == (3, 1, -40.0, [45.0])
    late = figures[("late", "scalar")]
    assert (late.children, late.correct, late.gflops) == (3, 3, [16.0, 12.0, 14.0])
    assert ("late", "openmp") not in figures
    assert bench._class_cell(omp) == "3, 0.33, -13.3, 45.0 / 45.0"
    assert bench._class_cell(late) == "3, 1.00, +91.7, 14.0 / 16.0"
    assert bench._class_cell(None) == "-"


def test_the_learner_table_shows_the_probe_rising_where_the_own_kl_stays_low(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """metrics.json as the demo writes it: the lr-0 arm's probe NLL is v0's, flat; the
    trained arm's KL stays small while its probe NLL climbs; NaN (probe off) is left out."""
    control, trained = bench.Arm(0.0), bench.Arm(2e-4)

    def write(arm: Any, versions: list[dict[str, float]]) -> None:
        run = tmp_path / arm.run_name(1)
        run.mkdir()
        (run / "metrics.json").write_text(json.dumps({"learner": {"versions": versions}}))

    write(control, [{"version": v, "kl": 0.0, "taught_nll": 0.41} for v in (1, 2, 3)])
    write(
        trained,
        [
            {"version": 1, "kl": 0.004, "taught_nll": 0.42},
            {"version": 2, "kl": 0.012, "taught_nll": 0.97},
            {"version": 3, "kl": 0.009, "taught_nll": 0.88},
            {"version": 4, "kl": 0.010, "taught_nll": math.nan},
        ],
    )
    text = render(bench.learner_table(tmp_path, [control, trained], 1))
    assert "0.41 / 0.41 / 0.41" in text
    assert "0.42 / 0.97 / 0.88" in text
    assert "0.01 / 0.012" in text and "| 4 " in text.replace("│", "|")
    said = io.StringIO()
    monkeypatch.setattr(bench, "console", Console(file=said, width=200))
    assert bench.learner_table(tmp_path, [control, trained], 2) is None
    assert said.getvalue() == "", "the best-GFLOPS table already said the file is missing"
    bench.read_metrics(tmp_path / control.run_name(2))
    assert "is missing" in said.getvalue()


def test_the_children_table_reads_each_arms_database(monkeypatch: pytest.MonkeyPatch) -> None:
    trained, control = bench.Arm(2e-4), bench.Arm(0.0)
    databases = {
        trained.run_name(0): [(7, "success", 100.0, 14.0, "[]")],
        control.run_name(0): [(7, "success", 100.0, 40.0, '["openmp"]')],
    }
    monkeypatch.setattr(bench, "read_children", databases.get)
    text = render(bench.children_table([control, trained], 0, 9))
    assert "iterations 0-4 (early) and 5-8 (late)" in text.replace("\n", " ")
    assert "40.0 / 40.0" in text and "14.0 / 14.0" in text
    monkeypatch.setattr(bench, "read_children", lambda name: None)
    assert bench.children_table([control, trained], 0, 9) is None


INTERRUPTED_BENCH = """
import os, signal, sys
from tests.support.scripts import load_script

# As in a terminal: a suite started in the background of a shell without job control
# inherits SIGINT ignored, and Python then leaves it ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)

bench = load_script("bench/learning.py", "bench_learning")
run = '''
import pathlib, signal, sys, time

def stop(*_):
    time.sleep(1.0)  # stopping four services takes a while
    pathlib.Path(sys.argv[1]).write_text("stopped in order")
    sys.exit(0)

signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(60)
'''
try:
    bench.run_to_the_end([sys.executable, "-c", run, sys.argv[1]], dict(os.environ))
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_a_ctrl_c_lets_the_running_demo_stop_its_services(tmp_path):
    """A terminal's Ctrl-C goes to the bench's process group; the run it started (here a
    stand-in that takes a second to stop) must get a SIGTERM and the time to stop in order,
    not the SIGKILL that ``subprocess.run`` sends 0.25 s after an interrupt."""
    import os
    import signal
    import subprocess
    import sys

    marker = tmp_path / "stopped"
    bench_proc = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED_BENCH, str(marker)],
        cwd=bench.ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        assert bench_proc.stdout is not None and bench_proc.stdout.readline() == "ready\n"
        os.killpg(bench_proc.pid, signal.SIGINT)
        assert bench_proc.wait(timeout=30) == 130
    finally:
        bench_proc.kill()
    assert marker.read_text() == "stopped in order"


# --- the best-GFLOPS target on each arm's fastest kernels timed again side by side --------


def test_the_fastest_children_are_distinct_correct_children_not_the_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sqlite3

    from hpcrl_scheduler.store import SCHEMA

    name = "learning-lr0-s0"
    path = tmp_path / name / "scheduler" / f"{name}.sqlite"
    path.parent.mkdir(parents=True)
    rows = [  # (id, iteration, stage, source, status, gflops)
        ("seed", -1, 1, "hand-written seed", "success", 99.0),
        ("a", 1, 3, "kernel a", "success", 40.0),
        ("a-again", 4, 3, "kernel a", "success", 42.0),
        ("b", 2, 4, "kernel b", "success", 30.0),
        ("wrong", 2, 4, "kernel w", "verification_error", None),
        ("c", 5, 5, "kernel c", "success", 20.0),
    ]
    with sqlite3.connect(path) as db:
        db.executescript(SCHEMA)
        db.executemany(
            "INSERT INTO programs (id, iteration, stage, key, source, mode, status, gflops) "
            "VALUES (?, ?, ?, '', ?, 'deepen', ?, ?)",
            rows,
        )
    monkeypatch.setattr(bench, "DATA", tmp_path)
    children = bench.fastest_children(name, "lr 0", count=2)
    assert [(c.source, c.stage, c.gflops) for c in children] == [
        ("kernel a", 3, 42.0),
        ("kernel b", 4, 30.0),
    ]
    assert bench.fastest_children("no-such-run", "lr 0") == []


def test_the_target_is_judged_on_the_kernels_timed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    control, trained = bench.Arm(0.0), bench.Arm(2e-4, "group_normalized")
    for arm, best in ((trained, 80.0), (control, 110.0)):
        run = tmp_path / arm.run_name(0)
        run.mkdir()
        (run / "metrics.json").write_text(
            json.dumps(metrics([{"3": best}], {"gflops": best, "stage": 3, "iteration": 0}))
        )
    children = {
        trained.run_name(0): [Entry("trained", "/* t */", 4, 80.0)],
        control.run_name(0): [Entry("lr 0", "/* c */", 4, 110.0)],
    }
    monkeypatch.setattr(bench, "fastest_children", lambda name, arm: children[name])

    def retimer(arms: list[list[Any]]) -> Any:
        medians = {arm[0]: {"trained": 99.0, "lr 0": 80.0}[arm[0].group] for arm in arms}
        return Retimed({e.group: m for e, m in medians.items()}, 120.0, medians)

    printed = io.StringIO()
    monkeypatch.setattr(bench, "console", Console(file=printed, width=250, color_system=None))
    bench.report_best_gflops(tmp_path, [0], control, trained, differences((0.1, 0.1)), retimer)
    out = printed.getvalue()
    assert "110.00 / 80.00" in out and "120.00" in out  # the runs' own figures, OpenBLAS
    assert "+24%" in out and "in 1 of 1 seeds" in out
    record = json.loads((tmp_path / f"retimed-{trained.run_name(0)}.json").read_text())
    assert record["best"] == {"trained": 99.0, "lr 0": 80.0}
    assert {(k["arm"], k["in_run"], k["median"]) for k in record["kernels"]} == {
        ("trained", 80.0, 99.0),
        ("lr 0", 110.0, 80.0),
    }


def test_the_benchmarker_retimer_times_real_kernels_and_openblas() -> None:
    """The real benchmarker (sandbox, verification, timing lock) and OpenBLAS dgemm: the
    seed kernel, a naive triple loop, is well below dgemm on every node."""
    from hpcrl_common.task import builtin_seed

    seed = builtin_seed("matmul")
    assert seed is not None
    retimed = bench.benchmarker_retimer(rounds=1)(
        [[Entry("trained", seed, 1, 1.0)], [Entry("lr 0", seed + "\n", 1, 1.0)]]
    )
    assert (retimed.best["trained"] or 0) > 0 and (retimed.best["lr 0"] or 0) > 0
    assert retimed.reference is not None and retimed.reference > retimed.best["trained"]


def test_compile_errors_table_counts_v0_and_the_final_version_by_cause() -> None:
    def version(number: int, errors: list[tuple[str, str]]) -> dict[str, Any]:
        return {"version": number, "samples": [{"status": s, "error": e} for s, e in errors]}

    undefined = ("compile_error", "kernel.c:2:36: error: 'BM' undeclared (first use)")
    loop_var = ("compile_error", "kernel.c:3:14: error: 'j' undeclared (first use)")
    ok = ("success", "")
    evaluation = {"versions": [version(0, [undefined, ok, ok]), version(17, [undefined] * 3)]}
    control = {"versions": [version(0, [undefined, ok, ok]), version(0, [loop_var, ok, ok])]}
    runs = {bench.Arm(0.0): [control], bench.Arm(2e-4): [evaluation]}
    rows = [
        line.split("│")[1:-1]
        for line in render(bench.compile_errors_table(runs, 0, 1)).splitlines()
        if line.count("│") > 3 and "arm" not in line
    ]
    cells = [[cell.strip() for cell in row] for row in rows]
    # arm, version, all, undefined macro, undeclared variable, no header, syntax, other
    assert [row[1:5] for row in cells] == [
        ["v0", "1", "1", "0"],
        ["v0", "1", "0", "1"],
        ["v0", "1", "1", "0"],
        ["v17", "3", "3", "0"],
    ]
