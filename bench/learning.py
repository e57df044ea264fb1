"""Does the policy learn? The demo with learning rate 0 versus the demo's, per seed, each judged
on the fixed evaluation set.

Runs `deploy/local/demo.py` (the four real services over the real broker) once per
(learning rate, seed), each as its own experiment (own namespace, data dir and run dir). Every
run ends with the demo's own evaluation (`hpcrl-evaluate`: version 0 and the final version
sample the same fixed prompts with the same seeds; `evaluation.json`). Pools are not compared:
their mix of prompts drifts with what the policy wrote. Printed, for share correct, mean raw
reward and mean GFLOPS (failures count 0):

1. per run: final - v0, with its paired bootstrap 95 % CI (the demo's figure);
2. per seed: the trained arm's gain minus the lr-0 arm's gain, with a 95 % CI from
   bootstrapping the paired samples of both arms together (all four evaluations of a seed
   share prompts and sampling seeds, so sample i of prompt p is one resampling unit);
3. across seeds: the mean of that difference and its spread (standard deviation, range).

    .venv/bin/python bench/learning.py                 # 3 seeds x 2 learning rates
    .venv/bin/python bench/learning.py --reward-modes parent_relative group_normalized
    .venv/bin/python bench/learning.py --seeds 0 --iterations 2 --eval-samples 4   # quicker

With several reward modes, every (mode, learning rate) arm is compared with the same lr-0
run of its seed: at learning rate 0 the weights never move, whatever the rewards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hpcrl_common.config import load_config
from hpcrl_evaluate.run import metric_values, records_of
from hpcrl_evaluate.stats import Interval, gain_difference
from hpcrl_learner.config import LearnerConfig
from hpcrl_scheduler.config import SchedulerConfig

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "deploy/local/demo.py"
CONFIG = ROOT / "deploy/local/demo.toml"
SHOWN = {"share_correct": "share correct", "mean_reward": "mean reward (raw)",
         "mean_gflops": "mean GFLOPS (failures 0)"}
console = Console()


@dataclass(frozen=True)
class Arm:
    """One way of training: a learning rate and a reward mode (None only for the lr-0
    control, whose weights never move whatever the rewards). Run names always carry the mode,
    so --reuse never takes one mode's run for another's when the demo's default changes."""

    lr: float
    reward_mode: str | None = None

    @property
    def label(self) -> str:
        return f"lr {self.lr:g}" + (f", {self.reward_mode}" if self.reward_mode else "")

    def run_name(self, seed: int) -> str:
        mode = f"{self.reward_mode.replace('_', '-')}-" if self.reward_mode else ""
        return f"learning-{mode}lr{self.lr:g}-s{seed}".replace(".", "p")


