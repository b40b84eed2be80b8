"""The `kvlab` command.

Each subcommand lives next to the code it drives and registers itself here through a
`register(subparsers)` function that adds its parser and sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvlab.errors import KvlabError

# modules that provide `register(subparsers)`, in the order `kvlab --help` lists them
COMMAND_MODULES = [
    "kvlab.hub_cli",
    "kvlab.generate_cli",
    "kvlab.memory.cli",
    "kvlab.lab.cli",
    "kvlab.server.cli",
    "kvlab.bench.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvlab",
        description="Run LLMs with a hand-written decoder and measure what inference costs.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KvlabError as e:
        if args.debug:
            raise
        print(f"kvlab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
