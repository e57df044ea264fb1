"""Command line of hpcrl-scheduler."""

from __future__ import annotations

import argparse
import sys

from hpcrl_common.service import add_config_argument


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcrl-scheduler", description=(
            "Run the Staged Quality-Diversity search over the program pool."
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="(not implemented yet) run the SQD experiment over the broker"
    )
    add_config_argument(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        print("hpcrl-scheduler serve is not implemented yet (issue #6)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
