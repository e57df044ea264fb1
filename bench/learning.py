"""The paper's Experiment 2: does the policy learn? The demo with learning rate 0 (no update)
versus the demo's, per seed, on best GFLOPS per stage per iteration and on the fixed evaluation
set.

By default: the demo's nine SQD iterations (`deploy/local/demo.toml`, scheduler.iterations) x
seeds 0, 1, 2 x {no update (lr 0), trained (the demo's settings: learning rate, reward mode,
anchor nodes, replay)}, the two arms of a seed with the same sampling seeds. Runs
`deploy/local/demo.py` (the four real services over the real broker) once per (arm, seed), each
as its own experiment (own namespace, data dir and run dir under --runs). About 15-25 min per
run (with its evaluation) on an idle 2-core AVX-512 node with the policy cached, by the node, so
the default 6 runs take 1.5-2.5 h; --reuse resumes an interrupted bench.

Every run ends with the demo's own evaluation (`hpcrl-evaluate`: version 0 and the final version
sample the same fixed prompts with the same seeds; `evaluation.json`) and its report
(`metrics.json`: the scheduler's pools per iteration). Pools are compared only on their best
kernels: their mix of prompts drifts with what the policy wrote. Printed:

1. per run: final - v0 for share correct, mean raw reward and mean GFLOPS (failures count 0),
   with its paired bootstrap 95 % CI (the demo's figure);
2. per seed: the trained arm's gain minus the lr-0 arm's gain, with a 95 % CI from
   bootstrapping the paired samples of both arms together (all four evaluations of a seed
   share prompts and sampling seeds, so sample i of prompt p is one resampling unit); then
   across seeds the mean of that difference and its spread (standard deviation, range);
3. per seed: best GFLOPS of each stage's pool per iteration, trained / lr 0 (the paper's
   Fig. 8), also plotted to <runs>/fig8-<trained run>.png (solid: trained, dashed: lr 0);
4. the targets (issue 26, section 5), PASS or MISS: in each seed, trained gain - lr-0 gain
   above 0 (its 95 % CI's low end) for share correct and for mean GFLOPS; and the run's best
   GFLOPS higher with training in at least 2 of 3 seeds (two thirds of the seeds, rounded up),
   by at least 16 % on average over the seeds (the paper's smallest gain; a run without a
   correct kernel counts 0 GFLOPS). A run's best here is not the figure its run timed: the
   two runs of a seed are timed minutes apart on a node whose speed drifts by more than that
   gain, so each arm's 4 fastest kernels are timed again side by side (3 rounds, interleaved,
   the order reversed each round, OpenBLAS dgemm once a round) and each arm's best is its
   fastest kernel's median (each kernel's figures also in
   <runs>/retimed-<trained run>.json); the table shows the runs' own figures beside them
   (--no-retime judges on those);
5. per seed and arm: the fixed set's compile errors of v0 and of the final version by gcc's
   first error (undefined macro, undeclared variable, SIMD without <immintrin.h>, an
   intrinsic's arguments, syntax, other): a policy that stops writing what its own parents
   always carry (a tile size's #define, the intrinsics header) for parents that lack it
   shows here;
6. per seed and arm: the children the run filed (its scheduler database), OpenMP, SIMD-only
   and scalar, in the first and the second half of the iterations: count, share correct, mean
   reward, median and best GFLOPS. A policy that buys correctness with speed shows here;
7. per seed and arm: the learner's drift, from its checkpoints' figures in metrics.json: KL to
   v0 on its own samples (last, max) and the held-out taught-set NLL (`taught_nll`: first,
   max, last). The lr-0 arm's NLL is v0's, since its weights never move; a trained arm whose
   NLL climbs above it forgets how to extend parents it did not write, which its own KL does
   not show.

    .venv/bin/python bench/learning.py                 # Experiment 2: 3 seeds x 2 arms, 1.5-2.5 h
    .venv/bin/python bench/learning.py --reuse         # resume it, or print its report again
    .venv/bin/python bench/learning.py --reward-modes parent_relative group_normalized
    .venv/bin/python bench/learning.py --seeds 0 --iterations 2 --eval-samples 4   # quicker
    .venv/bin/python bench/learning.py --seeds 0 --variant nokl:learner.beta=0     # a sweep
    .venv/bin/python bench/learning.py --variants-only --variant clip02:learner.max_grad_norm=0.2
    .venv/bin/python bench/learning.py --seeds 1 2 --variant restyle:scheduler.restyle_parents=0.6
    .venv/bin/python bench/learning.py --seeds 0 --variant anchor2:scheduler.anchor_nodes=2

With several reward modes, learning rates or variants, every trained arm is compared with the
same lr-0 run of its seed: at learning rate 0 the weights never move, whatever the rewards.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hpcrl_common.config import ConfigError, load_config
from hpcrl_evaluate.errors import CAUSES, compile_error_causes
from hpcrl_evaluate.retime import ROUNDS, Entry, Retimed, benchmarker_timers, retime
from hpcrl_evaluate.run import metric_values, records_of
from hpcrl_evaluate.stats import Interval, gain_difference
from hpcrl_learner.config import LearnerConfig
from hpcrl_scheduler import report
from hpcrl_scheduler.config import SchedulerConfig
from hpcrl_scheduler.store import Store

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "deploy/local/demo.py"
CONFIG = ROOT / "deploy/local/demo.toml"
DATA = ROOT / "data" / "bench-learning"  # each run's experiment.data_dir is DATA / its name
SHOWN = {
    "share_correct": "share correct",
    "mean_reward": "mean reward (raw)",
    "mean_gflops": "mean GFLOPS (failures 0)",
}
console = Console()


@dataclass(frozen=True)
class Arm:
    """One way of training: a learning rate and a reward mode (None only for the lr-0
    control, whose weights never move whatever the rewards). Run names always carry the mode,
    so --reuse never takes one mode's run for another's when the demo's default changes."""

    lr: float
    reward_mode: str | None = None
    variant: Variant | None = None

    @property
    def label(self) -> str:
        mode = f", {self.reward_mode}" if self.reward_mode else ""
        variant = f", {self.variant.name}" if self.variant else ""
        return f"lr {self.lr:g}{mode}{variant}"

    def run_name(self, seed: int) -> str:
        mode = f"{self.reward_mode.replace('_', '-')}-" if self.reward_mode else ""
        variant = f"{self.variant.name}-" if self.variant else ""
        return f"learning-{mode}{variant}lr{self.lr:g}-s{seed}".replace(".", "p")

    def environment(self) -> dict[str, str]:
        """The HPCRL__* overrides of this arm's run (the demo config is the rest)."""
        env = {"HPCRL__LEARNER__LEARNING_RATE": repr(self.lr)}
        if self.reward_mode is not None:
            env["HPCRL__SCHEDULER__REWARD_MODE"] = self.reward_mode
        for key, value in self.variant.settings if self.variant else ():
            env["HPCRL__" + key.upper().replace(".", "__")] = value
        return env


