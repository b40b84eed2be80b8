"""Which path runs a decode step (kvlab/backends): chosen once at load, said when it is not the C step,
and asserted here for every model kind, every KV format and a tensor-parallel shard (tests/tp_worker.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine
from kvlab.kernels.decode import library
from kvlab.kv.formats import KV_FORMATS
from kvlab.model.loader import load_model
from tiny import add_tiny_tokenizer, build_tiny, build_tiny_gguf

pytestmark = pytest.mark.skipif(not library(), reason="no C compiler: the decode backend is not built")
REGISTRY = ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"]


def path_of(loaded, kv: str, **config):
    engine = LLMEngine(loaded, None, EngineConfig(kv_memory_bytes=1 << 24, kv_cache_dtype=kv, **config))
    return engine.decode_path


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3", "llama-q4_0.gguf", "gemma3-q8_0.gguf"])
def tiny_model(request, tmp_path_factory):
    kind, _, quant = request.param.partition("-")
    directory = build_tiny(kind, tmp_path_factory.mktemp(kind), head_dim=32)
    if quant:  # a GGUF file's own blocks, as the registry models are held (the converter wants a tokenizer)
        add_tiny_tokenizer(directory)
        return load_model(build_tiny_gguf(directory, directory / "m.gguf", quant.removesuffix(".gguf").upper()))
    return load_model(directory)


@pytest.mark.parametrize("kv", sorted(KV_FORMATS))
def test_every_model_kind_and_kv_format_takes_the_c_step(tiny_model, kv):
    path = path_of(tiny_model, kv)
    assert (path.name, path.reason) == ("cpu-c", None)


def test_a_model_off_the_c_step_says_why(tmp_path):
    directory = build_tiny("llama", tmp_path, head_dim=32)
    path = path_of(load_model(directory, dtype="bfloat16"), "auto")
    assert path.backend is None and "bfloat16" in path.reason and "float32" in path.reason
    loaded = load_model(directory)
    loaded.model.set_attention("materialized")  # the lab's attention: the modules run it
    path = path_of(loaded, "auto")
    assert path.name == "modules" and "materialized" in path.reason


def test_run_says_the_path_in_json_and_the_footer_only_when_it_is_off(tmp_path):
    directory = build_tiny("llama", tmp_path, head_dim=32)
    add_tiny_tokenizer(directory)
    run = [sys.executable, "-m", "kvlab", "run", str(directory), "hi", "--max-tokens", "3", "--ignore-eos"]
    fast = json.loads(subprocess.run(run + ["--json"], capture_output=True, text=True, timeout=300).stdout)
    assert (fast["decode_path"], fast["decode_path_reason"]) == ("cpu-c", None)
    slow = subprocess.run(run + ["--dtype", "bfloat16"], capture_output=True, text=True, timeout=300)
    assert slow.returncode == 0, slow.stderr
    line = [x for x in slow.stderr.splitlines() if x.startswith("decode ")]
    assert len(line) == 1 and "not the C step" in line[0] and "bfloat16" in line[0], slow.stderr


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("name", REGISTRY)
def test_every_registry_model_takes_the_c_step_with_every_kv_format(real_model, name):
    loaded = load_model(real_model(name), max_positions=4096)
    for kv in sorted(KV_FORMATS):
        path = path_of(loaded, kv, max_model_len=128)
        assert (path.name, path.reason) == ("cpu-c", None), (name, kv)


def test_show_names_the_path_from_the_description_alone(tmp_path):
    from kvlab.backends import C_STEP_ACTIVATIONS, expected_decode_path
    from kvlab.config import load_config
    from kvlab.kernels.decode import activation_ids

    assert set(C_STEP_ACTIVATIONS) == set(activation_ids())  # the list show uses is decode.c's own
    for kind in ("llama", "gemma3"):
        assert expected_decode_path(load_config(build_tiny(kind, tmp_path / kind, head_dim=32))).reason is None
    assert expected_decode_path(load_config("qwen3.5-35b-a3b")).name == "cpu-c"  # Gated DeltaNet + MoE
    for name in ("deepseek-v3", "nemotron-h-56b"):  # MLA, Mamba
        path = expected_decode_path(load_config(name))
        assert path.backend is None and path.reason.startswith("layer "), name
