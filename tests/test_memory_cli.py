"""`kvlab mem` through kvlab.cli.main: table, JSON, plot, pairs, list, and every bad input."""

from __future__ import annotations

import json

import pytest

import kvlab.cli


@pytest.fixture
def mem(monkeypatch, capsys):
    """Run `kvlab mem ARGS` through the real dispatcher; returns (exit code, stdout, stderr)."""
    monkeypatch.setattr(kvlab.cli, "COMMAND_MODULES", ["kvlab.memory.cli"])  # only the command under test

    def run(*args: str):
        code = kvlab.cli.main(["mem", *map(str, args)])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def write_config(tmp_path, **fields) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    return str(path)


def tiny_config(**overrides) -> dict:
    return {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "hidden_size": 64, "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 256,
            "torch_dtype": "float32", **overrides}


def test_table_for_one_model(mem):
    code, out, err = mem("qwen3-0.6b", "--context", "512")
    assert code == 0 and err == ""
    assert "114,688" in out  # bytes per token
    assert "58,720,256" in out  # 512 tokens: 29,360,128 numbers x 2 bytes
    assert "full_attention" in out and "GiB" in out and "GB" in out


def test_json_for_one_model(mem):
    code, out, _ = mem("qwen3-0.6b", "--context", "40960", "--batch", "2", "--json")
    data = json.loads(out)
    assert code == 0
    assert data["kv_bytes_per_token"] == 114_688
    assert data["kv_bytes"] == 2 * 4_697_620_480
    assert data["state_bytes"] == 0
    assert data["weight_bytes"] == 596_049_920 * 2
    assert data["total_bytes"] == data["kv_bytes"] + data["weight_bytes"] + data["workspace_bytes"]
    assert data["layer_kinds"][0]["label"] == "full_attention" and data["layer_kinds"][0]["num_layers"] == 28


def test_default_context_is_the_models_maximum(mem):
    _, out, _ = mem("qwen2.5-0.5b", "--json")
    assert json.loads(out)["context"] == 32_768


def test_context_suffixes(mem):
    _, out, _ = mem("qwen2.5-0.5b", "--context", "32k", "--json")
    assert json.loads(out)["kv_bytes"] == 32_768 * 12_288


def test_fit_answers(mem):
    code, out, _ = mem("qwen3-0.6b", "--context", "40960", "--device-memory", "24GiB", "--utilization", "0.9",
                       "--json")
    data = json.loads(out)
    assert code == 0 and data["fits"] is True
    assert data["usable_bytes"] == int(24 * 2**30 * 0.9)
    assert data["max_batch"] >= 3 and data["max_context"] > 40_960
    _, out, _ = mem("qwen2.5-72b", "--device-memory", "80GiB")
    assert "does NOT fit" in out


def test_several_models_side_by_side(mem):
    code, out, _ = mem("qwen3-0.6b", "gpt-oss-20b", "nemotron-h-56b", "--context", "8192", "--device-memory", "80GiB")
    assert code == 0
    header = out.splitlines()[0]
    assert header.index("qwen3-0.6b") < header.index("gpt-oss-20b") < header.index("nemotron-h-56b")
    assert "sliding_attention" in out and "mamba2" in out


def test_several_models_json(mem):
    _, out, _ = mem("qwen2.5-0.5b", "qwen2.5-7b", "--context", "1024", "--json")
    models = json.loads(out)["models"]
    assert [m["kv_bytes_per_token"] for m in models] == [12 * 1024, 56 * 1024]


def test_weights_and_kv_dtype_flags(mem):
    _, out, _ = mem("qwen3-0.6b", "--context", "1024", "--kv-dtype", "fp8", "--weights", "int4", "--json")
    data = json.loads(out)
    assert data["kv_bytes_per_token"] == 114_688 // 2
    assert "4.125" in data["weights_format"]


def test_mtp_flag(mem):
    _, out, _ = mem("deepseek-v3", "--context", "1024", "--mtp", "--json")
    assert json.loads(out)["kv_bytes_per_token"] == 62 * 576 * 2


