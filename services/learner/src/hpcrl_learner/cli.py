"""Command line of hpcrl-learner."""

from __future__ import annotations

import argparse
import sys

from hpcrl_common.service import add_config_argument


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcrl-learner",
        description="Train the policy with GRPO on rollout batches, commit every step as a "
        "new version to the checkpoint store, and announce it on weight-updates.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="consume rollout-batches, take GRPO steps, checkpoint, announce weight-updates",
        description="Run the learner until SIGINT/SIGTERM. Resumes from the latest version "
        "in learner.checkpoint_dir (version 0 is learner.model_path).",
    )
    add_config_argument(serve)
    return parser


def serve(args: argparse.Namespace) -> int:
    from hpcrl_common.logs import configure_logging
    from hpcrl_common.service import apply_cpu_priority, load_or_exit, run_consumer
    from hpcrl_learner.config import LearnerConfig

    config = load_or_exit(LearnerConfig, args.config)
    apply_cpu_priority(config.learner.cpu_priority)
    log = configure_logging("learner", config.logging.level, config.logging.format)
    from transformers.utils import logging as hf_logging

    from hpcrl_learner.service import build

    hf_logging.disable_progress_bar()
    from hpcrl_learner.service import StoreBusy

    try:
        consumer, learner = build(config)
    except ImportError as exc:
        log.error("backend unavailable", backend=config.learner.backend, error=str(exc))
        return 2
    except StoreBusy as exc:
        log.error("refusing to start", reason=str(exc))
        return 2
    run_consumer(consumer, "learner", config.learner, extra_health=learner.health)
    if learner.failed:
        log.error("learner stopped after a failed step", error=learner.failed)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
