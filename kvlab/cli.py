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
    "kvlab.quality.cli",
    "kvlab.check",
    "kvlab.lab.cli",
    "kvlab.server.cli",
    "kvlab.ps_cli",
    "kvlab.bench.cli",
]

# commands whose `model` (and `speculative_model`) is a kvlab model argument: a registry name, a .gguf
# file or a model folder. cli checks it before the command runs, so that a misspelt name or a missing
# file is one line at once, before the command imports torch. (`kvlab mem` names configs, not models.)
MODEL_COMMANDS = ("run", "chat", "serve", "quality", "check", "lab", "bench")


class HelpWithDefaults(argparse.HelpFormatter):
    """Help that ends each option with its default, unless the text already says it or there is none
    to show (None, False, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        nothing = default is None or default is False or default == [] or default == argparse.SUPPRESS  # not 0
        if "default" in text or nothing or not action.option_strings:
            return text
        return f"{text} (default {default})" if text else f"default {default}"


class Parser(argparse.ArgumentParser):
    """Every kvlab parser, subcommands included (argparse hands the class down): no prefix matching, so
    `--device` is never read as `--device-memory`, and help that shows the defaults."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpWithDefaults)
        super().__init__(*args, **kwargs)


def version_text() -> str:
    """kvlab's version with torch's and Python's (read from package metadata: torch is not imported)."""
    from importlib import metadata

    from kvlab import __version__

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return f"kvlab {__version__} (torch {torch_version}, Python {sys.version.split()[0]})"


class VersionAction(argparse.Action):
    """`--version`, its text made only when asked (reading package metadata costs tens of ms)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kvlab",
        description="Run LLMs with a hand-written decoder and measure what inference costs.",
    )
    parser.add_argument("--version", action=VersionAction, help="print kvlab's, torch's and Python's versions")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parse_args, except that an optional positional named by a command's `late_positional` default
    (run's prompt) may come after options: `kvlab run MODEL --chat "hi"`. Python 3.11's argparse
    matches positionals chunk by chunk and gives an optional one nothing when the first chunk is
    MODEL alone, then calls "hi" unrecognized."""
    args, extra = parser.parse_known_args(argv)
    late = getattr(args, "late_positional", None)
    if late and getattr(args, late) is None and extra and not extra[0].startswith("-"):
        setattr(args, late, extra.pop(0))
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def check_model_args(args: argparse.Namespace) -> None:
    """The checks of a command's model arguments that need neither a download nor torch (see MODEL_COMMANDS)."""
    if args.command not in MODEL_COMMANDS:
        return
    from kvlab import hub

    for value in (getattr(args, "model", None), getattr(args, "speculative_model", None)):
        if value is not None:
            hub.check_model_arg(str(value))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        check_model_args(args)
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