def test_plot(mem, tmp_path):
    png = tmp_path / "kv.png"
    code, out, err = mem("qwen3-0.6b", "gemma-3-27b", "qwen3.5-9b", "--plot", png, "--device-memory", "80GiB")
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(png) in out


def test_pairs(mem):
    code, out, _ = mem("--pairs", "6", "2")
    assert code == 0
    assert "36" in out and "85" in out
    _, out, _ = mem("--pairs", "6", "2", "--json")
    assert json.loads(out)["pairs"] == {"n": 6, "m": 2, "with_cache": 36, "without_cache": 85}


def test_list(mem):
    code, out, _ = mem("--list")
    assert code == 0
    for name in ("qwen3-0.6b", "deepseek-v3", "gpt-oss-20b", "nemotron-h-56b", "gemma-3-27b"):
        assert name in out
    _, out, _ = mem("--list", "--json")
    entries = {e["name"]: e for e in json.loads(out)}
    assert len(entries) == 12 and entries["qwen3-0.6b"]["kv_bytes_per_token"] == 114_688


def test_config_path_and_nested_text_config(mem, tmp_path):
    path = write_config(tmp_path, architectures=["X"], text_config=tiny_config())
    code, out, _ = mem(path, "--context", "10", "--json")
    # 2 layers x 2 x 2 kv x 16 head_dim x 4 B (float32)
    assert code == 0 and json.loads(out)["kv_bytes_per_token"] == 512


def test_unknown_architecture_with_every_field_uses_generic_formula(mem, tmp_path):
    path = write_config(tmp_path, **tiny_config(model_type="brand_new"))
    code, out, _ = mem(path, "--context", "10", "--json")
    data = json.loads(out)
    assert code == 0 and data["kv_bytes_per_token"] == 512
    assert any("generic" in note for note in data["notes"])


def test_nemotron_infinity_token_is_read(mem):
    code, _, _ = mem("nemotron-h-56b", "--json")
    assert code == 0


def bad_inputs(tmp_path) -> list[tuple[list[str], str]]:
    """(arguments, a word the one-line error must contain)."""
    broken = tmp_path / "broken.json"
    broken.write_text('{"model_type": "llama", "num_hidden_layers": 2,')
    missing = write_config(tmp_path, **{k: v for k, v in tiny_config().items() if k != "num_hidden_layers"})
    unknown_dir = tmp_path / "unknown"
    unknown_dir.mkdir()
    unknown = unknown_dir / "config.json"
    unknown.write_text(json.dumps({k: v for k, v in tiny_config(model_type="brand_new").items()
                                   if k != "num_key_value_heads"}))
    negative_dir = tmp_path / "negative"
    negative_dir.mkdir()
    negative = negative_dir / "config.json"
    negative.write_text(json.dumps(tiny_config(num_hidden_layers=-3)))
    huge_dir = tmp_path / "huge"
    huge_dir.mkdir()
    huge = huge_dir / "config.json"
    huge.write_text(json.dumps(tiny_config(hidden_size=10**12)))
    types_dir = tmp_path / "types"
    types_dir.mkdir()
    types = types_dir / "config.json"
    types.write_text(json.dumps(tiny_config(layer_types=["full_attention", "telepathy"])))
    return [
        ([str(broken)], "not valid JSON"),
        ([missing], "num_hidden_layers"),
        ([str(unknown)], "num_key_value_heads"),
        ([str(negative)], "num_hidden_layers"),
        ([str(huge)], "hidden_size"),
        ([str(types)], "telepathy"),
        (["no-such-model"], "unknown model"),
        ([str(tmp_path / "nope.json")], "no such file"),
        ([], "MODEL"),
        (["qwen3-0.6b", "--context", "-5"], "context"),
        (["qwen3-0.6b", "--context", "0"], "context"),
        (["qwen3-0.6b", "--context", str(2**45)], "context"),
        (["qwen3-0.6b", "--batch", "0"], "batch"),
        (["qwen3-0.6b", "--batch", "-2"], "batch"),
        (["qwen3-0.6b", "--batch", "lots"], "batch"),
        (["qwen3-0.6b", "--device-memory", "80"], "unit"),
        (["qwen3-0.6b", "--device-memory=-80GiB"], "size"),
        (["qwen3-0.6b", "--utilization", "1.5"], "utilization"),
        (["qwen3-0.6b", "--kv-dtype", "int3"], "KV dtype"),
        (["qwen3-0.6b", "--weights", "q4_k_m"], "mix"),
        (["qwen3-0.6b", "--weights", "float64x"], "weight format"),
        (["--pairs", "-1", "2"], "pairs"),
        (["--pairs", "0", "0"], "pairs"),
        (["qwen3-0.6b", "--plot", str(tmp_path / "kv.txt")], "png"),
    ]


