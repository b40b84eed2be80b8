"""Start-up does only the work it needs: no torch._dynamo import, one parse of a GGUF file."""

from __future__ import annotations

import subprocess
import sys

from kvlab import LLM, gguf_file


def test_a_run_never_imports_dynamo(tiny_chat_model, tmp_path):
    """Arithmetic on meta tensors (the model is built under torch.device("meta")) imports torch._dynamo:
    about a second of every start-up, for the rotary tables alone."""
    from tiny import build_tiny_gguf

    gguf = build_tiny_gguf(tiny_chat_model, tmp_path / "tiny.gguf", quant="Q8_0")
    code = ("import sys; from kvlab.cli import main; "
            f"code = main(['run', {str(gguf)!r}, 'hi', '--max-tokens', '1', '--threads', '1']); "
            "print('DYNAMO' if 'torch._dynamo' in sys.modules else 'NO DYNAMO'); sys.exit(code)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("NO DYNAMO")


def test_the_tokenizer_reads_the_loaders_parse_of_the_file(tiny_chat_model, tmp_path, monkeypatch):
    from tiny import build_tiny_gguf

    gguf = build_tiny_gguf(tiny_chat_model, tmp_path / "tiny.gguf")
    parses = []
    real = gguf_file._parse
    monkeypatch.setattr(gguf_file, "_parse", lambda buf: parses.append(1) or real(buf))
    llm = LLM(gguf, threads=1)
    assert len(parses) == 1 and llm.tokenizer is not None
    assert llm.encode("The capital") == LLM(tiny_chat_model, threads=1).encode("The capital")
