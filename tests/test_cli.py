"""The `kvlab run` / `kvlab chat` commands and the one-line errors every bad input gets."""

from __future__ import annotations

import json

import pytest

from kvlab.cli import main


def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_run_json(capsys, tiny_chat_model):
    code, out, _ = run_cli(
        capsys, "run", str(tiny_chat_model), "The capital", "--json", "--max-tokens", "7", "--ignore-eos",
        "--temperature", "0",
    )  # fmt: skip
    assert code == 0
    d = json.loads(out)
    for key in ("text", "token_ids", "prompt_tokens", "generated_tokens", "ttft_s", "prefill_tok_s",
                "decode_tok_s", "kv_cache_bytes", "peak_memory_bytes", "weight_bytes"):  # fmt: skip
        assert key in d, key
    assert d["generated_tokens"] == 7 == len(d["token_ids"])
    assert d["kv_cache_bytes"] > 0


def test_run_streams_then_reports(capsys, tiny_chat_model):
    code, out, err = run_cli(capsys, "run", str(tiny_chat_model), "Hi", "--max-tokens", "5", "--ignore-eos")
    assert code == 0 and out.endswith("\n")
    for word in ("prompt", "TTFT", "prefill", "decode", "tok/s", "KV cache", "peak memory"):
        assert word in err, word


def test_run_chat_and_no_cache_agree(capsys, tiny_chat_model):
    args = ["run", str(tiny_chat_model), "Hi", "--chat", "--json", "--max-tokens", "6", "--ignore-eos"]
    cached = json.loads(run_cli(capsys, *args)[1])
    uncached = json.loads(run_cli(capsys, *args, "--no-cache")[1])
    assert cached["token_ids"] == uncached["token_ids"]
    assert uncached["kv_cache_bytes"] == 0 and uncached["use_cache"] is False


def test_chat_keeps_the_cache_between_turns(capsys, monkeypatch, tiny_chat_model):
    lines = iter(["hello", "and again", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    code, _, err = run_cli(capsys, "chat", str(tiny_chat_model), "--max-tokens", "4", "--temperature", "0")
    assert code == 0
    turns = [line for line in err.splitlines() if line.startswith("[prefilled")]
    assert len(turns) == 2
    assert "0 reused" in turns[0] and "0 reused" not in turns[1]


def test_chat_two_ctrl_c_at_an_empty_prompt_leave(capsys, monkeypatch, tiny_chat_model):
    calls = []

    def interrupt(prompt=""):
        calls.append(prompt)
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", interrupt)
    code, _, err = run_cli(capsys, "chat", str(tiny_chat_model))
    assert code == 0 and len(calls) == 2 and "Traceback" not in err
    assert err.count("Ctrl-C again") == 1  # the first one only says how to leave


def test_chat_end_of_input_ends_cleanly(capsys, monkeypatch, tiny_chat_model):
    def eof(prompt=""):
        raise EOFError

    monkeypatch.setattr("builtins.input", eof)
    assert run_cli(capsys, "chat", str(tiny_chat_model))[0] == 0


@pytest.fixture
def bad_inputs(tmp_path, tiny_chat_model):
    truncated = tmp_path / "truncated.gguf"
    from tiny import build_tiny_gguf

    whole = build_tiny_gguf(tiny_chat_model, tmp_path / "whole.gguf")
    truncated.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"this is not a gguf file at all" * 10)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    return {"truncated": truncated, "corrupt": corrupt, "gpt2": gpt2, "tiny": tiny_chat_model}


@pytest.mark.parametrize(
    "args, words",
    [
        (["run", "no-such-model", "hi"], ["unknown model", "no-such-model"]),
        (["run", "/nonexistent/model.gguf", "hi"], ["file not found", "/nonexistent/model.gguf"]),
        (["run", "./x.gguf", "hi"], ["file not found", "./x.gguf"]),
        (["run", "SmolLM2-135M", "hi"], ["unknown model", "did you mean smollm2-135m?"]),
        (["run", "smolm2-135m", "hi"], ["did you mean smollm2-135m?"]),
        (["run", "{truncated}", "hi"], ["truncated"]),
        (["run", "{corrupt}", "hi"], ["not a valid GGUF"]),
        (["run", "{gpt2}", "hi"], ["unsupported architecture", "GPT2LMHeadModel"]),
        (["run", "{tiny}", "word " * 600], ["context"]),
        (["run", "{tiny}", "The capital of France is Paris", "--max-model-len", "4"], ["context"]),
        (["run", "{tiny}", "hi", "--temperature", "-1"], ["temperature"]),
        (["run", "{tiny}", "hi", "--top-p", "0"], ["top_p"]),
        (["run", "{tiny}", "hi", "--top-p", "1.5"], ["top_p"]),
        (["run", "{tiny}", "hi", "--min-p", "2"], ["min_p"]),
        (["run", "{tiny}", "hi", "--max-tokens", "0"], ["max_tokens"]),
        (["run", "{tiny}", "hi", "--threads", "0"], ["threads"]),
        (["run", "{tiny}", "hi", "--device", "tpu9"], ["device"]),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, bad_inputs, args, words):
    args = [a.format(**bad_inputs) for a in args]
    code, out, err = run_cli(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlab: error:"), err
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert "Traceback" not in err
