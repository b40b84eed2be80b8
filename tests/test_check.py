"""`kvlab check`: every path this machine has, compared on the user's model (here a tiny one)."""

from __future__ import annotations

import pytest
import torch

from kvlab.cli import main
from tiny import add_tiny_tokenizer, build_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = build_tiny("llama", tmp_path_factory.mktemp("check"), head_dim=32)
    return add_tiny_tokenizer(directory)


def check(model, capsys, *extra: str) -> tuple[int, str]:
    code = main(["check", str(model), "--num-prompts", "3", "--prompt-tokens", "12", "--max-tokens", "4", *extra])
    return code, capsys.readouterr().out


def test_every_path_agrees_and_says_so(model, capsys):
    code, out = check(model, capsys, "--kv-cache-dtype", "float32", "q8_0")
    assert code == 0 and "every path agrees" in out, out
    rows = [line.split() for line in out.splitlines() if line.startswith(("  modules", "  cpu-c"))]
    # float32: modules and the C step against the reference; q8_0: the C step against the modules (batch 1, 3)
    assert sorted((r[0], r[1], r[2], r[3]) for r in rows) == sorted(
        [("modules", "float32", "1", "reference"), ("cpu-c", "float32", "1", "reference"),
         ("modules", "float32", "3", "reference"), ("cpu-c", "float32", "3", "reference"),
         ("cpu-c", "q8_0", "1", "modules"), ("cpu-c", "q8_0", "3", "modules")])  # fmt: skip
    assert all("same" in r and float(r[-1]) < 1e-3 for r in rows), out


def test_a_path_that_differs_fails_the_check(model, capsys, monkeypatch):
    from kvlab.backends.cpu import CpuDecodeBackend

    run = CpuDecodeBackend.run

    def broken(self, *args):  # a backend that gets one logit wrong: the most likely token loses
        logits = run(self, *args)
        top = logits.argmax(-1, keepdim=True)
        return logits.scatter(-1, top, torch.full_like(top, -1e9, dtype=logits.dtype))

    monkeypatch.setattr(CpuDecodeBackend, "run", broken)
    code, out = check(model, capsys, "--kv-cache-dtype", "float32")
    assert code == 1 and "comparison(s) differ" in out and "differ from token" in out, out


def test_bad_input_is_one_line_and_exit_2(model, capsys):
    assert main(["check", str(model), "--kv-cache-dtype", "q9"]) == 2
    assert main(["check", str(model), "--max-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert "unknown KV cache dtype 'q9'" in err and "--max-tokens must be at least 1" in err
