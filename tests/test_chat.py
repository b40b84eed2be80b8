"""`kvlab chat`: Ctrl-C on a real terminal (a pty), slash commands, multi-line input, the (length) mark."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from kvlab.chat_cli import read_message
from kvlab.cli import main


def _take_terminal() -> None:
    """In the child, a new session's leader: make the pty its controlling terminal, so Ctrl-C sends SIGINT."""
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """A process on a pseudo-terminal: what it writes is read as it comes, keys are typed into it."""

    def __init__(self, cmd: list[str], env: dict):
        master, slave = pty.openpty()
        self.proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True,
                                     preexec_fn=_take_terminal)  # fmt: skip
        os.close(slave)
        self.master, self.seen = master, ""

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def wait_for(self, pattern: str, timeout: float = 120.0) -> re.Match:
        """Read until `pattern` matches what came after the last match; return the match."""
        end = time.monotonic() + timeout
        while True:
            found = re.search(pattern, self.seen)
            if found:
                self.seen = self.seen[found.end() :]
                return found
            ready, _, _ = select.select([self.master], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                raise AssertionError(f"no {pattern!r} within {timeout} s; the terminal shows:\n{self.seen[-2000:]}")
            try:
                self.seen += os.read(self.master, 65536).decode(errors="replace")
            except OSError:  # the process ended and closed the terminal
                raise AssertionError(f"the process ended before {pattern!r}:\n{self.seen[-2000:]}") from None

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            os.close(self.master)


def test_ctrl_c_stops_the_answer_and_the_next_turn_reuses_the_cache(tiny_chat_model, tmp_path):
    env = {**os.environ, "KVLAB_HOME": str(tmp_path), "TERM": "dumb"}
    cmd = [sys.executable, "-m", "kvlab.cli", "chat", str(tiny_chat_model), "--max-tokens", "100000",
           "--ignore-eos", "--threads", "1", "--kv-memory", "4MiB"]  # fmt: skip
    term = Terminal(cmd, env)
    try:
        term.wait_for(r">>> ")
        term.type("hello there\r")
        term.wait_for(r"hello there\r?\n.")  # the answer has begun streaming
        term.type("\x03")  # Ctrl-C: SIGINT from the terminal, as a user's key press sends it
        term.wait_for(r"\(interrupted\)")
        term.wait_for(r">>> ")  # the prompt is back, the chat goes on
        term.type("/set max_tokens 3\r")
        term.wait_for(r"max_tokens = 3.*\n.*>>> ")
        term.type("and again\r")
        reused = int(term.wait_for(r"(\d+) reused from the cache").group(1))
        assert reused > 5  # the first turn, its interrupted answer included, came from the cache
        term.wait_for(r">>> ")
        term.type("\x04")  # Ctrl-D leaves
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.close()
    assert (tmp_path / "chat_history").read_text().count("hello there") == 1  # line history kept


def test_read_message_takes_triple_quoted_lines():
    lines = iter(['"""first', "second", 'third"""'])
    assert read_message(lambda prompt: next(lines)) == "first\nsecond\nthird"
    assert read_message(lambda prompt: '"""all on one line"""') == "all on one line"
    assert read_message(lambda prompt: "plain") == "plain"


def chat(monkeypatch, capsys, model, lines: list[str], *flags: str) -> tuple[int, str, str]:
    feed = iter(lines)

    def ask(prompt=""):
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", ask)
    code = main(["chat", str(model), "--threads", "1", *flags])
    out, err = capsys.readouterr()
    return code, out, err


def test_slash_commands(monkeypatch, capsys, tiny_chat_model):
    code, _, err = chat(monkeypatch, capsys, tiny_chat_model, [
        "/help", "/set temperature 0.2", "/set top_p 2", "/set top_k many", "/show", "/foo bar",
        "/set system Be brief.", "/show", "/bye", "never read",
    ])  # fmt: skip
    assert code == 0
    assert "/set temperature 0.7" in err and "/clear" in err  # the help text
    assert "(temperature = 0.2)" in err
    assert "/set top_p: top_p must be in (0, 1]" in err and "/set top_k: 'many' is not a whole number" in err
    assert "sampling temperature 0.2, top_p 1.0" in err
    assert "unknown command '/foo': /help lists the commands" in err
    assert "system   Be brief." in err


def test_turns_multi_line_clear_and_the_length_mark(monkeypatch, capsys, tiny_chat_model):
    code, out, err = chat(monkeypatch, capsys, tiny_chat_model,
                          ['"""one', 'two"""', "/show", "/clear", "/show"], "--max-tokens", "3", "--ignore-eos")  # fmt: skip
    assert code == 0
    turns = [line for line in err.splitlines() if line.startswith("[prefilled")]
    assert len(turns) == 1 and turns[0].endswith("(length: /set max_tokens N for longer answers)")
    assert "this conversation: 2 messages" in err and "(conversation cleared)" in err
    assert "this conversation: 0 messages" in err


@pytest.mark.parametrize("stdin_is_a_terminal", [True, False])
def test_run_without_a_prompt(monkeypatch, capsys, tiny_chat_model, stdin_is_a_terminal):
    """On a terminal `kvlab run MODEL` opens the chat; otherwise it reads the prompt from standard input."""
    import io

    stdin = io.StringIO("The capital\n")
    stdin.isatty = lambda: stdin_is_a_terminal
    monkeypatch.setattr(sys, "stdin", stdin)
    monkeypatch.setattr("builtins.input", lambda prompt="": (_ for _ in ()).throw(EOFError))
    code = main(["run", str(tiny_chat_model), "--json", "--max-tokens", "2", "--threads", "1"])
    out, err = capsys.readouterr()
    assert code == 0
    if stdin_is_a_terminal:
        assert "kvlab chat with" in err and out == ""
    else:
        import json

        piped = json.loads(out)
        main(["run", str(tiny_chat_model), "The capital", "--json", "--max-tokens", "2", "--threads", "1"])
        given = json.loads(capsys.readouterr().out)
        assert piped["prompt_token_ids"] == given["prompt_token_ids"]  # the trailing newline stripped