@dataclass(frozen=True)
class Variant:
    """Settings a trained arm changes besides its learning rate and reward mode, named so
    that its runs have their own names (`--variant dapo:learner.skip_zero_variance_groups=true`)."""

    name: str
    settings: tuple[tuple[str, str], ...]

    @classmethod
    def parse(cls, text: str) -> Variant:
        name, sep, rest = text.partition(":")
        if not sep or not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):
            raise argparse.ArgumentTypeError(
                f"{text!r}: give NAME:SECTION.KEY=VALUE[,SECTION.KEY=VALUE...] with a "
                "lower-case NAME of letters, digits and dashes"
            )
        settings = []
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            if not eq or not re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+", key.strip()):
                raise argparse.ArgumentTypeError(
                    f"{text!r}: {item!r} is not SECTION.KEY=VALUE (e.g. learner.beta=0)"
                )
            settings.append((key.strip(), value.strip()))
        return cls(name, tuple(settings))


def run_experiment(name: str, seed: int, arm: Arm, args: argparse.Namespace) -> dict[str, Any]:
    """One demo run, fresh; its evaluation.json (which must compare two versions)."""
    env = {
        **os.environ,
        "HPCRL__EXPERIMENT__NAME": name,
        "HPCRL__EXPERIMENT__SEED": str(seed),
        "HPCRL__EXPERIMENT__DATA_DIR": str(DATA / name),
        "HPCRL__BROKER__NAMESPACE": name,
        **arm.environment(),
    }
    if args.iterations is not None:
        env["HPCRL__SCHEDULER__ITERATIONS"] = str(args.iterations)
    finished = args.runs / name / "evaluation.json"
    if args.reuse and finished.is_file():
        ran = iterations_run(args.runs / name)
        if ran not in (None, args.iterations_total):  # never replace it silently
            raise SystemExit(
                f"{name}: the finished run in {finished.parent} ran {ran} "
                f"iterations, not {args.iterations_total}; give --iterations "
                f"{ran} to report on it, or another --runs"
            )
        console.print(f"--- {name}: reusing the finished run in {finished.parent}")
        return json.loads(finished.read_text())
    console.print(f"--- {name}: seed {seed}, {arm.label}")
    # --reevaluate: the run trained already (its checkpoints under data/); judge it again.
    mode = "--evaluate-only" if args.reevaluate else "--fresh"
    command = [sys.executable, str(DEMO), mode, "--runs", str(args.runs)]
    code = run_to_the_end([*command, "--eval-samples", str(args.eval_samples)], env)
    if code != 0:
        raise SystemExit(f"{name} failed (exit {code})")
    evaluation = json.loads((args.runs / name / "evaluation.json").read_text())
    if evaluation["comparison"] is None:
        raise SystemExit(f"{name}: the learner took no step, so there is no final version")
    return evaluation


