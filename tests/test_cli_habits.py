"""What ollama, llama.cpp and vLLM users expect of the command line: --version, help with defaults, no
prefix matching, `show`, `--dtype auto`, and a thread count that leaves busy cores alone."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import sys

import pytest
import torch

from kvlab import __version__
from kvlab.cli import build_parser, main
from kvlab.kernels import cpu_load
from kvlab.kernels.cpu_load import CpuLoad, CpuSnapshot


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"kvlab {__version__} (torch {torch.__version__.split('+')[0]}") and out.endswith(")\n")


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_no_parser_matches_option_prefixes(capsys):
    parsers = list(_parsers(build_parser()))
    assert len(parsers) > 10 and all(p.allow_abbrev is False for p in parsers)
    with pytest.raises(SystemExit) as done:
        main(["mem", "qwen3-0.6b", "--device", "cpu"])  # once read as --device-memory
    assert done.value.code == 2 and "unrecognized arguments: --device cpu" in capsys.readouterr().err


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("tokens to generate at most (default 256)", "0 is greedy (default 0.0)", "(default auto)",
                  "tokens per KV block (default 16)", "(default 1.0)"):  # fmt: skip
        assert shown in text, shown
    assert "(default None)" not in text and "(default False)" not in text


def test_empty_standard_input_is_one_line(capsys, tiny_chat_model, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
    assert main(["run", str(tiny_chat_model)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no prompt: standard input was empty" in err


def test_show_json_of_a_gguf_file_and_a_folder(capsys, tiny_chat_model, tmp_path):
    from tiny import build_tiny_gguf

    gguf = build_tiny_gguf(tiny_chat_model, tmp_path / "tiny.gguf", quant="Q8_0")
    assert main(["show", str(gguf), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["architecture"] == "llama" and facts["format"] == "gguf" and facts["context_length"] == 512
    assert facts["tensor_types"]["Q8_0"] > 0 and facts["vocab_size"] == 512 and facts["layers"] == 3
    assert facts["parameters"] > 0 and facts["chat_template"].startswith("{") and facts["file_bytes"] == gguf.stat().st_size
    assert main(["show", str(tiny_chat_model), "--json"]) == 0
    folder = json.loads(capsys.readouterr().out)
    assert folder["format"] == "safetensors" and folder["parameters"] == facts["parameters"]
    assert main(["show", str(gguf)]) == 0
    text = capsys.readouterr().out
    for section in ("  Model", "  File", "  Template", "  License", "context length      512"):
        assert section in text, section
    assert main(["show", str(gguf), "--template"]) == 0
    assert capsys.readouterr().out.strip() == facts["chat_template"].strip()


# ---- --dtype auto -------------------------------------------------------------------------------------


def _stored_as(config, kind: str):
    weights = dataclasses.replace(config.file_weights, bytes_by_type=((kind, 1000), ("F32", 10)))
    return dataclasses.replace(config, file_weights=weights)


@pytest.mark.parametrize("kind, fast, cpu, cuda", [
    ("BF16", False, "float32", "bfloat16"), ("BF16", True, "bfloat16", "bfloat16"),
    ("F16", False, "float32", "float16"), ("F32", True, "float32", "float32"),
    ("Q4_1", True, "float32", "bfloat16"),
])  # fmt: skip
def test_dtype_auto(tiny_chat_model, monkeypatch, kind, fast, cpu, cuda):
    from kvlab.config import load_config
    from kvlab.model import auto_dtype as auto

    config = _stored_as(load_config(tiny_chat_model), kind)
    monkeypatch.setattr(auto, "cpu_has_fast", lambda dtype: fast)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert auto.auto_dtype(config, torch.device("cpu")) == cpu
    assert auto.auto_dtype(config, torch.device("cuda")) == cuda


def test_run_reports_what_auto_chose(capsys, tiny_chat_model):
    assert main(["run", str(tiny_chat_model), "hi", "--json", "--max-tokens", "1", "--threads", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "float32"  # float32 weights stay float32
    assert main(["run", str(tiny_chat_model), "hi", "--max-tokens", "1", "--threads", "1"]) == 0
    assert ": float32 (auto) on cpu, 1 thread" in capsys.readouterr().err


# ---- threads on a busy machine ---------------------------------------------------------------------------


@pytest.mark.parametrize("others, default, threads, busy", [
    (0.0, 2, 2, False), (0.2, 2, 2, False), (0.8, 2, 1, True), (1.0, 2, 1, True), (2.0, 2, 1, True),
    (1.0, 8, 7, True), (1.0, 4, 4, True),  # 4 threads on 8 cores: 7 free
])  # fmt: skip
def test_threads_leave_busy_cores_alone(others, default, threads, busy):
    load = CpuLoad(cores=8 if default in (4, 8) else 2, others_busy=others)
    assert load.threads_for(default) == threads and load.is_busy == busy


def test_the_probe_subtracts_its_own_cpu_time(monkeypatch):
    import time

    since = CpuSnapshot(time.monotonic() - 1.0, busy_s=100.0, own_s=10.0)
    # in that second the CPUs were busy for 1.5 s, 0.5 s of it this process's own
    monkeypatch.setattr(cpu_load, "snapshot", lambda: CpuSnapshot(since.wall_s + 1.0, busy_s=101.5, own_s=10.5))
    monkeypatch.setattr(cpu_load, "_usable_cpus", lambda: {0, 1})
    assert cpu_load.measure(since) == CpuLoad(cores=2, others_busy=1.0)
    assert cpu_load.measure(None) is None


def test_a_busy_machine_gets_fewer_threads_and_says_so(capsys, tiny_chat_model, monkeypatch):
    monkeypatch.setattr(cpu_load, "measure", lambda since: CpuLoad(cores=2, others_busy=1.0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert main(["run", str(tiny_chat_model), "hi", "--max-tokens", "1"]) == 0
    assert ", 1 thread (1.0 of 2 cores busy with other programs)" in capsys.readouterr().err
    assert main(["run", str(tiny_chat_model), "hi", "--max-tokens", "1", "--threads", "2"]) == 0
    err = capsys.readouterr().err
    assert "warning: 1.0 of 2 cores busy with other programs; --threads 2 will wait on them" in err
    assert ", 2 threads (--threads; 1.0 of 2 cores busy" in err


@pytest.mark.parametrize("argv", [
    ["run", "MODEL", "--chat", "The capital"], ["run", "MODEL", "--max-tokens", "2", "The capital"],
    ["run", "MODEL", "The capital", "--max-tokens", "2"],
])  # fmt: skip
def test_the_prompt_may_follow_the_options(argv, tiny_chat_model):
    """`make demo` runs `kvlab run MODEL --chat "..."`: Python 3.11's argparse alone rejects it."""
    from kvlab.cli import parse

    args = parse(build_parser(), [str(tiny_chat_model) if a == "MODEL" else a for a in argv])
    assert args.prompt == "The capital" and args.model == str(tiny_chat_model)


def test_a_second_prompt_is_refused(capsys):
    with pytest.raises(SystemExit) as done:
        main(["run", "m", "--chat", "one", "two"])
    assert done.value.code == 2 and "unrecognized arguments: two" in capsys.readouterr().err
