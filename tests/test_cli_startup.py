"""Small questions get fast answers: `--version`, `--help`, `list`, and argument, name and file errors
come back without importing torch (nor numpy, transformers, the web stack): a second or more of every
such start-up otherwise. Each command runs as its own process, with an empty KVLAB_HOME."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "numpy", "transformers", "tokenizers", "fastapi", "uvicorn", "jinja2", "gguf", "safetensors")

# runs the command line, then says on its last stderr line which heavy modules were imported
CHILD = f"""
import json, sys
from kvlab.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
sys.stdout.flush()
print("IMPORTED " + json.dumps([m for m in {HEAVY!r} if m in sys.modules]), file=sys.stderr)
sys.exit(code)
"""


def kvlab(tmp_path, *args) -> tuple[int, str, list[str], list[str]]:
    """(exit code, stdout, stderr's lines, the heavy modules imported)."""
    env = {**os.environ, "KVLAB_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120)  # fmt: skip
    *err, last = done.stderr.splitlines()
    assert last.startswith("IMPORTED "), done.stderr
    return done.returncode, done.stdout, err, json.loads(last.removeprefix("IMPORTED "))


@pytest.mark.parametrize(
    "args, words",
    [
        (["run", "no-such-model"], ["unknown model 'no-such-model'", "known models: smollm2-135m"]),
        (["run", "smolm2-135m", "hi"], ["did you mean smollm2-135m?"]),
        (["run", "smollm2-135m", "--top-p", "5"], ["top_p must be in (0, 1], got 5.0"]),
        (["run", "smollm2-135m", "hi", "--temperature", "-1"], ["temperature"]),
        (["run", "/missing/file.gguf"], ["file not found: /missing/file.gguf"]),
        (["chat", "no-such-model"], ["unknown model 'no-such-model'"]),
        (["serve", "./missing.gguf"], ["file not found: ./missing.gguf"]),
        (["quality", "no-such-model"], ["unknown model 'no-such-model'"]),
        (["bench", "serve", "--model", "no-such-model"], ["unknown model 'no-such-model'"]),
        (["run", "smollm2-135m", "hi", "--speculative-model", "no-such-draft"], ["unknown model 'no-such-draft'"]),
        (["show", "no-such-model"], ["unknown model 'no-such-model'"]),
        (["pull", "no-such-model"], ["unknown model 'no-such-model'"]),
        (["rm", "smollm2-135m"], ["smollm2-135m is not pulled"]),
        (["run", "smollm2-135m", "hi", "--device", "tpu9"], ["unknown device 'tpu9'"]),
    ],
)
def test_errors_are_one_line_exit_2_and_never_import_torch(tmp_path, args, words):
    code, out, err, imported = kvlab(tmp_path, *args)
    assert code == 2 and out == ""
    assert len(err) == 1 and err[0].startswith("kvlab: error: "), err
    for word in words:
        assert word in err[0], (word, err[0])
    assert imported == [], imported


def test_version(tmp_path):
    code, out, err, imported = kvlab(tmp_path, "--version")
    assert code == 0 and out.startswith("kvlab 0.1.0 (torch ") and "Python" in out and err == []
    assert imported == []


def test_list(tmp_path):
    code, out, err, imported = kvlab(tmp_path, "list")
    assert code == 0 and out.startswith("NAME") and "smollm2-135m" in out and err == []
    assert imported == []


@pytest.mark.parametrize("command", [[], ["run"], ["serve"], ["quality"], ["mem"], ["lab"], ["bench", "serve"]])
def test_help_never_imports_torch(tmp_path, command):
    code, out, _, imported = kvlab(tmp_path, *command, "--help")
    assert code == 0 and out.startswith("usage: kvlab")
    assert imported == []


def test_a_usage_error_never_imports_torch(tmp_path):
    code, out, err, imported = kvlab(tmp_path, "run", "smollm2-135m", "--top-p", "high")
    assert code == 2 and out == "" and "argument --top-p: invalid float value: 'high'" in err[-1]
    assert imported == []