def run_to_the_end(command: list[str], env: dict[str, str]) -> int:
    """Run one demo in its own session and return its exit status.

    A Ctrl-C reaches this script alone; the run then gets one SIGTERM and is waited for while
    it stops its four services in order. (``subprocess.run`` kills its child 0.25 s after an
    interrupt, which left the services of an interrupted bench running.)"""
    run = subprocess.Popen(command, env=env, cwd=ROOT, start_new_session=True)
    try:
        return run.wait()
    except KeyboardInterrupt:
        console.print("[bold]interrupted:[/] the run is stopping its services")
        run.send_signal(signal.SIGTERM)
        run.wait()
        raise


def iterations_run(run_dir: Path) -> int | None:
    """How many SQD iterations a finished run was set to (its metrics.json), or None."""
    path = run_dir / "metrics.json"
    if not path.is_file():
        return None
    total = json.loads(path.read_text()).get("scheduler", {}).get("iterations_total")
    return None if total is None else int(total)


def _ci(interval: Interval | dict[str, float]) -> str:
    if isinstance(interval, Interval):
        interval = interval.to_json()
    return f"{interval['gain']:+.3g} [{interval['low']:+.3g}, {interval['high']:+.3g}]"


def arm_values(evaluation: dict[str, Any], metric: str) -> tuple[list[float], list[float]]:
    """Per-sample values of version 0 and of the final version, in (prompt, index) order."""
    first, last = evaluation["versions"][0], evaluation["versions"][-1]
    return metric_values(records_of(first), metric), metric_values(records_of(last), metric)


def difference_of_gains(
    trained: dict[str, Any], control: dict[str, Any], metric: str, seed: int
) -> Interval:
    """(trained final - trained v0) - (control final - control v0), paired sample by sample."""
    keys = [
        [(s["prompt"], s["index"]) for s in e["versions"][0]["samples"]] for e in (trained, control)
    ]
    if keys[0] != keys[1] or trained["sampling"]["seed"] != control["sampling"]["seed"]:
        raise SystemExit("the two arms were not evaluated on the same samples and seeds")
    strata = [prompt for prompt, _ in keys[0]]
    return gain_difference(
        *arm_values(trained, metric), *arm_values(control, metric), strata=strata, seed=seed
    )


def per_run_table(runs: dict[Arm, list[dict[str, Any]]], seeds: list[int]) -> Table:
    table = Table(title="Per run: final - v0 on the fixed set, gain [95 % CI]")
    table.add_column("arm")
    table.add_column("seed")
    table.add_column("versions")
    for label in SHOWN.values():
        table.add_column(label)
    for arm, evaluations in runs.items():
        for seed, evaluation in zip(seeds, evaluations, strict=True):
            comparison = evaluation["comparison"]
            table.add_row(
                arm.label,
                str(seed),
                f"v{comparison['before']} -> v{comparison['after']}",
                *(_ci(comparison["metrics"][m]) for m in SHOWN),
            )
    return table


def seed_differences(
    runs: dict[Arm, list[dict[str, Any]]], seeds: list[int], control: Arm, trained: Arm
) -> list[dict[str, Interval]]:
    """Per seed, the difference of gains of every shown metric, with its CI."""
    return [
        {metric: difference_of_gains(t_eval, c_eval, metric, seed) for metric in SHOWN}
        for seed, t_eval, c_eval in zip(seeds, runs[trained], runs[control], strict=True)
    ]


def learning_table(differences: list[dict[str, Interval]], seeds: list[int], trained: Arm) -> Table:
    """Per seed, the difference of gains with its CI; then the mean and spread over seeds."""
    table = Table(
        title=f"Learning gain: ({trained.label} gain) - (lr 0 gain), per seed "
        "[95 % CI], then across seeds"
    )
    table.add_column("seed")
    for label in SHOWN.values():
        table.add_column(label)
    for seed, intervals in zip(seeds, differences, strict=True):
        table.add_row(str(seed), *(_ci(intervals[m]) for m in SHOWN))
    estimates = {m: [intervals[m].estimate for intervals in differences] for m in SHOWN}
    table.add_section()
    table.add_row("mean over seeds", *(f"{statistics.fmean(estimates[m]):+.3g}" for m in SHOWN))
    table.add_row("std over seeds", *(f"{_stdev(estimates[m]):.3g}" for m in SHOWN))
    table.add_row(
        "range", *(f"[{min(estimates[m]):+.3g}, {max(estimates[m]):+.3g}]" for m in SHOWN)
    )
    return table