def test_bad_inputs_are_one_line_and_exit_2(mem, tmp_path):
    for args, word in bad_inputs(tmp_path):
        code, out, err = mem(*args)
        assert code == 2, (args, out, err)
        assert out == "", args
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvlab: error: "), (args, err)
        assert word.lower() in lines[0].lower(), (args, lines[0])


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A tiny random llama as a Q8_0 GGUF file (float32 vectors), as llama.cpp's converter writes one."""
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from tiny import add_tiny_tokenizer, build_tiny, build_tiny_gguf

    directory = tmp_path_factory.mktemp("tiny-gguf")
    build_tiny("llama", directory, head_dim=32)  # q8_0 KV needs whole blocks of 32
    add_tiny_tokenizer(directory)
    return build_tiny_gguf(directory, directory / "tiny-q8_0.gguf", quant="Q8_0")


def test_a_gguf_model_is_sized_in_the_kv_format_kvlab_run_keeps(mem, tiny_gguf):
    """A GGUF file's "auto" is llama.cpp's f16 in the library, but `kvlab mem FILE` sizes what kvlab's engine
    holds for it: float32 on a CPU (issue 31). The engine is built here as `kvlab run` builds it."""
    from kvlab import LLM

    code, out, err = mem(tiny_gguf, "--context", "100", "--json")
    data = json.loads(out)
    llm = LLM(tiny_gguf, dtype="auto", max_model_len=128, kv_memory_bytes=1 << 20)  # --dtype auto, --device cpu
    try:
        formats = llm.engine.cache.formats
        assert data["kv_dtype"] == formats.k.name == formats.v.name == "float32"
        per_token = llm.engine.cache.bytes_per_token()
        assert data["kv_bytes_per_token"] == per_token == 3 * 2 * 2 * 32 * 4  # 3 layers, K and V, 2 heads of 32
        assert data["kv_bytes"] == 100 * per_token
    finally:
        llm.close()
    assert code == 0 and err == ""
    assert data["notes"][0].startswith("KV sized in float32: what `kvlab run` keeps for this model on cpu")
    assert not any("f16" in note for note in data["notes"])
    code, out, _ = mem(tiny_gguf, "--context", "100")
    assert code == 0 and "note: KV sized in float32" in out and "f16" not in out


def test_an_explicit_kv_format_is_sized_as_asked_and_auto_sides_follow_the_engine(mem, tiny_gguf):
    _, out, _ = mem(tiny_gguf, "--context", "100", "--kv-dtype", "float16", "--json")
    half = json.loads(out)
    assert half["kv_dtype"] == "float16" and half["kv_bytes_per_token"] == 3 * 2 * 2 * 32 * 2
    assert not any(note.startswith("KV sized in") for note in half["notes"])  # the user chose: nothing to explain
    _, out, _ = mem(tiny_gguf, "--context", "100", "--cache-type-k", "q8_0", "--json")
    mixed = json.loads(out)  # keys as asked, values in the engine's own float32
    assert mixed["kv_dtype"] == "q8_0:float32"
    assert mixed["kv_bytes_per_token"] == 3 * 2 * (34 + 32 * 4)
    assert mixed["notes"][0].startswith("KV sized in q8_0:float32")


def test_a_bare_config_keeps_its_own_dtype(mem):
    """No weights, nothing `kvlab run` could load: "auto" is the config's dtype, as before."""
    _, out, _ = mem("qwen3-0.6b", "--context", "512", "--json")
    data = json.loads(out)
    assert data["kv_dtype"] == "bfloat16" and data["kv_bytes_per_token"] == 114_688
    assert not any(note.startswith("KV sized in") for note in data["notes"])
