"""`kvlab run`'s footer: the hint towards --chat when a raw completion of a chat model ran to --max-tokens."""

from __future__ import annotations

import subprocess
import sys


def kvlab(*args: str, stdin: str | None = None):
    return subprocess.run([sys.executable, "-m", "kvlab", *args], input=stdin, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


def test_a_raw_completion_of_a_chat_model_that_ran_out_points_to_chat(tiny_chat_model):
    raw = kvlab("run", str(tiny_chat_model), "--max-tokens", "4", "--ignore-eos", stdin="hi\n")
    assert raw.returncode == 0, raw.stderr
    hint = [x for x in raw.stderr.splitlines() if "--chat" in x]
    assert len(hint) == 1 and "raw text" in hint[0] and "--max-tokens 4" in hint[0], raw.stderr
    assert "--chat" not in raw.stdout  # the answer alone on standard output

    chat = kvlab("run", str(tiny_chat_model), "--chat", "--max-tokens", "4", "--ignore-eos", stdin="hi\n")
    assert chat.returncode == 0, chat.stderr
    assert not [x for x in chat.stderr.splitlines() if "add --chat" in x], chat.stderr


def test_the_hint_follows_the_finish_reason_and_stays_out_of_json(tiny_chat_model):
    r = kvlab("run", str(tiny_chat_model), "hi", "--max-tokens", "4", "--stop", "")  # refused: no hint in an error
    assert r.returncode == 2 and "add --chat" not in r.stderr
    for stop in ("a", "e", " "):  # a random tiny model: some answers end on a stop string, some run out
        r = kvlab("run", str(tiny_chat_model), "hi", "--max-tokens", "12", "--stop", stop)
        assert r.returncode == 0, r.stderr
        ran_out = "(length)" in r.stderr
        assert ran_out or "(stop)" in r.stderr, r.stderr
        assert ("add --chat" in r.stderr) == ran_out, r.stderr
    js = kvlab("run", str(tiny_chat_model), "hi", "--max-tokens", "4", "--ignore-eos", "--json")
    assert js.returncode == 0 and "add --chat" not in js.stdout + js.stderr
