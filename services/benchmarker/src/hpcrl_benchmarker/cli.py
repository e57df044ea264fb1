"""Command line of hpcrl-benchmarker: `check` one completion, or `serve` the queue."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from hpcrl_benchmarker.host import IsaRefused, detect
from hpcrl_common.service import add_config_argument
from hpcrl_common.task import builtin_tasks


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcrl-benchmarker",
        description="Extract, check, compile, verify and time generated kernels in a sandbox.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    isa_help = (
        "accept a host without avx512f that has this ISA (repeatable; e.g. avx2 on "
        "development machines). Rewards from such hosts are not comparable."
    )

    check = commands.add_parser(
        "check",
        help="judge one completion or C file and print the verdict",
        description="Judge one completion (markdown or plain C) and print the verdict. "
        "Exits 0 whenever a verdict was produced (whatever its status).",
    )
    check.add_argument("file", type=Path, help="completion or C file ('-' for stdin)")
    check.add_argument(
        "--stage",
        type=int,
        default=6,
        choices=range(1, 7),
        help="SQD stage whose technique rules apply (default 6: all allowed)",
    )
    check.add_argument("--opt-level", default="O3", help="optimisation level (default O3)")
    check.add_argument(
        "--task",
        default="matmul",
        help=f"built-in task name ({', '.join(builtin_tasks())}) or path of a "
        "task TOML (default matmul)",
    )
    check.add_argument("--allow-isa", action="append", default=[], metavar="ISA", help=isa_help)
    check.add_argument(
        "--json", action="store_true", help="print exactly one JSON object on stdout"
    )
    check.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="scratch directory (default: $TMPDIR/hpcrl-bench)",
    )
    check.add_argument(
        "--reference",
        action="store_true",
        help="also time the task's references on this node, now, as a kernel is "
        "timed, and compare: its OpenBLAS routine at the reward size (cblas_dgemm "
        "for matmul, cblas_dgemv for gemv) and, for a memory-bound task (gemv, "
        "stencil, spmv), the node's memory bandwidth (STREAM's triad; the kernel's "
        "GB/s as a share of it). JSON: a 'reference' key with 'openblas' and 'triad', "
        "and 'roof_share'",
    )

    serve = commands.add_parser(
        "serve",
        help="consume code-to-bench, publish bench-results",
        description="Run a benchmarker replica: consume code-to-bench, publish bench-results, "
        "serve /metrics and /healthz.",
    )
    add_config_argument(serve)
    serve.add_argument(
        "--allow-isa",
        action="append",
        default=[],
        metavar="ISA",
        help=isa_help + " Added to benchmarker.allow_isa.",
    )
    return parser


def _check(args: argparse.Namespace) -> int:
    from hpcrl_benchmarker import harnesses
    from hpcrl_benchmarker.config import BenchmarkerSection
    from hpcrl_benchmarker.pipeline import Benchmarker
    from hpcrl_benchmarker.steps import InternalError
    from hpcrl_common.task import TaskError, load_task

    host = detect()
    try:
        host.check_isa(args.allow_isa)
    except IsaRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    try:
        task = load_task(args.task)
        task.compile_flags(args.opt_level)
        harness = harnesses.for_task(task)
    except (TaskError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        text = sys.stdin.read() if str(args.file) == "-" else args.file.read_text(errors="replace")
    except OSError as exc:
        print(f"error: cannot read {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    # One-shot use: scratch under the user's temporary directory unless told otherwise.
    work_dir = args.work_dir or Path(tempfile.gettempdir()) / "hpcrl-bench"
    benchmarker = Benchmarker(BenchmarkerSection(work_dir=work_dir), host)
    verdict = benchmarker.evaluate(text, stage=args.stage, opt_level=args.opt_level, task=task)
    moved = harness.bytes_moved(task.sizes.reward)
    bandwidth = (
        moved / verdict.timing.mean_s / 1e9
        if moved is not None and verdict.timing is not None
        else None
    )
    try:
        reference = benchmarker.reference(task) if args.reference else None
    except InternalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    openblas = reference.openblas if reference is not None else None
    triad = reference.triad if reference is not None else None
    roof_share = bandwidth / triad.gbytes_per_s if bandwidth is not None and triad else None
    if args.json:
        data = verdict.to_json()
        if moved is not None:
            data["gbytes_per_s"] = bandwidth
        if reference is not None:
            data["reference"] = reference.to_json()
            data["roof_share"] = roof_share
        print(json.dumps(data))
    else:
        print(f"status:      {verdict.status}")
        print(f"reward:      {verdict.reward:g}")
        if verdict.gflops is not None and verdict.timing is not None:
            t = verdict.timing
            print(
                f"gflops:      {verdict.gflops:.2f} (mean {t.mean_s * 1e3:.3f} ms, median "
                f"{t.median_s * 1e3:.3f}, min {t.min_s * 1e3:.3f}, max {t.max_s * 1e3:.3f}, "
                f"cv {t.cv:.2%}, attempts {t.attempts}{', noisy' if t.noisy else ''})"
            )
        if bandwidth is not None and moved is not None:
            print(
                f"bandwidth:   {bandwidth:.2f} GB/s ({moved / 1e6:.1f} MB moved per call at "
                "least, over the mean time)"
            )
        if openblas is not None:
            share = (
                f"; the kernel reaches {verdict.gflops / openblas.gflops:.0%} of it"
                if verdict.gflops is not None
                else ""
            )
            print(f"reference:   {openblas.text()}{share}")
        if triad is not None:
            share = (
                f"; the kernel's {bandwidth:.2f} GB/s is {roof_share:.0%} of it"
                if roof_share is not None and bandwidth is not None
                else ""
            )
            print(f"memory roof: {triad.text()}{share}")
        print(f"techniques:  {', '.join(verdict.techniques) or '-'}")
        print(f"generalizes: {verdict.generalizes}")
        print(f"host:        {verdict.host.host_class}")
        if verdict.error:
            print(f"error:       {verdict.error}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from hpcrl_benchmarker.config import BenchmarkerConfig
    from hpcrl_benchmarker.pipeline import Benchmarker
    from hpcrl_benchmarker.service import build_consumer
    from hpcrl_benchmarker.steps import InternalError
    from hpcrl_common.logs import configure_logging
    from hpcrl_common.service import apply_cpu_priority, load_or_exit, run_consumer

    config = load_or_exit(BenchmarkerConfig, args.config)
    section = config.benchmarker
    apply_cpu_priority(section.cpu_priority)
    log = configure_logging("benchmarker", config.logging.level, config.logging.format)
    host = detect()
    try:
        host.check_isa([*section.allow_isa, *args.allow_isa])
    except IsaRefused as exc:
        log.error("refusing to start", reason=str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 3
    try:
        benchmarker = Benchmarker(section, host)
    except InternalError as exc:
        log.error("refusing to start", reason=str(exc))
        print(f"error: {exc}", file=sys.stderr)
        return 3
    benchmarker.confine()  # a replica with a CPU set runs only there (threads inherit it)
    consumer = build_consumer(config, benchmarker)
    log.info(
        "benchmarker starting",
        host_class=host.host_class,
        peak_gflops=round(host.peak_gflops, 1),
        concurrency=section.concurrency,
        cpus=section.cpus or "all",
        namespace=config.broker.namespace,
    )
    run_consumer(consumer, "benchmarker", section, extra_health=benchmarker.health)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "check":
        return _check(args)
    return _serve(args)


if __name__ == "__main__":
    sys.exit(main())
