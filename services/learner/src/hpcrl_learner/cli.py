"""Command line of hpcrl-learner."""

from __future__ import annotations

import argparse
import sys

from hpcrl_common.service import add_config_argument


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcrl-learner", description=(
            "Train the policy with GRPO on rollout batches."
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="(not implemented yet) train on rollout-batches, announce weight-updates"
    )
    add_config_argument(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        print("hpcrl-learner serve is not implemented yet (issue #7)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
