"""`make demo`: the whole system on one machine, over the real broker, with a report.

Bootstraps the embedded policy if it is missing, starts the four services as separate
processes (the generator on vLLM's CPU build where it imports, else on transformers), runs the
SQD experiment of ``deploy/local/demo.toml``, shows progress, stops the services cleanly and
writes a run directory: best kernels, metrics as JSON/CSV, plots, and a summary table.
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

import pika
from rich.console import Console
from rich.live import Live
from rich.table import Table

from hpcrl_common.checkpoints import CheckpointStore
from hpcrl_common.config import load_config
from hpcrl_common.topology import WEIGHT_UPDATES, Topology
from hpcrl_learner.config import LearnerConfig
from hpcrl_scheduler.config import SchedulerConfig
from hpcrl_scheduler.report import export, snapshot
from hpcrl_scheduler.service import SUBSCRIBER as SCHEDULER_SUBSCRIBER
from hpcrl_scheduler.store import Store

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SERVICES = ("benchmarker", "learner", "generator", "scheduler")
console = Console()


def host_has_avx512() -> bool:
    return "avx512f" in Path("/proc/cpuinfo").read_text().split()


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
        self.process = subprocess.Popen(self.argv, env=env, stdout=self.handle,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        cwd=ROOT)

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


def bootstrap_policy(data_dir: Path, extra: list[str]) -> Path:
    console.print("[bold]policy:[/] checking the embedded model (built once, then cached)")
    out = subprocess.run(
        [str(BIN / "hpcrl-learner"), "bootstrap-model", "--data-dir", str(data_dir), *extra],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
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
    allow = [] if host_has_avx512() else ["--allow-isa", "avx2"]
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
        table.add_row("groups done", f"{current['closed']} of {current['groups']} "
                                     f"({current['in_flight']} in flight)")
    table.add_row("best GFLOPS", "-" if best is None else
                  f"{best['gflops']:.2f} (stage {best['stage']}, iteration {best['iteration']})")
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


def run_services(services: list[Service], env: dict[str, str], db: Path,
                 checkpoints: Path, groups_per_step: int) -> dict[str, Any]:
    for service in services:
        service.start(env)
        console.print(f"started {service.name} (pid {service.process.pid}, log {service.log})")
    scheduler = services[-1]
    started = time.monotonic()
    with Live(progress_table(None, 0, started), console=console, refresh_per_second=2) as live:
        while scheduler.alive():
            for service in services:
                if not service.alive():
                    raise RuntimeError(f"{service.name} exited unexpectedly "
                                       f"(code {service.process.returncode}):\n{service.tail()}")
            live.update(progress_table(read_snapshot(db), latest_version(checkpoints), started))
            time.sleep(1.0)
        live.update(progress_table(read_snapshot(db), latest_version(checkpoints), started))
    if scheduler.process.returncode != 0:
        raise RuntimeError(f"scheduler failed (code {scheduler.process.returncode}):\n"
                           f"{scheduler.tail()}")
    data = read_snapshot(db)
    assert data is not None
    wait_for_learner(services[1], checkpoints, data, groups_per_step)
    return data


def groups_trained(checkpoints: Path) -> int:
    info = CheckpointStore(checkpoints).latest()
    return 0 if info is None else int(info.metrics.get("groups_trained", 0))


def wait_for_learner(learner: Service, checkpoints: Path, data: dict[str, Any],
                     groups_per_step: int, timeout_s: float = 600.0) -> None:
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


def write_report(run_dir: Path, data: dict[str, Any], db: Path, checkpoints: Path,
                 corpus_best: dict[str, Any] | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir.mkdir(parents=True, exist_ok=True)
    export(Store(db), run_dir / "kernels")
    versions = CheckpointStore(checkpoints).versions()
    learner = {"steps": len(versions), "policy_version": versions[-1].version if versions else 0,
               "versions": [{"version": v.version, **v.metrics} for v in versions]}
    summary = {"scheduler": data, "learner": learner, "corpus_best": corpus_best}
    (run_dir / "metrics.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    rows = iteration_rows(data)
    columns = list(dict.fromkeys(key for row in rows for key in row)) or ["iteration"]
    with (run_dir / "iterations.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
    its = [r["iteration"] for r in rows]
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(its, [r["reward_mean"] for r in rows], marker="o", label="mean reward")
    axis.plot(its, [r["reward_max"] for r in rows], marker="s", label="max reward")
    axis.set(xlabel="iteration", ylabel="reward", title="Reward per iteration")
    axis.legend()
    figure.tight_layout()
    figure.savefig(run_dir / "reward_curve.png", dpi=120)
    figure, axis = plt.subplots(figsize=(6, 4))
    stages = sorted({int(s) for it in data["iterations"] for s in it["pool"]})
    for stage in stages:
        axis.plot(its, [it["pool"].get(str(stage), {}).get("best_gflops")
                        for it in data["iterations"]], marker="o", label=f"stage {stage}")
    axis.set(xlabel="iteration", ylabel="best GFLOPS", title="Best GFLOPS per iteration")
    if stages:
        axis.legend()
    figure.tight_layout()
    figure.savefig(run_dir / "best_gflops.png", dpi=120)
    plt.close("all")
    print_summary(data, learner, corpus_best)


def iteration_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for it in data["iterations"]:
        bests = [s["best_gflops"] for s in it["pool"].values() if s["best_gflops"] is not None]
        outcomes: dict[str, int] = {}
        for stage in it["pool"].values():
            for status, share in stage["status_share"].items():
                outcomes[status] = outcomes.get(status, 0) + round(share * stage["count"])
        rows.append({
            "iteration": it["iteration"], "groups": it["groups"],
            "reward_mean": it["reward_mean"], "reward_max": it["reward_max"],
            "best_gflops": max(bests) if bests else None,
            **{f"stage{s}_best_gflops": v["best_gflops"] for s, v in it["pool"].items()},
            **{f"stage{s}_median_gflops": v["median_gflops"] for s, v in it["pool"].items()},
            **{f"n_{k}": v for k, v in sorted(outcomes.items())},
        })
    return rows


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_summary(data: dict[str, Any], learner: dict[str, Any],
                  corpus_best: dict[str, Any] | None) -> None:
    table = Table(title="SQD iterations")
    for column in ("t", "stage: best / median GFLOPS", "reward mean", "reward max", "outcomes"):
        table.add_column(column)
    for row, it in zip(iteration_rows(data), data["iterations"], strict=True):
        stages = "\n".join(f"{s}: {_num(v['best_gflops'])} / {_num(v['median_gflops'])}"
                           for s, v in it["pool"].items())
        outcomes = ", ".join(f"{k[2:]} {v}" for k, v in row.items() if k.startswith("n_"))
        table.add_row(str(it["iteration"]), stages, _num(it["reward_mean"]),
                      _num(it["reward_max"]), outcomes)
    console.print(table)
    console.print(f"learner: {learner['steps']} steps, policy version {learner['policy_version']}")
    best = data["best"]
    if best is not None:
        console.print(f"best kernel of the run: {best['gflops']:.2f} GFLOPS (stage "
                      f"{best['stage']}, iteration {best['iteration']})")
    if corpus_best is not None:
        console.print(f"best kernel of the bootstrap corpus, same benchmarker: "
                      f"{corpus_best['gflops']:.2f} GFLOPS (stage {corpus_best['stage']})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "deploy/local/demo.toml",
                        help="experiment TOML (default: deploy/local/demo.toml)")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs",
                        help="where run directories go (default: runs/)")
    parser.add_argument("--fresh", action="store_true",
                        help="discard an unfinished run of this experiment and start over")
    parser.add_argument("--report-only", action="store_true",
                        help="write the report of the finished run again; start nothing")
    parser.add_argument("--backend", choices=["auto", "vllm", "transformers"], default="auto",
                        help="generator backend (auto: vLLM where it imports)")
    parser.add_argument("--policy-data-dir", type=Path, default=ROOT / "data",
                        help="where the bootstrapped policy is cached, shared by experiments "
                        "(default: data/, i.e. data/policy/bootstrap-<hash>/)")
    parser.add_argument("--bootstrap-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for `hpcrl-learner bootstrap-model` (repeatable), "
                        "e.g. --bootstrap-arg=--steps=20 for a quick, weak policy")
    args = parser.parse_args(argv)

    config = load_config(SchedulerConfig, args.config)
    data_dir = (ROOT / config.experiment.data_dir).resolve()
    run_dir = (args.runs / config.experiment.name).resolve()
    db = (ROOT / config.db_path).resolve()
    checkpoints = data_dir / "checkpoints"
    previous = read_snapshot(db)
    if args.report_only:
        if previous is None or not previous["done"]:
            raise SystemExit("error: no finished run of this experiment to report on")
        write_report(run_dir, previous, db, checkpoints, benchmark_corpus_best(config))
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

    model_dir = bootstrap_policy(args.policy_data_dir.resolve(), args.bootstrap_arg)
    backend = args.backend
    if backend == "auto":
        backend = "vllm" if vllm_importable() else "transformers"
    console.print(f"[bold]policy:[/] {model_dir}; generator backend: {backend}")
    env = {
        **os.environ,
        "HPCRL__GENERATOR__MODEL_PATH": str(model_dir),
        "HPCRL__GENERATOR__BACKEND": backend,
        "HPCRL__GENERATOR__CHECKPOINT_DIR": str(checkpoints),
        "HPCRL__LEARNER__MODEL_PATH": str(model_dir),
        "HPCRL__LEARNER__CHECKPOINT_DIR": str(checkpoints),
        "HPCRL__EXPERIMENT__DATA_DIR": str(data_dir),
        "HPCRL__SCHEDULER__ISA": "avx512" if host_has_avx512() else "avx2",
    }
    services = service_commands(args.config.resolve(), run_dir)
    try:
        learner_config = load_config(LearnerConfig, args.config)
        data = run_services(services, env, db, checkpoints,
                            learner_config.learner.groups_per_step)
    except KeyboardInterrupt:
        console.print("\n[yellow]interrupted:[/] stopping the services; run `make demo` again "
                      "to resume")
        return 130
    except RuntimeError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    finally:
        for service in reversed(services):
            service.stop()
    corpus_best = benchmark_corpus_best(config)
    write_report(run_dir, data, db, checkpoints, corpus_best)
    console.print(f"\n[bold]run directory:[/] {run_dir}")
    return 0


def benchmark_corpus_best(config: SchedulerConfig) -> dict[str, Any] | None:
    """The best kernels of the bootstrap corpus, timed by the same benchmarker."""
    from hpcrl_benchmarker.pipeline import evaluate
    from hpcrl_common.task import load_task
    from hpcrl_learner.bootstrap.corpus import best_kernels

    task = load_task(config.experiment.task)
    isa = "avx512" if host_has_avx512() else "avx2"
    best = None
    for kernel in best_kernels(seed=config.experiment.seed, per_stage=1, isa=isa):
        verdict = evaluate(kernel.source, stage=6, opt_level=config.experiment.opt_level,
                           task=task)
        if verdict.status == "success" and (best is None or verdict.gflops > best["gflops"]):
            best = {"gflops": verdict.gflops, "stage": kernel.stage}
    return best


if __name__ == "__main__":
    sys.exit(main())
