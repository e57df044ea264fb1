"""`make demo`: the whole system on one machine, over the real broker, with a report.

Bootstraps the embedded policy if it is missing, starts the four services as separate
processes (the generator on vLLM's CPU build where it imports, else on transformers), runs the
SQD experiment of ``deploy/local/demo.toml``, shows progress, stops the services cleanly,
evaluates version 0, the version after 4 iterations and the final one on a fixed prompt set
(``hpcrl-evaluate``, same seeds) and writes a run directory: best kernels, metrics as
JSON/CSV, plots, the evaluation, and a summary table, with how well the services overlapped
(wall time against the busiest service's busy time, scraped from their /metrics:
``overlap_report.py``). An experiment of several tasks (``[experiment.tasks]``, e.g.
``deploy/local/multitask.toml``) gets a policy bootstrapped for all of them, one fixed-set
evaluation per task and a summary row and plot per task (``demo_tasks.py``).
Ctrl-C stops everything; running it again resumes the unfinished run (``--fresh`` starts over).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import demo_tasks  # beside this script
import pika
from overlap_report import OverlapProbe, earlier_overlap, print_overlap  # beside this script
from rich.console import Console
from rich.live import Live
from rich.table import Table

from hpcrl_benchmarker.host import has_avx512
from hpcrl_common.access import SCHEDULER_SUBSCRIBER
from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_common.config import load_config
from hpcrl_common.topology import WEIGHT_UPDATES, Topology
from hpcrl_learner.config import LearnerConfig
from hpcrl_scheduler.config import SchedulerConfig
from hpcrl_scheduler.report import export, snapshot
from hpcrl_scheduler.store import Store

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SERVICES = ("benchmarker", "learner", "generator", "scheduler")
console = Console()


def vllm_importable() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True)
    return probe.returncode == 0


@dataclass
class Service:
    name: str
    argv: list[str]
    log: Path
    process: subprocess.Popen | None = None
    handle: Any = field(default=None, repr=False)

    def start(self, env: dict[str, str]) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.handle = self.log.open("ab")
        self.process = subprocess.Popen(
            self.argv,
            env=env,
            stdout=self.handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace_s: float = 30.0) -> None:
        if self.alive():
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.handle is not None:
            self.handle.close()

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "vllm" if vllm_importable() else "transformers"
    return backend


def bootstrap_policy(data_dir: Path, extra: list[str]) -> Path:
    console.print("[bold]policy:[/] checking the embedded model (built once, then cached)")
    out = subprocess.run(
        [str(BIN / "hpcrl-bootstrap"), "--data-dir", str(data_dir), *extra],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    if out.returncode != 0:
        raise SystemExit("error: building the embedded policy failed (see above)")
    return Path(out.stdout.strip().splitlines()[-1])


def purge_broker(config: SchedulerConfig) -> None:
    """A fresh run must not see messages left by an earlier one in the same namespace."""
    topology = Topology(config.broker.namespace, config.broker.delivery_limit)
    connection = pika.BlockingConnection(pika.URLParameters(config.broker.url))
    try:
        channel = connection.channel()
        topology.delete(channel)
        # The scheduler's durable subscription outlives the exchange: an announcement of
        # the old run's last version must not become the new run's version floor.
        channel.queue_delete(topology.subscriber_queue(WEIGHT_UPDATES, SCHEDULER_SUBSCRIBER))
    finally:
        connection.close()


def service_commands(config_path: Path, run_dir: Path) -> list[Service]:
    allow = [] if has_avx512() else ["--allow-isa", "avx2"]
    config = ["--config", str(config_path)]
    argv = {
        "benchmarker": [str(BIN / "hpcrl-benchmarker"), "serve", *config, *allow],
        "learner": [str(BIN / "hpcrl-learner"), "serve", *config],
        "generator": [str(BIN / "hpcrl-generator"), "serve", *config],
        "scheduler": [str(BIN / "hpcrl-scheduler"), "serve", *config],
    }
    return [Service(name, argv[name], run_dir / "logs" / f"{name}.log") for name in SERVICES]


def progress_table(data: dict[str, Any] | None, version: int, started: float) -> Table:
    table = Table(title=f"hpcrl demo — {time.monotonic() - started:.0f} s", show_header=False)
    if data is None:
        table.add_row("scheduler", "starting…")
        return table
    current = data["iterations"][-1] if data["iterations"] else None
    best = data["best"]
    table.add_row("iteration", f"{data['iteration'] + 1} of {data['iterations_total']}")
    if current is not None:
        table.add_row(
            "groups done",
            f"{current['closed']} of {current['groups']} ({current['in_flight']} in flight)",
        )
    table.add_row(
        "best GFLOPS",
        "-"
        if best is None
        else f"{best['gflops']:.2f} (stage {best['stage']}, iteration {best['iteration']})",
    )
    table.add_row("policy version", str(version))
    return table


def read_snapshot(db: Path) -> dict[str, Any] | None:
    if not db.exists():
        return None
    try:
        return snapshot(Store(db))
    except Exception:  # the scheduler may still be creating its tables
        return None


def latest_version(checkpoints: Path) -> int:
    info = CheckpointStore(checkpoints).latest()
    return 0 if info is None else info.version


def run_services(
    services: list[Service],
    env: dict[str, str],
    db: Path,
    checkpoints: Path,
    groups_per_step: int,
    probe: OverlapProbe | None = None,
) -> dict[str, Any]:
    for service in services:
        service.start(env)
        console.print(f"started {service.name} (pid {service.process.pid}, log {service.log})")
    scheduler = services[-1]
    started = time.monotonic()
    with Live(progress_table(None, 0, started), console=console, refresh_per_second=2) as live:
        while scheduler.alive():
            for service in services:
                if not service.alive():
                    raise RuntimeError(
                        f"{service.name} exited unexpectedly "
                        f"(code {service.process.returncode}):\n{service.tail()}"
                    )
            live.update(progress_table(read_snapshot(db), latest_version(checkpoints), started))
            if probe is not None:  # the scheduler exits when done: keep its latest figure
                probe.poll()
            time.sleep(1.0)
        live.update(progress_table(read_snapshot(db), latest_version(checkpoints), started))
    if scheduler.process.returncode != 0:
        raise RuntimeError(
            f"scheduler failed (code {scheduler.process.returncode}):\n{scheduler.tail()}"
        )
    data = read_snapshot(db)
    assert data is not None
    wait_for_learner(services[1], checkpoints, data, groups_per_step)
    if probe is not None:  # every figure complete, before the services stop
        probe.finish()
    return data


def groups_trained(checkpoints: Path) -> int:
    info = CheckpointStore(checkpoints).latest()
    return 0 if info is None else int(info.metrics.get("groups_trained", 0))


def wait_for_learner(
    learner: Service,
    checkpoints: Path,
    data: dict[str, Any],
    groups_per_step: int,
    timeout_s: float = 600.0,
) -> None:
    """Let the learner take the steps the finished groups fill (a remainder smaller than a
    step stays queued for a resumed run)."""
    sent = sum(it["batches_sent"] for it in data["iterations"])
    target = sent - sent % groups_per_step
    deadline = time.monotonic() + timeout_s
    with console.status(f"learner: training on the last groups ({target} in all)"):
        while groups_trained(checkpoints) < target and time.monotonic() < deadline:
            if not learner.alive():
                raise RuntimeError(f"learner exited unexpectedly:\n{learner.tail()}")
            time.sleep(1.0)


def write_report(
    run_dir: Path,
    data: dict[str, Any],
    db: Path,
    checkpoints: Path,
    corpus_best: dict[str, Any] | None,
    overlap: dict[str, Any] | None = None,
    references: dict[str, dict[str, Any]] | None = None,
) -> None:
    """``references``: each task's reference timed in this run, in a run of several tasks
    (None in a run of one, whose reference is ``corpus_best``'s OpenBLAS dgemm)."""
    import demo_plots  # beside this script; imports matplotlib

    run_dir.mkdir(parents=True, exist_ok=True)
    export(Store(db), run_dir / "kernels")
    versions = CheckpointStore(checkpoints).versions()
    learner = {
        "steps": len(versions),
        "policy_version": versions[-1].version if versions else 0,
        "sampler_kl": sampler_kl_summary(versions),
        "versions": [{"version": v.version, **v.metrics} for v in versions],
    }
    evaluation = read_evaluation(run_dir)
    summary = {
        "scheduler": data,
        "learner": learner,
        "corpus_best": corpus_best,
        "evaluation": evaluation_summary(evaluation),
        "overlap": overlap,
    }
    rows = None
    if references is not None:
        rows = task_rows(run_dir, data, references)
        summary["tasks"] = rows
    (run_dir / "metrics.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    its = iteration_rows(data)
    write_iterations_csv(run_dir / "iterations.csv", data)
    demo_plots.reward_curve(its, run_dir / "reward_curve.png")
    demo_plots.learner_health(learner["versions"], run_dir / "learner.png")
    if rows is not None:
        # Stages of different tasks are different pools: a best-GFLOPS plot per task.
        for row in rows:
            demo_plots.best_gflops(
                demo_tasks.task_iterations(data, row["task"]),
                row.get("corpus_best"),
                run_dir / f"best_gflops-{demo_tasks.task_name(row['task'])}.png",
                reference_line=demo_tasks.reference_line(row),
                title=f"{row['task']}: best GFLOPS per iteration",
            )
        print_task_rows(rows)
        for key in data["tasks"]:
            print_iterations(
                demo_tasks.task_iterations(data, key),
                f"SQD iterations: {demo_tasks.task_name(key)}",
            )
        # The run's best across tasks compares GFLOPS of different kernels: left out.
        print_learner_and_best({**data, "best": None}, learner, None)
        print_overlap(console, overlap)
        print_learner_health(learner["versions"])
        return
    demo_plots.best_gflops(data["iterations"], corpus_best, run_dir / "best_gflops.png")
    print_headline(evaluation, data, corpus_best)
    print_summary(data, learner, corpus_best)
    print_overlap(console, overlap)
    print_evaluation(evaluation, learner["sampler_kl"])
    print_learner_health(learner["versions"])


def task_rows(
    run_dir: Path, data: dict[str, Any], references: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """A summary row per task (``demo_tasks.task_row``) from the run's snapshot, each
    task's evaluation file and its reference timed in this run."""
    from hpcrl_benchmarker import harnesses
    from hpcrl_common.task import load_task

    rows = []
    for key in data.get("tasks") or []:
        task = load_task(key)
        evaluation_path, _ = demo_tasks.evaluation_files(run_dir, task.name)
        evaluation = read_evaluation_file(evaluation_path)
        best = (data.get("by_task") or {}).get(key, {}).get("best")
        reference = references.get(key) or {}
        row = demo_tasks.task_row(
            key,
            best,
            evaluation,
            reference.get("reference"),
            harnesses.for_task(task).bytes_moved(task.sizes.reward),
        )
        row["corpus_best"] = reference.get("corpus_best")
        rows.append(row)
    return rows


def print_task_rows(rows: list[dict[str, Any]]) -> None:
    """The headline of a run of several tasks: a row per task."""
    table = Table(title="Per task: fixed evaluation set v0 -> final, best kernel vs reference")
    for column in demo_tasks.ROW_COLUMNS:
        table.add_column(column)
    for row in rows:
        table.add_row(*demo_tasks.row_cells(row))
    console.print(table)


def write_iterations_csv(path: Path, data: dict[str, Any]) -> None:
    """A row per iteration; in a run of several tasks a row per task and iteration, with a
    ``task`` column (stages of different tasks are different pools)."""
    tasks = data.get("tasks") or []
    if len(tasks) > 1:
        its = [
            {"task": demo_tasks.task_name(key), **row}
            for key in tasks
            for row in iteration_rows({"iterations": demo_tasks.task_iterations(data, key)})
        ]
    else:
        its = iteration_rows(data)
    columns = list(dict.fromkeys(key for row in its for key in row)) or ["iteration"]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(its)


def iteration_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for it in data["iterations"]:
        bests = [s["best_gflops"] for s in it["pool"].values() if s["best_gflops"] is not None]
        outcomes: dict[str, int] = {}
        for stage in it["pool"].values():
            for status, share in stage["status_share"].items():
                outcomes[status] = outcomes.get(status, 0) + round(share * stage["count"])
        rows.append(
            {
                "iteration": it["iteration"],
                "groups": it["groups"],
                "reward_mean": it["reward_mean"],
                "reward_max": it["reward_max"],
                "best_gflops": max(bests) if bests else None,
                **{f"stage{s}_best_gflops": v["best_gflops"] for s, v in it["pool"].items()},
                **{f"stage{s}_median_gflops": v["median_gflops"] for s, v in it["pool"].items()},
                **{f"n_{k}": v for k, v in sorted(outcomes.items())},
            }
        )
    return rows


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_summary(
    data: dict[str, Any], learner: dict[str, Any], corpus_best: dict[str, Any] | None
) -> None:
    print_iterations(data["iterations"], "SQD iterations")
    print_learner_and_best(data, learner, corpus_best)


def print_iterations(iterations: list[dict[str, Any]], title: str) -> None:
    table = Table(title=title)
    for column in ("t", "stage: best / median GFLOPS", "reward mean", "reward max", "outcomes"):
        table.add_column(column)
    for row, it in zip(iteration_rows({"iterations": iterations}), iterations, strict=True):
        stages = "\n".join(
            f"{s}: {_num(v['best_gflops'])} / {_num(v['median_gflops'])}"
            for s, v in it["pool"].items()
        )
        outcomes = ", ".join(f"{k[2:]} {v}" for k, v in row.items() if k.startswith("n_"))
        table.add_row(
            str(it["iteration"]), stages, _num(it["reward_mean"]), _num(it["reward_max"]), outcomes
        )
    console.print(table)


def print_learner_and_best(
    data: dict[str, Any], learner: dict[str, Any], corpus_best: dict[str, Any] | None
) -> None:
    console.print(f"learner: {learner['steps']} steps, policy version {learner['policy_version']}")
    best = data["best"]
    if best is not None:
        console.print(
            f"best kernel of the run: {best['gflops']:.2f} GFLOPS (stage "
            f"{best['stage']}, iteration {best['iteration']})"
        )
    corpus_best = corpus_best or {}
    if "gflops" in corpus_best:
        console.print(
            f"best kernel of the policy's measured catalogue, same benchmarker: "
            f"{corpus_best['gflops']:.2f} GFLOPS (stage {corpus_best['stage']})"
        )
    blas, again = corpus_best.get("openblas"), corpus_best.get("run")
    if blas:
        console.print(
            f"OpenBLAS dgemm ({blas.get('core', '?')} kernels), same machine, same run: "
            f"{blas['gflops']:.2f} GFLOPS (median of {blas.get('rounds', 1)} rounds)"
        )
    if again:
        parts = [
            f"the run's fastest kernels timed again beside them: best {again['gflops']:.2f} "
            f"GFLOPS (stage {again['stage']}; {again['in_run']:.2f} as the run timed it)"
        ]
        if blas:
            parts.append(f"{again['gflops'] / blas['gflops']:.1%} of OpenBLAS")
        if "gflops" in corpus_best:
            parts.append(f"{again['gflops'] / corpus_best['gflops']:.0%} of the catalogue's best")
        console.print("; ".join(parts))


def print_headline(
    evaluation: dict[str, Any] | None, data: dict[str, Any], corpus_best: dict[str, Any] | None
) -> None:
    """What the run is for, in two lines: v0 -> final on the fixed set with CIs, and the
    best kernel against OpenBLAS timed in the same run."""
    comparison = (evaluation or {}).get("comparison")
    if comparison is not None:
        parts = []
        for name in ("share_correct", "mean_gflops"):
            g = comparison["metrics"][name]
            parts.append(
                f"{evaluation['metric_labels'][name]} {g['before']:.3g} -> "
                f"{g['after']:.3g} ({g['gain']:+.3g}, 95 % CI [{g['low']:+.3g}, "
                f"{g['high']:+.3g}])"
            )
        console.print(
            f"[bold]v{comparison['before']} -> v{comparison['after']}:[/] " + "; ".join(parts)
        )
        print_gain_held(evaluation)
    again = (corpus_best or {}).get("run")
    best = again or data.get("best")
    blas = (corpus_best or {}).get("openblas")
    if best is not None and blas:
        how = (
            f"both timed again side by side after the run (medians of "
            f"{blas.get('rounds', 1)} interleaved rounds)"
            if again
            else "the kernel as the run timed it"
        )
        console.print(
            f"[bold]best kernel:[/] {best['gflops']:.1f} GFLOPS (stage "
            f"{best['stage']}) = {best['gflops'] / blas['gflops']:.0%} of OpenBLAS "
            f"dgemm ({blas['gflops']:.1f} GFLOPS), {how}"
        )


def gain_text(gain: dict[str, float]) -> str:
    return f"{gain['gain']:+.3g} [{gain['low']:+.3g}, {gain['high']:+.3g}]"


def print_gain_held(evaluation: dict[str, Any]) -> None:
    """Did the final version keep the gain of the version after HELD_AFTER iterations, and
    did any prompt of the fixed set lose share correct (its 95 % CI below 0)?"""
    comparisons = evaluation.get("comparisons") or []
    final = comparisons[-1] if comparisons else evaluation["comparison"]
    if len(comparisons) > 1:
        middle = comparisons[0]
        cells = []
        for name in ("share_correct", "mean_gflops"):
            early, late = middle["metrics"][name], final["metrics"][name]
            verdict = "kept" if late["gain"] >= early["gain"] else "[yellow]not kept[/]"
            cells.append(
                f"{evaluation['metric_labels'][name]} {gain_text(early)} -> "
                f"{gain_text(late)} {verdict}"
            )
        console.print(
            f"gain after {HELD_AFTER} iterations (v{middle['after']}) -> final "
            f"(v{final['after']}): " + "; ".join(cells)
        )
    lost = [p["name"] for p in final["per_prompt"] if p["metrics"]["share_correct"]["high"] < 0]
    console.print(
        "prompts that lost share correct (95 % CI below 0): "
        + (", ".join(lost) if lost else "none")
    )


def print_learner_health(versions: list[dict[str, Any]]) -> None:
    """The last step's optimisation figures beside their range over the run."""
    cells = []
    keys = (
        "entropy",
        "kl",
        "clip_fraction",
        "grad_norm",
        "zero_variance_fraction",
        "replay_nll",
        "taught_nll",
    )
    for key in keys:
        values = [
            v[key] for v in versions if isinstance(v.get(key), int | float) and v[key] == v[key]
        ]  # not NaN
        if values:
            cells.append(f"{key} {values[-1]:.3g} (range {min(values):.3g}-{max(values):.3g})")
    if cells:
        console.print("learner, last step: " + "; ".join(cells) + " (learner.png)")


# --- the fixed evaluation set (hpcrl-evaluate): did this run's training help? ------------

EVAL_ROWS = ("share_correct", "mean_reward", "mean_gflops", "best_gflops")
# The gain a run shows after this many iterations (the length of the old demo, past which
# runs used to lose it) is evaluated too, to show whether the final version kept it.
HELD_AFTER = 4


def run_evaluation(
    args: argparse.Namespace,
    config: SchedulerConfig,
    model_dir: Path,
    backend: str,
    checkpoints: Path,
    run_dir: Path,
) -> bool:
    """Version 0, the version after HELD_AFTER iterations and the final version on the fixed
    evaluation set, same sampling seeds, with the generator backend the services used; run
    after they stopped, so timings have the CPU. Writes evaluation.json and evaluation.png
    (a run of several tasks: ``evaluation-<task>.json``/``.png``, one task after the other,
    each with the whole CPU); False if an evaluation failed."""
    keys = demo_tasks.task_keys(config.experiment)
    if len(keys) == 1:
        outputs = (run_dir / "evaluation.json", run_dir / "evaluation.png")
        plan = [(None, outputs, "evaluate.log", "")]
    else:
        names = [demo_tasks.task_name(key) for key in keys]
        plan = [
            (key, demo_tasks.evaluation_files(run_dir, name), f"evaluate-{name}.log", name)
            for key, name in zip(keys, names, strict=True)
        ]
    results = []
    for key, outputs, log_name, label in plan:
        for path in outputs:
            path.unlink(missing_ok=True)  # never report another run's figures
        if args.no_eval:
            continue
        argv = evaluation_command(args, config, model_dir, backend, checkpoints, key, outputs)
        results.append(evaluate(argv, run_dir / "logs" / log_name, args.eval_samples, label))
    return all(results)


def evaluate(argv: list[str], log: Path, samples: int, task: str) -> bool:
    """Run ``hpcrl-evaluate``; False (said) if it failed or was interrupted."""
    log.parent.mkdir(parents=True, exist_ok=True)
    console.print(
        f"[bold]evaluation{f' of {task}' if task else ''}:[/] version 0 and the final "
        f"version on the fixed set, {samples} samples per prompt (log {log})"
    )
    try:
        with log.open("w") as handle:  # the table goes to the log; progress shows on stderr
            done = subprocess.run(argv, stdout=handle, cwd=ROOT)
    except KeyboardInterrupt:
        console.print("[yellow]evaluation interrupted:[/] the report has no evaluation")
        return False
    if done.returncode != 0:
        console.print(f"[red]error:[/] the evaluation failed (exit {done.returncode}); see {log}")
        return False
    return True


def evaluation_command(
    args: argparse.Namespace,
    config: SchedulerConfig,
    model_dir: Path,
    backend: str,
    checkpoints: Path,
    task: str | None,
    outputs: tuple[Path, Path],
) -> list[str]:
    """``task``: one task of a run of several (None: the experiment's task); ``outputs``:
    its evaluation's JSON and plot."""
    from hpcrl_generator.config import GeneratorConfig

    generator = load_config(GeneratorConfig, args.config).generator
    exp, sampling = config.experiment, config.scheduler
    # Only version 0 when the learner took no step: there is no final version to compare.
    latest = CheckpointStore(checkpoints).latest()
    middle = version_after_iterations((ROOT / config.db_path).resolve(), checkpoints, HELD_AFTER)
    kept = (
        [] if middle is None or latest is None or not 0 < middle < latest.version else [str(middle)]
    )
    versions = (
        ["--checkpoints", str(checkpoints), "--versions", ",".join(["0", *kept, "latest"])]
        if latest is not None
        else []
    )
    return [
        str(BIN / "hpcrl-evaluate"),
        "--model",
        str(model_dir),
        *versions,
        "--samples",
        str(args.eval_samples),
        "--seed",
        str(exp.seed),
        "--temperature",
        repr(sampling.temperature),
        "--top-p",
        repr(sampling.top_p),
        "--max-tokens",
        str(sampling.max_tokens),
        "--backend",
        backend,
        "--opt-level",
        exp.opt_level,
        "--task",
        str(task or exp.task),
        "--dtype",
        generator.dtype,
        "--max-model-len",
        str(generator.max_model_len),
        "--kv-cache-gib",
        str(generator.kv_cache_space_gib),
        "--json",
        str(outputs[0]),
        "--plot",
        str(outputs[1]),
    ]


def version_after_iterations(db: Path, checkpoints: Path, iterations: int) -> int | None:
    """The newest policy version committed by the time the run's first ``iterations``
    iterations had all closed; None if the run was not longer than that."""
    if not db.exists():
        return None
    store = Store(db)
    closed = [g.closed_at for g in store.groups_of_iteration(iterations - 1)]
    if not closed or None in closed or not store.groups_of_iteration(iterations):
        return None
    cutoff = max(c for c in closed if c is not None)
    committed = [
        v.version for v in CheckpointStore(checkpoints).versions() if v.created_at <= cutoff
    ]
    return max(committed, default=None)


def read_evaluation(run_dir: Path) -> dict[str, Any] | None:
    return read_evaluation_file(run_dir / "evaluation.json")


def read_evaluation_file(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def evaluation_summary(evaluation: dict[str, Any] | None) -> dict[str, Any] | None:
    """What metrics.json keeps of the evaluation (evaluation.json has every sample)."""
    if evaluation is None:
        return None
    comparison = evaluation.get("comparison")
    return {
        "prompts": len(evaluation["prompts"]),
        "samples_per_prompt": evaluation["sampling"]["samples"],
        "versions": {str(v["version"]): v["metrics"] for v in evaluation["versions"]},
        "gains": None if comparison is None else comparison["metrics"],
    }


def sampler_kl_summary(versions: list[Any]) -> dict[str, Any] | None:
    """The learner's k3 KL of the sampling policy against its recomputed log-probs, per step
    (checkpoint manifest): large values mean the samples were not the policy's own."""
    values = [v.metrics["sampler_kl"] for v in versions if "sampler_kl" in v.metrics]
    if not values:
        return None
    # On samples of the trainer's own current weights: sampler and trainer must agree there.
    fresh = [v.metrics["sampler_kl_fresh"] for v in versions if "sampler_kl_fresh" in v.metrics]
    return {
        "last": values[-1],
        "max": max(values),
        "steps": len(values),
        "last_steps": values[-5:],
        "fresh_max": max(fresh) if fresh else None,
        "fresh_steps": len(fresh),
    }


def print_evaluation(evaluation: dict[str, Any] | None, kl: dict[str, Any] | None) -> None:
    if kl is not None:
        recent = ", ".join(f"{v:.3g}" for v in kl["last_steps"])
        console.print(
            f"learner sampler KL (k3, sampling policy vs trainer): last "
            f"{kl['last']:.3g}, max {kl['max']:.3g} over {kl['steps']} steps "
            f"(last steps: {recent}; samples of an older version count too)"
        )
        if kl["fresh_max"] is not None:
            console.print(
                f"  on fresh samples only (drawn from the trainer's current weights): "
                f"max {kl['fresh_max']:.3g} over {kl['fresh_steps']} steps"
            )
    if evaluation is None:
        console.print("fixed evaluation set: not run (--no-eval, or it failed)")
        return
    versions = evaluation["versions"]
    comparison = evaluation.get("comparison")
    if comparison is None:
        console.print("fixed evaluation set: only version 0 (the learner took no step)")
        return
    first, last = versions[0], versions[-1]
    table = Table(
        title=f"Fixed evaluation set: v{first['version']} -> v{last['version']} "
        f"({len(evaluation['prompts'])} prompts x "
        f"{evaluation['sampling']['samples']} samples, same seeds)"
    )
    for column in ("metric", f"v{first['version']}", f"v{last['version']}", "gain", "95% CI"):
        table.add_column(column)
    for name in EVAL_ROWS:
        gain = comparison["metrics"][name]
        table.add_row(
            evaluation["metric_labels"][name],
            f"{gain['before']:.3g}",
            f"{gain['after']:.3g}",
            f"{gain['gain']:+.3g}",
            f"[{gain['low']:+.3g}, {gain['high']:+.3g}]",
        )
    console.print(table)
    console.print(learning_verdict(comparison, evaluation["metric_labels"]))


# What the verdict judges: the figures, each 0 for a failure. The mean reward is shown
# but not judged: its penalties weigh failure kinds unequally, so trading stage violations for
# compile errors raised it in a run that gained nothing and lost three prompts.
VERDICT_ROWS = ("share_correct", "mean_gflops")


def learning_verdict(comparison: dict[str, Any], labels: dict[str, str]) -> str:
    """One line on whether training helped on the fixed set: a figure of VERDICT_ROWS whose
    95 % CI lies above (below) 0 rose (fell); a prompt lost when its share correct fell."""
    metrics = comparison["metrics"]
    rose = [labels[n] + " " + gain_text(metrics[n]) for n in VERDICT_ROWS if metrics[n]["low"] > 0]
    fell = [labels[n] + " " + gain_text(metrics[n]) for n in VERDICT_ROWS if metrics[n]["high"] < 0]
    lost = [
        p["name"] for p in comparison["per_prompt"] if p["metrics"]["share_correct"]["high"] < 0
    ]
    lost_text = f"{len(lost)} prompt(s) lost share correct ({', '.join(lost)})"
    if fell:
        return "[red]the final policy is worse[/] on the fixed set: " + "; ".join(fell) + " fell"
    if rose and not lost:
        return (
            "[green]learning helped[/] on the fixed set: "
            + "; ".join(rose)
            + " rose, and no prompt lost share correct"
        )
    if rose:
        return "[yellow]mixed:[/] " + "; ".join(rose) + f" rose, but {lost_text}"
    unclear = " and ".join(labels[n] for n in VERDICT_ROWS)
    if lost:
        return f"[yellow]no clear gain, some loss:[/] {unclear} contain 0 in their CI; {lost_text}"
    return f"no clear change on the fixed set: the 95 % CIs of {unclear} contain 0"


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config",
        type=Path,
        default=ROOT / "deploy/local/demo.toml",
        help="experiment TOML (default: deploy/local/demo.toml)",
    )
    parser.add_argument(
        "--runs", type=Path, default=ROOT / "runs", help="where run directories go (default: runs/)"
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="discard an unfinished run of this experiment and start over",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="write the report of the finished run again; start nothing",
    )
    parser.add_argument(
        "--evaluate-only",
        action="store_true",
        help="evaluate the finished run's version 0 and final version again "
        "(e.g. with more --eval-samples), then write its report; start no "
        "service",
    )
    parser.add_argument(
        "--backend",
        choices=["auto", "vllm", "transformers"],
        default="auto",
        help="generator backend (auto: vLLM where it imports)",
    )
    parser.add_argument(
        "--policy-data-dir",
        type=Path,
        default=ROOT / "data",
        help="where the bootstrapped policy is cached, shared by experiments "
        "(default: data/, i.e. data/policy/bootstrap-<hash>/)",
    )
    parser.add_argument(
        "--bootstrap-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for `hpcrl-bootstrap` (repeatable), "
        "e.g. --bootstrap-arg=--steps=20 for a quick, weak policy",
    )
    parser.add_argument(
        "--no-eval",
        action="store_true",
        help="skip the fixed-set evaluation of version 0 and the final version "
        "at the end (evaluation.json, evaluation.png)",
    )
    parser.add_argument(
        "--eval-samples",
        type=int,
        default=16,
        metavar="K",
        help="completions per prompt and version in that evaluation (default "
        "16; with 8, the 95 %% interval of one seed's gain reached below 0)",
    )
    args = parser.parse_args(argv)
    # The services run in their own sessions (a Ctrl-C in the terminal must reach only this
    # script, which stops them in order): a `kill` of this script must stop them too.
    signal.signal(signal.SIGTERM, _interrupt)
    if args.eval_samples < 1:
        parser.error("--eval-samples must be at least 1")

    config = load_config(SchedulerConfig, args.config)
    keys = demo_tasks.task_keys(config.experiment)
    # A run of several tasks asks for a policy that writes all of them.
    bootstrap_extra = [*demo_tasks.bootstrap_args(keys), *args.bootstrap_arg]
    data_dir = (ROOT / config.experiment.data_dir).resolve()
    run_dir = (args.runs / config.experiment.name).resolve()
    db = (ROOT / config.db_path).resolve()
    checkpoints = data_dir / "checkpoints"
    previous = read_snapshot(db)
    # The services' busy counters start with their processes: a resumed run is measured
    # for this session only.
    resumed = previous is not None and not (args.fresh or previous["done"])
    if args.report_only or args.evaluate_only:
        if previous is None or not previous["done"]:
            raise SystemExit("error: no finished run of this experiment to report on")
        model_dir = bootstrap_policy(args.policy_data_dir.resolve(), bootstrap_extra)
        if args.evaluate_only and not run_evaluation(
            args, config, model_dir, resolve_backend(args.backend), checkpoints, run_dir
        ):
            return 1
        write_report(
            run_dir,
            previous,
            db,
            checkpoints,
            None if len(keys) > 1 else benchmark_corpus_best(config, model_dir, db=db),
            earlier_overlap(run_dir / "metrics.json"),
            task_references(config, model_dir, keys),
        )
        console.print(f"\n[bold]run directory:[/] {run_dir}")
        return 0
    if args.fresh or (previous is not None and previous["done"]):
        console.print("starting a fresh run" + (" (the previous one finished)" if previous else ""))
        shutil.rmtree(data_dir / "scheduler", ignore_errors=True)
        shutil.rmtree(checkpoints, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
        purge_broker(config)
    elif previous is not None:
        console.print(f"resuming the unfinished run at iteration {previous['iteration'] + 1}")

    model_dir = bootstrap_policy(args.policy_data_dir.resolve(), bootstrap_extra)
    backend = resolve_backend(args.backend)
    console.print(f"[bold]policy:[/] {model_dir}; generator backend: {backend}")
    env = {
        **os.environ,
        "HPCRL__GENERATOR__MODEL_PATH": str(model_dir),
        "HPCRL__GENERATOR__BACKEND": backend,
        "HPCRL__GENERATOR__CHECKPOINT_DIR": str(checkpoints),
        "HPCRL__LEARNER__MODEL_PATH": str(model_dir),
        "HPCRL__LEARNER__CHECKPOINT_DIR": str(checkpoints),
        "HPCRL__EXPERIMENT__DATA_DIR": str(data_dir),
        "HPCRL__SCHEDULER__ISA": "avx512" if has_avx512() else "avx2",
        # Where anchor nodes (scheduler.anchor_nodes) take their parents: this policy's
        # measured catalogue.
        "HPCRL__SCHEDULER__ANCHOR_CORPUS": os.environ.get(
            "HPCRL__SCHEDULER__ANCHOR_CORPUS", str(model_dir / "corpus.json")
        ),
    }
    # Where to scrape each service; a metrics_port of 0 becomes a free port chosen here.
    probe = OverlapProbe.for_services(args.config.resolve(), env)
    env.update(probe.env)
    services = service_commands(args.config.resolve(), run_dir)
    try:
        learner_config = load_config(LearnerConfig, args.config)
        data = run_services(
            services, env, db, checkpoints, learner_config.learner.groups_per_step, probe
        )
    except KeyboardInterrupt:
        console.print(
            "\n[yellow]interrupted:[/] stopping the services; run `make demo` again to resume"
        )
        return 130
    except RuntimeError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    finally:
        for service in reversed(services):
            service.stop()
    overlap = probe.summary(data, db, checkpoints, resumed)
    corpus_best = None if len(keys) > 1 else benchmark_corpus_best(config, model_dir, db=db)
    references = task_references(config, model_dir, keys)
    evaluated = run_evaluation(args, config, model_dir, backend, checkpoints, run_dir)
    write_report(run_dir, data, db, checkpoints, corpus_best, overlap, references)
    console.print(f"\n[bold]run directory:[/] {run_dir}")
    return 0 if evaluated else 1


def task_references(
    config: SchedulerConfig, model_dir: Path, keys: list[str]
) -> dict[str, dict[str, Any]] | None:
    """In a run of several tasks, each task's reference and catalogue best, timed on this
    node now (the services stopped); None in a run of one (``benchmark_corpus_best`` has
    its reference)."""
    if len(keys) < 2:
        return None
    from hpcrl_benchmarker.config import BenchmarkerSection
    from hpcrl_benchmarker.pipeline import Benchmarker

    benchmarker = Benchmarker(BenchmarkerSection(pin_threads=False))
    console.print("[bold]references:[/] timing each task's reference on this node")
    return {
        key: {
            "reference": demo_tasks.time_reference(key, benchmarker),
            "corpus_best": benchmark_corpus_best(config, model_dir, key),
        }
        for key in keys
    }


# The run's fastest children timed again beside the catalogue's bests and OpenBLAS.
RUN_RETIMED = 4


def benchmark_corpus_best(
    config: SchedulerConfig, model_dir: Path, key: str | None = None, db: Path | None = None
) -> dict[str, Any] | None:
    """The fastest kernel of each stage of the policy's measured catalogue and, given the
    run's database ``db``, the run's RUN_RETIMED fastest children, timed again by the same
    benchmarker in this run, side by side with OpenBLAS dgemm (``hpcrl_evaluate.retime``:
    interleaved rounds, medians), so that the run's best against OpenBLAS and the catalogue
    does not depend on how fast the node was when each was first timed.
    ``key``: one task of a run of several (its catalogue rows; no OpenBLAS dgemm and no run
    children here, the task's reference is ``demo_tasks.time_reference``'s)."""
    from hpcrl_benchmarker.config import BenchmarkerSection
    from hpcrl_benchmarker.pipeline import Benchmarker
    from hpcrl_common.task import load_task
    from hpcrl_evaluate.retime import ROUNDS, Entry, benchmarker_timers, retime
    from hpcrl_scheduler.report import fastest_children

    task = load_task(key or config.experiment.task)
    path = model_dir / "corpus.json"
    # A catalogue row without a task is of the GEMM catalogue (before several tasks).
    rows = (
        [
            row
            for row in json.loads(path.read_text())
            if row["status"] == "success"
            and (key is None or row.get("task", "matmul") == task.name)
        ]
        if path.is_file()
        else []
    )
    catalogue = [
        Entry(f"stage {top['stage']}", top["source"], top["stage"], top["gflops"])
        for top in (
            max((r for r in rows if r["stage"] == number), key=lambda r: r["gflops"])
            for number in sorted({r["stage"] for r in rows})
        )
    ]
    run: list[Entry] = []
    if key is None and db is not None and db.is_file():
        store = Store(db, read_only=True)
        try:
            run = [
                Entry("run", p.source or "", p.stage, p.gflops or 0.0)
                for p in fastest_children(store, RUN_RETIMED)
            ]
        finally:
            store.close()
    if not catalogue and not run:
        return None
    benchmarker = Benchmarker(BenchmarkerSection(pin_threads=False))
    time_entry, _ = benchmarker_timers(task, config.experiment.opt_level, benchmarker)
    blas: dict[str, Any] = {}

    def time_blas() -> float | None:
        if key is not None or blas.get("unavailable"):
            return None
        timed = openblas_gflops(benchmarker, task)
        if timed is None:
            blas["unavailable"] = True
            return None
        blas.update(timed)
        return timed["gflops"]

    console.print(
        f"timing again, side by side: the catalogue's best of each stage, the run's "
        f"{len(run)} fastest kernels and OpenBLAS dgemm ({ROUNDS} interleaved rounds)"
    )
    retimed = retime([run, catalogue], time_entry, time_blas, ROUNDS)
    per_stage = {
        str(entry.stage): retimed.best[entry.group]
        for entry in catalogue
        if retimed.best[entry.group] is not None
    }
    best: dict[str, Any] = {}
    if per_stage:
        stage = max(per_stage, key=lambda s: per_stage[s])
        best = {"gflops": per_stage[stage], "stage": int(stage), "per_stage": per_stage}
    fastest = retimed.fastest("run")
    if fastest is not None:
        best["run"] = {
            "gflops": retimed.medians[fastest],
            "stage": fastest.stage,
            "in_run": fastest.gflops,
        }
    if retimed.reference is not None:
        best["openblas"] = {**blas, "gflops": retimed.reference, "rounds": ROUNDS}
    return best or None


def openblas_gflops(benchmarker: Any, task: Any) -> dict[str, Any] | None:
    """The task's OpenBLAS routine (dgemm for matmul) at the reward size on this machine,
    now, as the benchmarker times it (``demo_tasks.reference_of``); None, said, where it
    cannot be timed."""
    reference = demo_tasks.reference_of(task, benchmarker)
    if reference["kind"] != "openblas":
        console.print(f"[yellow]OpenBLAS reference not timed:[/] {reference.get('why', '')}")
        return None
    return {name: reference[name] for name in ("gflops", "threads", "core")}


if __name__ == "__main__":
    sys.exit(main())
