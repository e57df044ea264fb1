"""Command line of hpcrl-learner."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from types import ModuleType

from hpcrl_common.service import add_config_argument

BOOTSTRAP = "bootstrap-model"
BOOTSTRAP_MODULE = "hpcrl_learner.bootstrap.cli"


def _bootstrap_module() -> ModuleType | None:
    """The policy-bootstrap CLI, imported only when its subcommand is used (it is heavy)."""
    try:
        import hpcrl_learner.bootstrap.cli as module
    except ModuleNotFoundError as exc:
        if exc.name in ("hpcrl_learner.bootstrap", BOOTSTRAP_MODULE):
            return None
        raise
    return module


def build_parser(with_bootstrap: bool = False) -> argparse.ArgumentParser:
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
    bootstrap_help = f"prepare the base policy (see `hpcrl-learner {BOOTSTRAP} --help`)"
    if not with_bootstrap:
        commands.add_parser(BOOTSTRAP, help=bootstrap_help, add_help=False)
        return parser
    module = _bootstrap_module()
    assert module is not None
    real = commands.add_parser(BOOTSTRAP, help=bootstrap_help,
                               description=(module.__doc__ or "").strip() or None)
    module.add_arguments(real)
    return parser


def serve(args: argparse.Namespace) -> int:
    from hpcrl_common.logs import configure_logging
    from hpcrl_common.service import load_or_exit, run_consumer
    from hpcrl_learner.config import LearnerConfig

    config = load_or_exit(LearnerConfig, args.config)
    log = configure_logging("learner", config.logging.level, config.logging.format)
    from transformers.utils import logging as hf_logging

    from hpcrl_learner.service import build

    hf_logging.disable_progress_bar()
    try:
        consumer, learner = build(config)
    except ImportError as exc:
        log.error("backend unavailable", backend=config.learner.backend, error=str(exc))
        return 2
    run_consumer(consumer, "learner", config.learner, extra_health=learner.health)
    if learner.failed:
        log.error("learner stopped after a failed step", error=learner.failed)
        return 1
    return 0


def _run_bootstrap(args: argparse.Namespace) -> int:
    module = _bootstrap_module()
    assert module is not None
    run: Callable[[argparse.Namespace], int] = module.run
    return int(run(args))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    wants_bootstrap = BOOTSTRAP in argv[:1]
    if wants_bootstrap and _bootstrap_module() is None:
        print(f"hpcrl-learner {BOOTSTRAP}: the policy bootstrap is not available in this "
              f"build ({BOOTSTRAP_MODULE} cannot be imported)", file=sys.stderr)
        return 2
    args = build_parser(with_bootstrap=wants_bootstrap).parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return _run_bootstrap(args)


if __name__ == "__main__":
    sys.exit(main())