def _stdev(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


# --- the paper's Fig. 8 and the run's best kernel, from each run's metrics.json -----------

# Issue 26, section 5: in each seed, trained gain - lr-0 gain above 0 (95 % CI) for these ...
CI_TARGETS = ("share_correct", "mean_gflops")
# ... and the run's best GFLOPS higher with training in two thirds of the seeds (2 of 3), by
# at least this much on average over the seeds (the paper's smallest gain, +16 %).
BEST_SHARE_OF_SEEDS = (2, 3)
BEST_MIN_MEAN_GAIN = 0.16


def read_metrics(run_dir: Path, *, warn: bool = True) -> dict[str, Any] | None:
    """A run's metrics.json (the demo's report), or None where the run has none (said once,
    by the best-GFLOPS table; later readers pass warn=False)."""
    path = run_dir / "metrics.json"
    if not path.is_file():
        if warn:
            console.print(f"[yellow]{path} is missing: no best GFLOPS for this run[/]")
        return None
    return json.loads(path.read_text())


def stage_bests(metrics: dict[str, Any]) -> dict[int, dict[int, float | None]]:
    """{stage: {iteration: best GFLOPS of that stage's pool}} for every stage any iteration's
    pool holds, over every iteration (None: no correct kernel of the stage in that pool)."""
    iterations = metrics["scheduler"]["iterations"]
    stages = sorted({int(stage) for it in iterations for stage in it["pool"]})
    return {
        stage: {
            int(it["iteration"]): it["pool"].get(str(stage), {}).get("best_gflops")
            for it in iterations
        }
        for stage in stages
    }


def run_best(metrics: dict[str, Any] | None) -> float | None:
    """The run's best GFLOPS (its best correct kernel, the seed kernel excluded), or None."""
    best = (metrics or {}).get("scheduler", {}).get("best")
    return None if best is None else float(best["gflops"])


@dataclass(frozen=True)
class BestComparison:
    """The run's best GFLOPS of one seed, trained and lr 0 (None: no correct kernel)."""

    seed: int
    trained: float | None
    control: float | None
    # Where the two figures above are the arms' fastest kernels timed again side by side
    # (fastest_children, retime): each run's best as its run timed it, and OpenBLAS dgemm
    # timed beside them.
    in_run: tuple[float | None, float | None] | None = None  # (trained, lr 0)
    reference: float | None = None

    @property
    def higher(self) -> bool:
        return (self.trained or 0.0) > (self.control or 0.0)

    @property
    def relative_gain(self) -> float:
        """trained / lr 0 - 1; a run without a correct kernel counts 0 GFLOPS."""
        trained, control = self.trained or 0.0, self.control or 0.0
        if control > 0:
            return trained / control - 1.0
        return float("inf") if trained > 0 else 0.0


# --- each seed's fastest kernels timed again, both arms together -------------------------

# A seed's two runs are timed minutes apart on a node whose speed drifts by more than the gain
# to judge (hpcrl_evaluate.retime), so the best-GFLOPS target compares each arm's fastest
# kernels timed again side by side.
RETIME_TOP = 4  # per arm: its run's fastest distinct correct children


def fastest_children(name: str, arm: str, count: int = RETIME_TOP) -> list[Entry]:
    """The ``count`` fastest distinct correct children of run ``name`` (the hand-written seed
    kernel left out, as in the run's best), fastest first; [] without its database."""
    path = DATA / name / "scheduler" / f"{name}.sqlite"
    if not path.is_file():
        return []
    store = Store(path, read_only=True)
    try:
        children = report.fastest_children(store, count)
    finally:
        store.close()
    return [Entry(arm, p.source or "", p.stage, p.gflops or 0.0) for p in children]


Retimer = Callable[[list[list[Entry]]], Retimed]


def benchmarker_retimer(rounds: int = ROUNDS) -> Retimer:
    """:func:`retime` with the benchmarker the runs used and OpenBLAS dgemm."""
    from hpcrl_common.task import load_task

    experiment = load_config(SchedulerConfig, CONFIG, env={}).experiment
    time_entry, time_reference = benchmarker_timers(
        load_task(experiment.task), experiment.opt_level
    )
    return lambda arms: retime(arms, time_entry, time_reference, rounds)


@dataclass(frozen=True)
class BestVerdict:
    higher: int  # seeds where the trained run's best beat the lr-0 run's
    required: int  # of len(seeds), two thirds rounded up
    seeds: int
    mean_gain: float  # the mean relative gain over the seeds

    @property
    def passed(self) -> bool:
        return self.higher >= self.required and self.mean_gain >= BEST_MIN_MEAN_GAIN


def best_verdict(comparisons: list[BestComparison]) -> BestVerdict:
    if not comparisons:
        raise ValueError("no seeds to judge")
    num, den = BEST_SHARE_OF_SEEDS
    n = len(comparisons)
    return BestVerdict(
        higher=sum(c.higher for c in comparisons),
        required=-(-num * n // den),
        seeds=n,
        mean_gain=statistics.fmean(c.relative_gain for c in comparisons),
    )


def ci_verdicts(differences: list[dict[str, Interval]]) -> list[dict[str, bool]]:
    """Per seed and target metric: is the difference of gains above 0, its CI included?"""
    return [
        {metric: intervals[metric].low > 0 for metric in CI_TARGETS} for intervals in differences
    ]


def _verdict(passed: bool) -> str:
    return "[green]PASS[/]" if passed else "[red]MISS[/]"


def _gflops(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _percent(gain: float) -> str:
    return f"{gain:+.0%}" if gain != float("inf") else "+inf"


def stage_table(trained: dict[str, Any], control: dict[str, Any], seed: int, arm: Arm) -> Table:
    """Fig. 8 as numbers: best GFLOPS per stage per iteration, trained/lr 0."""
    t_bests, c_bests = stage_bests(trained), stage_bests(control)
    stages = sorted(set(t_bests) | set(c_bests))
    iterations = sorted({i for bests in (t_bests, c_bests) for per in bests.values() for i in per})
    table = Table(
        title=f"Seed {seed}: best GFLOPS per stage per iteration, {arm.label}/lr 0 (Fig. 8)"
    )
    table.add_column("t")
    for stage in stages:
        table.add_column(f"stage {stage}", no_wrap=True)
    for i in iterations:
        table.add_row(
            str(i),
            *(
                f"{_gflops(t_bests.get(s, {}).get(i), 1)}/{_gflops(c_bests.get(s, {}).get(i), 1)}"
                for s in stages
            ),
        )
    return table


def plot_stage_bests(
    trained: dict[str, Any],
    control: dict[str, Any],
    out: Path,
    title: str,
    trained_label: str = "trained",
) -> None:
    """The paper's Fig. 8 for one seed: a line per stage, solid trained, dashed lr 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    t_bests, c_bests = stage_bests(trained), stage_bests(control)
    stages = sorted(set(t_bests) | set(c_bests))
    colours = plt.get_cmap("tab10")
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for k, stage in enumerate(stages):
        for bests, style in ((t_bests, "-"), (c_bests, "--")):
            per = bests.get(stage, {})
            its = sorted(per)
            axis.plot(
                its,
                [float("nan") if per[i] is None else per[i] for i in its],
                linestyle=style,
                marker="o",
                markersize=3,
                color=colours(k % 10),
            )
    handles = [
        Line2D([], [], color=colours(k % 10), label=f"stage {stage}")
        for k, stage in enumerate(stages)
    ]
    handles += [
        Line2D([], [], color="black", linestyle="-", label=trained_label),
        Line2D([], [], color="black", linestyle="--", label="no update (lr 0)"),
    ]
    axis.set(xlabel="SQD iteration", ylabel="best GFLOPS of the stage's pool", title=title)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.legend(handles=handles, fontsize="small")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)
    plt.close(figure)


def targets_table(
    differences: list[dict[str, Interval]], comparisons: list[BestComparison], arm: Arm
) -> Table:
    """Per seed: the run's best GFLOPS, trained against lr 0, and the CI targets met or not."""
    table = Table(
        title=f"Experiment 2 targets: {arm.label} against no update (lr 0); "
        "gain - lr-0 gain on the fixed set [95 % CI], above 0?"
    )
    retimed = any(c.in_run is not None for c in comparisons)
    columns = ["seed", "best GFLOPS, lr 0", "trained", "gain"]
    if retimed:
        columns += ["as the runs timed them: lr 0 / trained", "OpenBLAS dgemm"]
    for column in columns:
        table.add_column(column)
    for metric in CI_TARGETS:
        table.add_column(SHOWN[metric].split(" (")[0])
        table.add_column("> 0", no_wrap=True)
    for intervals, verdicts, c in zip(
        differences, ci_verdicts(differences), comparisons, strict=True
    ):
        extra = []
        if retimed:
            extra = (
                ["-", "-"]
                if c.in_run is None
                else [f"{_gflops(c.in_run[1])} / {_gflops(c.in_run[0])}", _gflops(c.reference)]
            )
        table.add_row(
            str(c.seed),
            _gflops(c.control),
            _gflops(c.trained),
            _percent(c.relative_gain),
            *extra,
            *(cell for m in CI_TARGETS for cell in (_ci(intervals[m]), _verdict(verdicts[m]))),
        )
    return table


def print_best_verdict(verdict: BestVerdict) -> None:
    console.print(
        f"best GFLOPS of the run higher with training in {verdict.higher} of "
        f"{verdict.seeds} seeds (target >= {verdict.required}), by "
        f"{_percent(verdict.mean_gain)} on average (target >= "
        f"{BEST_MIN_MEAN_GAIN:.0%}): {_verdict(verdict.passed)}"
    )


def compare_bests(
    seed: int,
    control: Arm,
    trained: Arm,
    t_metrics: dict[str, Any] | None,
    c_metrics: dict[str, Any] | None,
    retimer: Retimer | None,
    out: Path | None = None,
) -> BestComparison:
    """The seed's best GFLOPS, trained against lr 0: each arm's fastest children timed again
    together (``retimer``; each kernel's figures printed and, given ``out``, written there as
    JSON), or without one (or without a run's database), as the runs timed them."""
    in_run = BestComparison(seed, run_best(t_metrics), run_best(c_metrics))
    if retimer is None or t_metrics is None or c_metrics is None:
        return in_run
    arms = [
        fastest_children(trained.run_name(seed), "trained"),
        fastest_children(control.run_name(seed), "lr 0"),
    ]
    if not all(arms):
        console.print(
            f"[yellow]seed {seed}: a run's database is missing or holds no correct child; "
            "its best GFLOPS as the runs timed them[/]"
        )
        return in_run
    console.print(
        f"seed {seed}: timing each arm's {RETIME_TOP} fastest kernels again, "
        f"{ROUNDS} interleaved rounds, beside OpenBLAS dgemm"
    )
    retimed = retimer(arms)
    console.print(retimed_table(retimed, seed))
    if out is not None:
        out.write_text(json.dumps(retimed_record(retimed), indent=1))
        console.print(f"figures: {out}")
    return BestComparison(
        seed,
        retimed.best.get("trained"),
        retimed.best.get("lr 0"),
        in_run=(in_run.trained, in_run.control),
        reference=retimed.reference,
    )


def retimed_record(retimed: Retimed) -> dict[str, Any]:
    """What the re-timing found, as JSON: each kernel's median beside its run's figure."""
    return {
        "rounds": ROUNDS,
        "openblas_gflops": retimed.reference,
        "best": retimed.best,
        "kernels": [
            {"arm": e.group, "stage": e.stage, "in_run": e.gflops, "median": median}
            for e, median in retimed.medians.items()
        ],
    }


def retimed_table(retimed: Retimed, seed: int) -> Table:
    table = Table(title=f"Seed {seed}: fastest kernels timed again (GFLOPS)")
    for column in ("arm", "stage", "as its run timed it", f"median of {ROUNDS}"):
        table.add_column(column)
    for entry, median in retimed.medians.items():
        table.add_row(entry.group, str(entry.stage), _gflops(entry.gflops), _gflops(median))
    table.add_row("OpenBLAS dgemm", "", "", _gflops(retimed.reference))
    return table


def report_best_gflops(
    runs: Path,
    seeds: list[int],
    control: Arm,
    trained: Arm,
    differences: list[dict[str, Interval]],
    retimer: Retimer | None = None,
) -> None:
    """Fig. 8 per seed (printed and plotted), then the best-GFLOPS and CI targets; with
    ``retimer``, the best GFLOPS of the two arms of a seed timed again side by side."""
    comparisons, unread = [], []
    for seed in seeds:
        t_metrics = read_metrics(runs / trained.run_name(seed))
        c_metrics = read_metrics(runs / control.run_name(seed))
        comparisons.append(
            compare_bests(
                seed,
                control,
                trained,
                t_metrics,
                c_metrics,
                retimer,
                runs / f"retimed-{trained.run_name(seed)}.json",
            )
        )
        if t_metrics is None or c_metrics is None:
            unread.append(seed)
            continue
        console.print(stage_table(t_metrics, c_metrics, seed, trained))
        out = runs / f"fig8-{trained.run_name(seed)}.png"
        plot_stage_bests(
            t_metrics,
            c_metrics,
            out,
            f"Seed {seed}: best GFLOPS per stage per iteration (Fig. 8)",
            f"trained ({trained.label})",
        )
        console.print(f"figure: {out}")
    console.print(targets_table(differences, comparisons, trained))
    if unread:  # a missing report is no evidence of a run without a correct kernel
        console.print(
            f"best GFLOPS target not judged: no metrics.json for seed(s) "
            f"{' '.join(map(str, unread))}"
        )
    else:
        print_best_verdict(best_verdict(comparisons))


# --- what each run's policy wrote: its children by technique, from the scheduler's database --

# The techniques that decide a matmul kernel's ceiling on a CPU: threads, then vectors.
TECHNIQUE_CLASSES = ("openmp", "simd", "scalar")


def technique_class(techniques: list[str]) -> str:
    """openmp if the kernel uses threads, else simd if it uses vectors, else scalar."""
    return next((c for c in TECHNIQUE_CLASSES[:-1] if c in techniques), TECHNIQUE_CLASSES[-1])


@dataclass
class ClassFigures:
    children: int = 0
    correct: int = 0
    reward: float = 0.0
    gflops: list[float] = field(default_factory=list)

    def add(self, status: str, reward: float | None, gflops: float | None) -> None:
        self.children += 1
        self.reward += reward or 0.0
        if status == "success":
            self.correct += 1
            self.gflops.append(gflops or 0.0)


def children_by_class(
    rows: list[tuple[int, str, float | None, float | None, str]], late_from: int
) -> dict[tuple[str, str], ClassFigures]:
    """{(early|late, class): figures} over a run's children, rows (iteration, status, reward,
    GFLOPS, techniques as JSON); late: iterations from ``late_from`` on."""
    figures: dict[tuple[str, str], ClassFigures] = {}
    for iteration, status, reward, gflops, techniques in rows:
        half = "late" if iteration >= late_from else "early"
        key = (half, technique_class(json.loads(techniques)))
        figures.setdefault(key, ClassFigures()).add(status, reward, gflops)
    return figures


def read_children(name: str) -> list[tuple[int, str, float | None, float | None, str]] | None:
    """Every child a run filed (the scheduler's programs table), or None without its database."""
    path = DATA / name / "scheduler" / f"{name}.sqlite"  # the scheduler's default db_path
    if not path.is_file():
        return None
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        return db.execute(
            "SELECT iteration, status, reward, gflops, techniques FROM programs"
        ).fetchall()


def children_table(arms: list[Arm], seed: int, iterations: int) -> Table | None:
    """Per arm, what its policy wrote early and late in the run: a policy that learns safety
    at the cost of speed shows as OpenMP and SIMD children giving way to scalar ones."""
    late_from = (iterations + 1) // 2
    table = Table(
        title=f"Seed {seed}: children by technique, iterations 0-{late_from - 1} (early) and "
        f"{late_from}-{iterations - 1} (late): count, share correct, mean reward, median / "
        "best GFLOPS of the correct"
    )
    table.add_column("arm")
    table.add_column("part")
    for name in TECHNIQUE_CLASSES:
        table.add_column(name)
    shown = False
    for arm in arms:
        rows = read_children(arm.run_name(seed))
        if rows is None:
            continue
        shown = True
        figures = children_by_class(rows, late_from)
        for half in ("early", "late"):
            table.add_row(
                arm.label, half, *(_class_cell(figures.get((half, c))) for c in TECHNIQUE_CLASSES)
            )
    return table if shown else None


def _class_cell(figures: ClassFigures | None) -> str:
    if figures is None or figures.children == 0:
        return "-"
    speeds = sorted(figures.gflops)
    speed = f"{speeds[len(speeds) // 2]:.1f} / {speeds[-1]:.1f}" if speeds else "- / -"
    return (
        f"{figures.children}, {figures.correct / figures.children:.2f}, "
        f"{figures.reward / figures.children:+.1f}, {speed}"
    )


def learner_versions(metrics: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A run's trained versions with their step figures (metrics.json's learner.versions)."""
    return ((metrics or {}).get("learner") or {}).get("versions") or []


def learner_figures(metrics: dict[str, Any] | None, key: str) -> list[float]:
    """One learner figure over a run's versions, in version order, NaN and absent left out."""
    values = [v.get(key) for v in learner_versions(metrics)]
    return [float(x) for x in values if isinstance(x, int | float) and x == x]


def learner_table(runs_dir: Path, arms: list[Arm], seed: int) -> Table | None:
    """Per arm, how far its policy moved: KL to v0 on its own samples, and the NLL of the
    taught examples held out of replay (the probe), which also sees the prompts it never
    samples. None where no run reported either."""
    table = Table(
        title=f"Seed {seed}: learner drift per arm: KL to v0 (own samples) last / max; "
        "held-out taught NLL (nats/token) first / max / last"
    )
    table.add_column("arm")
    table.add_column("steps")
    table.add_column("KL to v0")
    table.add_column("taught NLL")
    shown = False
    for arm in arms:
        metrics = read_metrics(runs_dir / arm.run_name(seed), warn=False)
        kl = learner_figures(metrics, "kl")
        nll = learner_figures(metrics, "taught_nll")
        if not (kl or nll):
            continue
        shown = True
        table.add_row(
            arm.label,
            str(len(learner_versions(metrics))),
            f"{kl[-1]:.3g} / {max(kl):.3g}" if kl else "-",
            f"{nll[0]:.3g} / {max(nll):.3g} / {nll[-1]:.3g}" if nll else "-",
        )
    return table if shown else None


def compile_errors_table(runs: dict[Arm, list[dict[str, Any]]], index: int, seed: int) -> Table:
    """Per arm, v0's and the final version's compile errors on the fixed set by gcc's first
    error: a policy that stops writing what its own parents always carry (a tile size's
    ``#define``, ``<immintrin.h>``) shows here where share correct only shows a loss."""
    table = Table(title=f"Seed {seed}: fixed-set compile errors by gcc's first error")
    table.add_column("arm")
    table.add_column("version")
    table.add_column("all")
    for cause in CAUSES:
        table.add_column(cause)
    for arm, evaluations in runs.items():
        for version in (evaluations[index]["versions"][0], evaluations[index]["versions"][-1]):
            counts = compile_error_causes((s["status"], s["error"]) for s in version["samples"])
            table.add_row(
                arm.label,
                f"v{version['version']}",
                str(sum(counts.values())),
                *(str(counts[cause]) for cause in CAUSES),
            )
    return table


SWEPT_SECTIONS = {"learner": LearnerConfig, "scheduler": SchedulerConfig}


def check_variant(variant: Variant, parser: argparse.ArgumentParser) -> None:
    """Refuse a variant the demo's services would refuse, before any run starts."""
    env = Arm(1.0, variant=variant).environment()
    for key, _ in variant.settings:
        section = key.split(".")[0]
        if section not in SWEPT_SECTIONS:
            parser.error(
                f"--variant {variant.name}: {key}: only {' and '.join(SWEPT_SECTIONS)} "
                "settings vary between arms"
            )
        try:
            load_config(SWEPT_SECTIONS[section], CONFIG, env=env)
        except ConfigError as exc:
            parser.error(f"--variant {variant.name}: {exc}")


def trained_arms(
    learning_rates: list[float],
    modes: list[str],
    variants: list[Variant],
    variants_only: bool = False,
) -> list[Arm]:
    """Every trained arm of a bench: each learning rate under each reward mode, with the
    demo's own settings (unless ``variants_only``) and with each variant's."""
    settings = variants if variants_only else [None, *variants]
    return [
        Arm(lr, mode, variant) for mode in modes for lr in learning_rates for variant in settings
    ]


def main() -> int:
    demo_learner = load_config(LearnerConfig, CONFIG, env={}).learner
    demo_scheduler = load_config(SchedulerConfig, CONFIG, env={}).scheduler
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0, 1, 2],
        help="experiment seeds, one run per arm each (default: 0 1 2)",
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="SQD iterations per run (default: the demo's scheduler.iterations, "
        f"{demo_scheduler.iterations}, the paper's; HPCRL__SCHEDULER__ITERATIONS "
        "overrides it too)",
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        nargs="+",
        default=None,
        help="the learning rate(s) compared with 0 (default: the demo's, "
        f"{demo_learner.learning_rate:g}); several make a sweep, each compared "
        "with the same lr-0 runs",
    )
    parser.add_argument(
        "--reward-modes",
        nargs="+",
        default=None,
        choices=("parent_relative", "group_normalized", "raw"),
        help="train each learning rate under each of these reward modes "
        "(default: the demo's scheduler.reward_mode, "
        f"{demo_scheduler.reward_mode})",
    )
    parser.add_argument(
        "--variant",
        type=Variant.parse,
        action="append",
        default=[],
        metavar="NAME:SECTION.KEY=VALUE[,...]",
        help="one more trained arm per learning rate and reward mode, with these settings "
        "changed (repeatable; a sweep: each compared with the same lr-0 runs), e.g. "
        "dapo:learner.skip_zero_variance_groups=true,learner.clip_eps_high=0.28",
    )
    parser.add_argument(
        "--variants-only",
        action="store_true",
        help="train only the --variant arms, not the demo's own settings beside them "
        "(a sweep that already has, or does not need, the demo's trained arm)",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="reuse runs that already finished (their evaluation.json) instead "
        "of running them again: resume an interrupted bench, add seeds, or "
        "print the report again (a run of another number of iterations stops "
        "the bench)",
    )
    parser.add_argument(
        "--eval-samples",
        type=int,
        default=16,
        help="completions per prompt and version in each run's evaluation (default 16, the demo's)",
    )
    parser.add_argument(
        "--reevaluate",
        action="store_true",
        help="train nothing: evaluate each run's finished checkpoints again "
        "(e.g. with more --eval-samples), results under --runs",
    )
    parser.add_argument(
        "--no-retime",
        action="store_true",
        help="judge the best-GFLOPS target on each run's best as its run timed it, instead "
        f"of timing each arm's {RETIME_TOP} fastest kernels of a seed again side by side "
        f"({ROUNDS} interleaved rounds, about a minute a seed)",
    )
    parser.add_argument(
        "--runs",
        type=Path,
        default=ROOT / "runs" / "bench-learning",
        help="where the runs' reports and the Fig. 8 PNGs go (default: runs/bench-learning)",
    )
    args = parser.parse_args()
    # What each run gets: --iterations, else the demo config as the environment overlays it.
    args.iterations_total = (
        args.iterations
        if args.iterations is not None
        else load_config(SchedulerConfig, CONFIG).scheduler.iterations
    )

    for variant in args.variant:
        check_variant(variant, parser)
    if args.variants_only and not args.variant:
        parser.error("--variants-only needs at least one --variant")
    modes = args.reward_modes or [demo_scheduler.reward_mode]
    control = Arm(0.0)
    trained = trained_arms(
        args.learning_rate or [demo_learner.learning_rate],
        modes,
        args.variant,
        args.variants_only,
    )
    runs: dict[Arm, list[dict[str, Any]]] = {arm: [] for arm in (control, *trained)}
    console.print(
        f"[bold]Experiment 2:[/] {args.iterations_total} iterations x seeds "
        f"{' '.join(map(str, args.seeds))} x {{{', '.join(a.label for a in runs)}}}: "
        f"{len(args.seeds) * len(runs)} runs, about 15-25 min each on an idle 2-core node"
    )
    for seed in args.seeds:  # seed by seed, so an interrupted bench has whole seeds
        for arm in runs:
            runs[arm].append(run_experiment(arm.run_name(seed), seed, arm, args))
    console.print(per_run_table(runs, args.seeds))
    retimer = None if args.no_retime else benchmarker_retimer()
    for arm in trained:
        differences = seed_differences(runs, args.seeds, control, arm)
        console.print(learning_table(differences, args.seeds, arm))
        report_best_gflops(args.runs, args.seeds, control, arm, differences, retimer)
    for index, seed in enumerate(args.seeds):
        for table in (
            compile_errors_table(runs, index, seed),
            children_table(list(runs), seed, args.iterations_total),
            learner_table(args.runs, list(runs), seed),
        ):
            if table is not None:
                console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
