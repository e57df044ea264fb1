"""Command line of hpcrl-benchmarker."""

from __future__ import annotations

import argparse
import sys

from hpcrl_common.service import add_config_argument


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpcrl-benchmarker", description=(
            "Compile, verify and time generated kernels in a sandbox."
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="(not implemented yet) consume code-to-bench, publish bench-results"
    )
    add_config_argument(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        print("hpcrl-benchmarker serve is not implemented yet (issue #5)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
