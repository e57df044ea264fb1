"""Command line of hpcrl-generator."""

from __future__ import annotations

import argparse
import sys

from hpcrl_common.service import add_config_argument


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcrl-generator", description=(
            "Sample kernel completions from the current policy."
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="(not implemented yet) turn generate-requests into code-to-bench candidates"
    )
    add_config_argument(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        print("hpcrl-generator serve is not implemented yet (issue #8)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