def run_experiment(name: str, seed: int, arm: Arm, args: argparse.Namespace) -> dict[str, Any]:
    """One demo run, fresh; its evaluation.json (which must compare two versions)."""
    lr = arm.lr
    env = {
        **os.environ,
        "HPCRL__EXPERIMENT__NAME": name,
        "HPCRL__EXPERIMENT__SEED": str(seed),
        "HPCRL__EXPERIMENT__DATA_DIR": str(ROOT / "data" / "bench-learning" / name),
        "HPCRL__BROKER__NAMESPACE": name,
        "HPCRL__LEARNER__LEARNING_RATE": repr(lr),
    }
    if args.iterations is not None:
        env["HPCRL__SCHEDULER__ITERATIONS"] = str(args.iterations)
    if arm.reward_mode is not None:
        env["HPCRL__SCHEDULER__REWARD_MODE"] = arm.reward_mode
    finished = args.runs / name / "evaluation.json"
    if args.reuse and finished.is_file():
        console.print(f"--- {name}: reusing the finished run in {finished.parent}")
        return json.loads(finished.read_text())
    console.print(f"--- {name}: seed {seed}, {arm.label}")
    # --reevaluate: the run trained already (its checkpoints under data/); judge it again.
    mode = "--evaluate-only" if args.reevaluate else "--fresh"
    done = subprocess.run([sys.executable, str(DEMO), mode, "--runs", str(args.runs),
                           "--eval-samples", str(args.eval_samples)], env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed (exit {done.returncode})")
    evaluation = json.loads((args.runs / name / "evaluation.json").read_text())
    if evaluation["comparison"] is None:
        raise SystemExit(f"{name}: the learner took no step, so there is no final version")
    return evaluation


def _ci(interval: Interval | dict[str, float]) -> str:
    if isinstance(interval, Interval):
        interval = interval.to_json()
    return (f"{interval['gain']:+.3g} [{interval['low']:+.3g}, {interval['high']:+.3g}]")


def arm_values(evaluation: dict[str, Any], metric: str) -> tuple[list[float], list[float]]:
    """Per-sample values of version 0 and of the final version, in (prompt, index) order."""
    first, last = evaluation["versions"][0], evaluation["versions"][-1]
    return metric_values(records_of(first), metric), metric_values(records_of(last), metric)


def difference_of_gains(trained: dict[str, Any], control: dict[str, Any], metric: str,
                        seed: int) -> Interval:
    """(trained final - trained v0) - (control final - control v0), paired sample by sample."""
    keys = [[(s["prompt"], s["index"]) for s in e["versions"][0]["samples"]]
            for e in (trained, control)]
    if keys[0] != keys[1] or trained["sampling"]["seed"] != control["sampling"]["seed"]:
        raise SystemExit("the two arms were not evaluated on the same samples and seeds")
    strata = [prompt for prompt, _ in keys[0]]
    return gain_difference(*arm_values(trained, metric), *arm_values(control, metric),
                           strata=strata, seed=seed)


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
            table.add_row(arm.label, str(seed),
                          f"v{comparison['before']} -> v{comparison['after']}",
                          *(_ci(comparison["metrics"][m]) for m in SHOWN))
    return table


def learning_table(runs: dict[Arm, list[dict[str, Any]]], seeds: list[int],
                   control: Arm, trained: Arm) -> Table:
    """Per seed, the difference of gains with its CI; then the mean and spread over seeds."""
    table = Table(title=f"Learning gain: ({trained.label} gain) - (lr 0 gain), per seed "
                        "[95 % CI], then across seeds")
    table.add_column("seed")
    for label in SHOWN.values():
        table.add_column(label)
    estimates: dict[str, list[float]] = {m: [] for m in SHOWN}
    for seed, t_eval, c_eval in zip(seeds, runs[trained], runs[control], strict=True):
        cells = []
        for metric in SHOWN:
            interval = difference_of_gains(t_eval, c_eval, metric, seed)
            estimates[metric].append(interval.estimate)
            cells.append(_ci(interval))
        table.add_row(str(seed), *cells)
    table.add_section()
    table.add_row("mean over seeds", *(f"{statistics.fmean(estimates[m]):+.3g}" for m in SHOWN))
    table.add_row("std over seeds", *(f"{_stdev(estimates[m]):.3g}" for m in SHOWN))
    table.add_row("range", *(f"[{min(estimates[m]):+.3g}, {max(estimates[m]):+.3g}]"
                             for m in SHOWN))
    return table


def _stdev(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=None,
                        help="override scheduler.iterations of the demo config")
    parser.add_argument("--learning-rate", type=float, nargs="+", default=None,
                        help="the learning rate(s) compared with 0 (default: the demo's); "
                        "several make a sweep, each compared with the same lr-0 runs")
    parser.add_argument("--reward-modes", nargs="+", default=None,
                        choices=("parent_relative", "group_normalized", "raw"),
                        help="train each learning rate under each of these reward modes "
                        "(default: the demo's scheduler.reward_mode, group_normalized)")
    parser.add_argument("--reuse", action="store_true",
                        help="reuse runs that already finished (their evaluation.json) instead "
                        "of running them again: resume an interrupted bench, or add seeds")
    parser.add_argument("--eval-samples", type=int, default=16,
                        help="completions per prompt and version in each run's evaluation "
                        "(default 16, the demo's)")
    parser.add_argument("--reevaluate", action="store_true",
                        help="train nothing: evaluate each run's finished checkpoints again "
                        "(e.g. with more --eval-samples), results under --runs")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench-learning")
    args = parser.parse_args()

    default_lr = load_config(LearnerConfig, CONFIG, env={}).learner.learning_rate
    default_mode = load_config(SchedulerConfig, CONFIG, env={}).scheduler.reward_mode
    modes = args.reward_modes or [default_mode]
    control = Arm(0.0)
    trained = [Arm(lr, mode) for mode in modes for lr in args.learning_rate or [default_lr]]
    runs: dict[Arm, list[dict[str, Any]]] = {arm: [] for arm in (control, *trained)}
    for seed in args.seeds:  # seed by seed, so an interrupted bench has whole seeds
        for arm in runs:
            runs[arm].append(run_experiment(arm.run_name(seed), seed, arm, args))
    console.print(per_run_table(runs, args.seeds))
    for arm in trained:
        console.print(learning_table(runs, args.seeds, control, arm))
    return 0


if __name__ == "__main__":
    sys.exit(main())
