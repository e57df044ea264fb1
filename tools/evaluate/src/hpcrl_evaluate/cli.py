"""hpcrl-evaluate: does training help? The fixed evaluation set, judged by the benchmarker,
sampled with version 0 and a later policy version under the same seeds."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hpcrl_common.task import TaskError, load_task
from hpcrl_evaluate.errors import CAUSES, compile_error_causes
from hpcrl_evaluate.evalset import SEED_SPECS, SPECS, build_set
from hpcrl_evaluate.run import (
    METRICS,
    BackendOptions,
    Evaluation,
    SamplingOptions,
    VersionError,
    resolve_versions,
)

MATMUL_SET = "; ".join(f"{i}: {s.name}" for i, s in enumerate(SPECS))
SEED_SET = "; ".join(f"{i}: {s.name}" for i, s in enumerate(SEED_SPECS))
EPILOG = f"""\
The set for matmul ({len(SPECS)} prompts): {MATMUL_SET}. For any other task \
({len(SEED_SPECS)} prompts, from its seed program): {SEED_SET}.
Each prompt is sampled K times per version with a seed derived from (--seed, prompt index),
so sample i of prompt p is paired across versions. Metrics: share correct (status success),
mean raw reward (GFLOPS on success, the penalty otherwise), mean GFLOPS counting failures as
0, best GFLOPS, share of samples using each technique; the gain (last version - first) comes
with a paired bootstrap 95 % interval. Exit status: 0 done, 2 bad arguments (missing model
directory, unknown version), 1 the evaluation failed.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcrl-evaluate",
        description=__doc__.replace("\n", " ").strip(),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        type=Path,
        required=True,
        help="base model directory (Hugging Face format): version 0",
    )
    parser.add_argument(
        "--checkpoints",
        type=Path,
        default=None,
        help="the learner's checkpoint store (manifest.json), for versions > 0",
    )
    parser.add_argument(
        "--versions",
        default=None,
        help="comma-separated versions: 0, latest or a number; the first is "
        "the baseline, the last the one compared with it (default: 0,latest "
        "with --checkpoints, else 0)",
    )
    parser.add_argument(
        "--samples",
        type=_positive,
        default=8,
        metavar="K",
        help="completions per prompt and version (default 8)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="evaluation seed: sampling seeds and bootstrap (default 0)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="sampling temperature (default 0.8, the demo's)",
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1)")
    parser.add_argument(
        "--max-tokens",
        type=_positive,
        default=SamplingOptions.max_tokens,
        help=f"completion length limit (default {SamplingOptions.max_tokens}, the demo's)",
    )
    parser.add_argument(
        "--backend",
        choices=("vllm", "transformers"),
        default="vllm",
        help="generator backend (default vllm)",
    )
    parser.add_argument("--opt-level", default="O3", help="gcc optimisation level (default O3)")
    parser.add_argument("--task", default="matmul", help="task name or TOML (default matmul)")
    parser.add_argument(
        "--isa",
        choices=("auto", "avx2", "avx512"),
        default="auto",
        help="the ISA the prompts name (default auto: this host's, avx512 where it has "
        "AVX-512F, else avx2); avx2 on an AVX-512 host evaluates an AVX2 fleet's policy",
    )
    parser.add_argument(
        "--prompts",
        default=None,
        metavar="I,J,...",
        help="evaluate only these prompt indices (default: the whole set)",
    )
    parser.add_argument("--dtype", default="auto", help="weights dtype (default: the model's)")
    parser.add_argument(
        "--max-model-len",
        type=_positive,
        default=None,
        help="prompt + completion tokens (default: the model's max_position_embeddings)",
    )
    parser.add_argument(
        "--kv-cache-gib",
        type=_positive,
        default=4,
        help="vLLM on CPU: KV cache size in GiB (default 4)",
    )
    parser.add_argument("--device", default="cpu", help="transformers: torch device")
    parser.add_argument(
        "--resamples", type=_positive, default=2000, help="bootstrap resamples (default 2000)"
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="OUT",
        help="write the whole report (every sample and verdict) as JSON",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PNG",
        help="write a figure of first vs last version with the gain's CI",
    )
    return parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _prompt_indices(text: str | None, size: int, parser: argparse.ArgumentParser) -> list[int]:
    if text is None:
        return list(range(size))
    try:
        chosen = [int(part) for part in text.split(",")]
    except ValueError:
        parser.error(f"--prompts: comma-separated indices expected, got {text!r}")
    bad = [i for i in chosen if not 0 <= i < size]
    if bad or len(set(chosen)) != len(chosen):
        parser.error(f"--prompts: indices must be distinct, 0..{size - 1}, got {text!r}")
    return chosen


def host_isa() -> str:
    from hpcrl_benchmarker.host import detect

    return detect().prompt_isa


