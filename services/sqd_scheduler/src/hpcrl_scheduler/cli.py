"""Command line of hpcrl-scheduler."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from hpcrl_common.broker import Consumer
from hpcrl_common.logs import configure_logging
from hpcrl_common.service import (
    add_config_argument,
    apply_cpu_priority,
    load_or_exit,
    run_consumer,
)
from hpcrl_scheduler.config import SchedulerConfig
from hpcrl_scheduler.scheduler import Scheduler, SchedulerError
from hpcrl_scheduler.store import Store


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcrl-scheduler",
        description="Run the Staged Quality-Diversity search over the program pool: publish "
        "generation requests, join benchmark results into groups, publish rollout batches.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run (or resume) the experiment's T iterations over the broker; exits 0 "
        "when all are complete",
    )
    add_config_argument(serve)
    status = commands.add_parser(
        "status",
        help="print the pool (per stage: count, best/median GFLOPS, status shares), "
        "the iterations and what is in flight",
    )
    add_config_argument(status)
    status.add_argument("--db", type=Path, help="scheduler database (default: from the config)")
    status.add_argument("--json", action="store_true", help="print machine-readable JSON")
    export = commands.add_parser(
        "export",
        help="write the best program of each stage and the lineage of the overall "
        "best as .c files with index.json and index.md",
    )
    add_config_argument(export)
    export.add_argument("dir", type=Path, metavar="DIR", help="output directory")
    export.add_argument("--db", type=Path, help="scheduler database (default: from the config)")
    return parser


def _db_path(args: argparse.Namespace) -> Path:
    if getattr(args, "db", None):
        return args.db
    return load_or_exit(SchedulerConfig, args.config).db_path


def _open_read_only(args: argparse.Namespace) -> Store:
    try:
        return Store(_db_path(args), read_only=True)
    except FileNotFoundError as exc:
        raise SystemExit(f"error: {exc}") from None


def serve(args: argparse.Namespace) -> int:
    config = load_or_exit(SchedulerConfig, args.config)
    apply_cpu_priority(config.scheduler.cpu_priority)
    progress = _progress() if sys.stderr.isatty() else None
    # Configured after the progress display starts, so log lines print above it.
    log = configure_logging("scheduler", config.logging.level, config.logging.format)
    from hpcrl_scheduler.service import SchedulerService

    store = Store(config.db_path)
    try:
        scheduler = Scheduler(config, store)
    except SchedulerError as exc:
        raise SystemExit(f"error: {exc}") from None
    consumer = Consumer(config.broker, "scheduler", concurrency=2)
    update = _progress_updater(progress, scheduler) if progress is not None else None
    service = SchedulerService(scheduler, consumer, on_tick=update)
    log.info(
        "serving",
        db=str(config.db_path),
        iteration=scheduler.iteration(),
        iterations=config.scheduler.iterations,
    )
    try:
        run_consumer(consumer, "scheduler", config.scheduler, service.health)
    finally:
        if progress is not None:
            progress.stop()
        store.close()
    if service.finished:
        return 0
    log.info("stopped before the experiment finished; serve again to resume")
    return 0


def _progress():  # -> rich.progress.Progress
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        console=Console(stderr=True),
        redirect_stderr=True,
    )
    progress.start()
    return progress


def _progress_updater(progress, scheduler: Scheduler) -> Callable[[], None]:
    iterations = progress.add_task("iterations", total=scheduler.section.iterations)
    groups = progress.add_task("groups of iteration", total=1)

    def update() -> None:
        t = scheduler.iteration()
        states = scheduler.store.count_groups_by_state(t)
        progress.update(iterations, completed=scheduler.iterations_done())
        progress.update(
            groups,
            description=f"groups of iteration {t}",
            total=max(sum(states.values()), 1),
            completed=states["closed"],
        )

    return update


def status(args: argparse.Namespace) -> int:
    from hpcrl_scheduler.report import render, snapshot

    store = _open_read_only(args)
    try:
        data = snapshot(store)
    finally:
        store.close()
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        render(data)
    return 0


def export(args: argparse.Namespace) -> int:
    from hpcrl_scheduler.report import export as write_export

    store = _open_read_only(args)
    try:
        index = write_export(store, args.dir)
    finally:
        store.close()
    print(
        f"wrote {len(index['best_per_stage'])} stage bests and a lineage of "
        f"{len(index['lineage'])} programs to {args.dir}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"serve": serve, "status": status, "export": export}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
