"""Build the embedded policy (a small Qwen2 code model trained on CPU on a generated corpus
of matrix-multiply kernels) unless it is cached, showing progress on stderr; print the model
directory as the last line of stdout. Also: python -m hpcrl_bootstrap."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from hpcrl_bootstrap.build import (
    BootstrapSettings,
    default_dir,
    ensure_model,
    host_isa,
    is_ready,
)
from hpcrl_bootstrap.motifs import TASKS
from hpcrl_common.config import ServiceConfig
from hpcrl_common.logs import configure_logging
from hpcrl_common.replay import REPLAY_FILE
from hpcrl_common.service import add_config_argument, load_or_exit

_DEFAULTS = BootstrapSettings()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_argument(parser)
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="data directory (default: experiment.data_dir of the config); the "
        "model goes to <data-dir>/policy/bootstrap-<hash of the settings>/",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="model directory to use instead of the hashed one under --data-dir",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=_DEFAULTS.steps,
        help=f"training steps (default {_DEFAULTS.steps})",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=_DEFAULTS.batch_size,
        help=f"examples per step (default {_DEFAULTS.batch_size})",
    )
    parser.add_argument(
        "--examples",
        type=int,
        default=_DEFAULTS.examples,
        help=f"distinct training examples generated (default {_DEFAULTS.examples})",
    )
    parser.add_argument(
        "--tasks",
        type=parse_tasks,
        default=None,
        metavar="TASK,TASK,...",
        help="the tasks the one policy learns to write, comma-separated, of "
        + ", ".join(TASKS)
        + " (default: the config's experiment tasks, matmul alone for the default config); "
        "--examples is shared evenly between them",
    )
    parser.add_argument(
        "--kernels-per-stage",
        type=_per_stage,
        default=_DEFAULTS.kernels_per_stage,
        metavar="N,N,N,N,N,N",
        help="distinct correct kernels of stages 1-6 in the measured catalogue "
        "(default " + ",".join(map(str, _DEFAULTS.kernels_per_stage)) + ")",
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=_DEFAULTS.learning_rate,
        help=f"peak learning rate (default {_DEFAULTS.learning_rate:g})",
    )
    parser.add_argument(
        "--isa",
        choices=("auto", "avx2", "avx512"),
        default=_DEFAULTS.isa,
        help="the ISA the corpus, the catalogue and the prompts target (default auto: this "
        "host's, avx512 where it has AVX-512F, else avx2); avx2 on an AVX-512 host builds the "
        "policy of an AVX2 fleet; avx512 needs a host with AVX-512F (the catalogue runs its "
        "kernels)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=_DEFAULTS.seed,
        help=f"seed of the corpus, the examples and the initial weights (default {_DEFAULTS.seed})",
    )
    parser.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default=_DEFAULTS.precision,
        help="auto: bfloat16 autocast where the CPU has avx512_bf16/amx_bf16",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: all cores)"
    )
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if a finished model is cached"
    )
    parser.add_argument(
        "--evaluate",
        type=int,
        default=0,
        metavar="N",
        help="afterwards, sample N kernels for each of seed and improve prompts "
        "at stages 1 and 2, judge them with the benchmarker's pipeline and report "
        "the share correct and their speeds (default 0: skip)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="sampling temperature of --evaluate (default 0.8)",
    )


def _per_stage(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected six counts like 16,16,12,8,6,6, got {text!r}"
        ) from None
    if len(counts) != 6 or min(counts) < 0 or counts[0] < 1:
        raise argparse.ArgumentTypeError(
            f"expected six counts >= 0 (stage 1 at least 1), got {text!r}"
        )
    return counts


def parse_tasks(text: str) -> tuple[str, ...]:
    """``matmul,gemv`` -> the tasks in the order of :data:`TASKS` (so that the order given
    changes nothing); an empty, repeated or unknown name is an error that says which."""
    names = [part.strip() for part in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(
            f"expected task names separated by commas (like matmul,gemv), got {text!r}"
        )
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"task {repeated[0]!r} is named twice in {text!r}")
    unknown = [n for n in names if n not in TASKS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"the bootstrap has no kernels of task {unknown[0]!r}: choose from {', '.join(TASKS)}"
        )
    return tuple(n for n in TASKS if n in names)


def settings_from_args(
    args: argparse.Namespace, task: str, tasks: tuple[str, ...] = ()
) -> BootstrapSettings:
    """``tasks`` (several) or ``task`` (one): one task is always given as ``task``, so that
    its settings, and their hash, are what a one-task build always had."""
    if len(tasks) == 1:
        task, tasks = tasks[0], ()
    return BootstrapSettings(
        seed=args.seed,
        task=task,
        isa=args.isa,
        tasks=tasks,
        examples=args.examples,
        kernels_per_stage=args.kernels_per_stage,
        steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        precision=args.precision,
    )


def run(args: argparse.Namespace) -> int:
    config = load_or_exit(ServiceConfig, getattr(args, "config", None))
    configure_logging("bootstrap", config.logging.level, config.logging.format)
    names = args.tasks
    if names is None:  # the config's tasks: checked here, as --tasks is by argparse
        try:
            names = parse_tasks(",".join(config.experiment.task_weights()))
        except argparse.ArgumentTypeError as exc:
            print(f"hpcrl-bootstrap: the config's experiment tasks: {exc}", file=sys.stderr)
            return 2
    if args.isa == "avx512" and host_isa() != "avx512":
        print(
            "hpcrl-bootstrap: --isa avx512 needs a host with AVX-512F: the catalogue runs the "
            "kernels it teaches (this host: avx2; build there with --isa auto or avx2)",
            file=sys.stderr,
        )
        return 2
    settings = settings_from_args(args, config.experiment.task, names)
    data_dir = args.data_dir if args.data_dir is not None else config.experiment.data_dir
    out = args.out if args.out is not None else default_dir(data_dir, settings)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if is_ready(out) and not args.force and (out / REPLAY_FILE).is_file():
        print(f"bootstrap model already built: {out}", file=sys.stderr)
    else:
        with _Progress() as progress:
            ensure_model(settings, out, force=args.force, progress=progress)
    if args.evaluate > 0:
        for name in settings.task_names():
            _evaluate(out, args.evaluate, args.temperature, name)
    print(os.fspath(out))
    return 0


class _Progress:
    """A rich progress display on stderr: one line per phase, a bar for training."""

    def __enter__(self) -> _Progress:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.console = Console(stderr=True)
        self.bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self.bar.__enter__()
        self.task_id: Any = None
        self.measure_id: Any = None
        self.catalogue = "benchmark catalogue"
        self.smoothed: float | None = None
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(*exc)  # type: ignore[arg-type]

    def __call__(self, phase: str, fields: dict[str, Any]) -> None:
        if phase == "catalogue":  # a bar per task's catalogue
            self.measure_id = None
            self.catalogue = f"benchmark {fields.get('task', '')} catalogue".replace("  ", " ")
        if phase == "measure":
            if self.measure_id is None:
                self.measure_id = self.bar.add_task(
                    self.catalogue, total=fields["total"], loss="-", rate=""
                )
            self.bar.update(self.measure_id, completed=fields["done"])
            if not self.console.is_terminal and fields["done"] % 50 == 0:
                self.console.print(f"benchmarked {fields['done']}/{fields['total']} kernels")
            return
        if phase == "step":
            info = fields["info"]
            self.smoothed = (
                info.loss if self.smoothed is None else (0.9 * self.smoothed + 0.1 * info.loss)
            )
            rate = f"{info.tokens / max(info.seconds, 1e-9):,.0f} tok/s"
            self.bar.update(
                self.task_id, completed=info.step, loss=f"{self.smoothed:.3f}", rate=rate
            )
            if not self.console.is_terminal and (info.step % 50 == 0 or info.step == info.steps):
                self.console.print(
                    f"step {info.step}/{info.steps} loss {self.smoothed:.3f} "
                    f"{rate} lr {info.lr:.2e} {info.seconds:.0f}s"
                )
            return
        if phase == "train":
            self.console.print(
                f"training a {fields['parameters'] / 1e6:.1f}M-parameter Qwen2 "
                f"on {fields['examples']} examples "
                f"({'bf16 autocast' if fields['bf16'] else 'fp32'})"
            )
            self.task_id = self.bar.add_task("train", total=fields["steps"], loss="-", rate="")
            return
        details = ", ".join(f"{k} {v}" for k, v in fields.items())
        self.console.print(f"{phase}: {details}")


def _evaluate(model_dir: Path, per_bucket: int, temperature: float, task: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from hpcrl_bootstrap.evaluate import evaluate

    console = Console(stderr=True)
    with console.status("sampling and benchmarking") as status:
        report = evaluate(
            model_dir,
            per_bucket=per_bucket,
            temperature=temperature,
            task_name=task,
            progress=lambda done, total: status.update(f"benchmarking sample {done}/{total}"),
        )
    table = Table(title=f"{task}: {per_bucket} samples per bucket at temperature {temperature:g}")
    for column in ("mode", "stage", "correct", "GFLOPS of the correct", "faster than parent"):
        table.add_column(column)
    for row in report.rows():
        speeds = (
            "-"
            if row["min_gflops"] is None
            else f"{row['min_gflops']:.1f} to {row['max_gflops']:.1f}"
        )
        faster = "-" if row["faster_than_parent"] is None else str(row["faster_than_parent"])
        table.add_row(
            row["mode"],
            str(row["stage"]),
            f"{row['correct']}/{row['samples']} ({row['share_correct']:.0%})",
            speeds,
            faster,
        )
    console.print(table)
    console.print("statuses: " + ", ".join(f"{k} {v}" for k, v in report.statuses().items()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcrl-bootstrap",
        description="Build the embedded policy: a small Qwen2 code model trained on CPU on a "
        "generated corpus of kernels (matrix multiply, and with --tasks also GEMV, the "
        "5-point stencil and CSR SpMV); prints its directory.",
    )
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