def _positions(model: Path) -> int:
    """The longest sequence the model was built for (vLLM refuses a longer max_model_len)."""
    config = json.loads((model / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 4096)


def setup(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Evaluation:
    """Check every argument before anything heavy is imported (exit 2 on a mistake)."""
    if not (args.model / "config.json").is_file():
        parser.error(f"--model: {args.model} is not a model directory (no config.json)")
    requested = args.versions or ("0,latest" if args.checkpoints else "0")
    try:
        refs = resolve_versions(requested.split(","), args.model, args.checkpoints)
        task = load_task(args.task)
        task.compile_flags(args.opt_level)
    except (VersionError, TaskError, ValueError) as exc:
        parser.error(str(exc))
    isa = host_isa() if args.isa == "auto" else args.isa
    if isa == "avx512" and host_isa() != "avx512":
        parser.error("--isa avx512: this host has no AVX-512F, so it cannot run the kernels")
    every = build_set(task, isa)
    prompts = [every[i] for i in _prompt_indices(args.prompts, len(every), parser)]
    return Evaluation(
        model=args.model.resolve(),
        refs=refs,
        prompts=prompts,
        task=args.task,
        opt_level=args.opt_level,
        isa=isa,
        sampling=SamplingOptions(
            samples=args.samples,
            seed=args.seed,
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
        ),
        backend=BackendOptions(
            backend=args.backend,
            dtype=args.dtype,
            max_model_len=args.max_model_len or _positions(args.model),
            kv_cache_space_gib=args.kv_cache_gib,
            device=args.device,
        ),
        resamples=args.resamples,
    )


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def summary_table(report: dict[str, Any]) -> Table:
    """One row per metric: each version's value, then the gain and its interval."""
    versions = report["versions"]
    comparison = report["comparison"]
    table = Table(
        title=f"fixed evaluation set: {len(report['prompts'])} prompts x "
        f"{report['sampling']['samples']} samples, seed "
        f"{report['sampling']['seed']}"
    )
    table.add_column("metric")
    for version in versions:
        table.add_column(f"v{version['version']}", justify="right")
    if comparison is not None:
        table.add_column("gain", justify="right")
        table.add_column(f"{comparison['level']:.0%} CI", justify="right")
    for name in METRICS:
        row = [report["metric_labels"][name], *(_num(v["metrics"].get(name)) for v in versions)]
        if comparison is not None:
            gain = comparison["metrics"][name]
            row += [f"{gain['gain']:+.3g}", f"[{gain['low']:+.3g}, {gain['high']:+.3g}]"]
        table.add_row(*row)
    return table


def failures_table(report: dict[str, Any]) -> Table:
    """Per version, how many samples failed each way, compile errors by gcc's first error."""
    table = Table(title="failures: samples per status; compile errors by gcc's first error")
    table.add_column("failure")
    counts = []
    for version in report["versions"]:
        table.add_column(f"v{version['version']}", justify="right")
        samples = [(s["status"], s["error"]) for s in version["samples"]]
        statuses = Counter(status for status, _ in samples if status != "success")
        causes = compile_error_causes(samples)
        counts.append({**statuses, **{f"compile_error: {c}": n for c, n in causes.items()}})
    rows = sorted({status for c in counts for status in c if ":" not in status})
    for status in rows:
        table.add_row(status, *(str(c.get(status, 0)) for c in counts))
        if status == "compile_error":
            for cause in CAUSES:
                key = f"compile_error: {cause}"
                table.add_row(f"  {cause}", *(str(c.get(key, 0)) for c in counts))
    return table


def prompt_table(report: dict[str, Any]) -> Table:
    """Per prompt and version: share correct, mean GFLOPS of the correct samples, best of K."""
    table = Table(title="per prompt: share correct / mean GFLOPS of correct samples / best")
    table.add_column("prompt")
    for version in report["versions"]:
        table.add_column(f"v{version['version']}", justify="right")
    for position, prompt in enumerate(report["prompts"]):
        cells = []
        for version in report["versions"]:
            entry = version["per_prompt"][position]
            speed = entry.get("speed_of_correct") or {}
            cells.append(
                f"{entry['metrics']['share_correct']:.2f} / "
                f"{_num(speed.get('mean_gflops_correct'))} / "
                f"{_num(speed.get('best_of_k'))}"
            )
        table.add_row(f"{prompt['index']}: {prompt['name']}", *cells)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    evaluation = setup(args, parser)
    errors = Console(stderr=True)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    try:
        with Progress(*columns, console=errors) as progress:
            report = evaluation.run(progress)
    except Exception as exc:
        errors.print_exception(max_frames=8)
        errors.print(f"[red]error:[/] evaluation failed: {type(exc).__name__}: {exc}")
        return 1
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        errors.print(f"wrote {args.json}")
    if args.plot is not None:
        from hpcrl_evaluate.plot import plot

        plot(report, args.plot)
        errors.print(f"wrote {args.plot}")
    out = Console()
    out.print(summary_table(report))
    out.print(prompt_table(report))
    out.print(failures_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
