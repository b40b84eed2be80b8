"""What the help and the small tables say: every option explained with its default, '%' shown as '%',
a description on every command, "1 thread"."""

from __future__ import annotations

import argparse

import pytest

from kvlab import ps_cli
from kvlab.cli import build_parser, main


def help_of(capsys, *command) -> str:
    with pytest.raises(SystemExit) as e:
        main([*command, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def subparsers(parser: argparse.ArgumentParser, path=("kvlab",)):
    """(command path, parser) of every command and subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from subparsers(sub, (*path, name))


def test_every_option_has_help():
    missing = [(" ".join(path), action.option_strings) for path, sub in subparsers(build_parser())
               for action in sub._actions if action.option_strings and not action.help]  # fmt: skip
    assert missing == []


def test_every_command_has_a_description():
    missing = [" ".join(path) for path, sub in subparsers(build_parser()) if not sub.description]
    assert missing == []


def test_quality_help_shows_percent_signs(capsys):
    text = " ".join(help_of(capsys, "quality").split())
    assert "same top >= 97%)" in text and ">= 90%)" in text and "%%" not in text


def test_serve_help_describes_the_server_and_the_log_level(capsys):
    text = " ".join(help_of(capsys, "serve").split())
    assert "Serve MODEL over HTTP with OpenAI's API" in text
    assert "--log-level {critical,error,warning,info,debug} uvicorn's log level" in text
    assert "(default warning)" in text


def test_bench_serve_help_shows_the_number_of_requests(capsys):
    text = " ".join(help_of(capsys, "bench", "serve").split())
    assert "--num-requests NUM_REQUESTS requests to send in all (default 16)" in text


@pytest.mark.parametrize("threads, words", [(1, "cpu, 1 thread "), (4, "cpu, 4 threads "), (None, "cpu, ? threads ")])
def test_ps_counts_threads_in_words(threads, words):
    model = {"name": "m", "size": 98_000_000, "context_length": 8192,
             "kvlab": {"device": "cpu", "threads": threads, "kv_blocks_used": 1, "kv_blocks_total": 4}}  # fmt: skip
    if threads is None:
        del model["kvlab"]["threads"]
    assert words in ps_cli.table([model]).splitlines()[1] + " "
