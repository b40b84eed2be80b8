"""kvlab.memory on files: safetensors headers (single and sharded), GGUF metadata, the real SmolLM2 GGUF."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvlab.errors import KvlabError
from kvlab.memory import count_params, kv_bytes, kv_bytes_per_token, load_config, weight_bytes

CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "hidden_size": 64, "intermediate_size": 128, "vocab_size": 100, "torch_dtype": "bfloat16",
          "max_position_embeddings": 512}


def save_safetensors(path, tensors: dict) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path))


def test_hf_directory_exact_bytes_from_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    tensors = {"a": np.zeros((64, 100), np.float16), "b": np.zeros((64,), np.float32), "c": np.zeros((3, 5), np.int8)}
    save_safetensors(tmp_path / "model.safetensors", tensors)
    spec = load_config(tmp_path)
    w = weight_bytes(spec)
    assert w.exact
    assert w.bytes == 64 * 100 * 2 + 64 * 4 + 15  # the tensors' own bytes, header excluded
    assert spec.file_weights.num_elements == 6400 + 64 + 15
    assert dict(spec.file_weights.bytes_by_type) == {"F16": 12_800, "F32": 256, "I8": 15}
    assert spec.file_weights.file_bytes == (tmp_path / "model.safetensors").stat().st_size
    # 2 layers x 2 x 2 kv x 16 head_dim x 2 B
    assert kv_bytes_per_token(spec, "bfloat16") == 256
    # an explicit format ignores the file and counts the architecture
    assert not weight_bytes(spec, "q8_0").exact


def test_sharded_index(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    save_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": np.zeros((10, 10), np.float32)})
    save_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"b": np.zeros((7,), np.float16)})
    index = {"metadata": {"total_size": 414},
             "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weight_bytes(load_config(tmp_path)).bytes == 400 + 14
    # a single shard named on the command line stands for its directory
    assert weight_bytes(load_config(tmp_path / "model-00002-of-00002.safetensors")).bytes == 414
    # shards not downloaded: the index's total_size is still exact
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    assert weight_bytes(load_config(tmp_path)).bytes == 414


def test_directory_without_config(tmp_path):
    with pytest.raises(KvlabError, match="no config.json"):
        load_config(tmp_path)


def test_broken_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(KvlabError, match="safetensors"):
        load_config(tmp_path)


def write_gguf(path, arch: str, layers: int, window: int | None = None) -> int:
    """A small GGUF with real tensors; returns the sum of the tensors' bytes."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(32)
    writer.add_value_length(32)
    writer.add_context_length(2048)
    if window:
        writer.add_sliding_window(window)
    arrays = {"token_embd.weight": np.ones((100, 64), np.float16), "output_norm.weight": np.ones(64, np.float32)}
    for i in range(layers):
        arrays[f"blk.{i}.attn_q.weight"] = np.ones((128, 64), np.float16)
        arrays[f"blk.{i}.attn_norm.weight"] = np.ones(64, np.float32)
    for name, array in arrays.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sum(a.nbytes for a in arrays.values())


def test_gguf_metadata_and_exact_bytes(tmp_path):
    path = tmp_path / "tiny.gguf"
    tensor_bytes = write_gguf(path, "llama", layers=3)
    spec = load_config(path)
    assert spec.architecture == "llama" and spec.num_layers == 3 and spec.max_position_embeddings == 2048
    # explicit key_length 32 (not 64/4 = 16): 3 layers x 2 x 2 kv x 32 x 2 B (f16, llama.cpp's default)
    assert kv_bytes_per_token(spec, "auto") == 768
    w = weight_bytes(spec)
    assert w.exact and w.bytes == tensor_bytes
    params = count_params(spec)
    assert params.embedding == 6400 and params.lm_head == 0 and spec.tie_word_embeddings
    assert params.vectors == 64 * 4 and params.dense == 3 * 128 * 64


def test_gguf_gemma3_sliding_pattern(tmp_path):
    path = tmp_path / "gemma.gguf"
    write_gguf(path, "gemma3", layers=12, window=16)
    spec = load_config(path)
    # llama.cpp's Gemma 3 pattern: every 6th layer global -> layers 5 and 11
    assert [i for i, layer in enumerate(spec.layers) if layer.label == "full_attention"] == [5, 11]
    per_layer = 2 * 2 * 32 * 2
    assert kv_bytes(spec, 1000, 1, "float16") == 2 * per_layer * 1000 + 10 * per_layer * 16


def test_not_a_gguf(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"GGUF but not really")
    with pytest.raises(KvlabError, match="not a valid GGUF|is truncated"):  # its magic, then a header cut short
        load_config(path)


@pytest.mark.real
def test_real_smollm2_gguf(real_model):
    gguf = pytest.importorskip("gguf")
    path = real_model("smollm2-135m")
    assert path.stat().st_size == 98_362_432
    reader = gguf.GGUFReader(str(path))
    spec = load_config(path)
    w = weight_bytes(spec)
    assert w.exact
    assert w.bytes == sum(int(t.n_bytes) for t in reader.tensors)
    assert spec.file_weights.file_bytes == 98_362_432
    assert spec.file_weights.num_elements == sum(int(t.n_elements) for t in reader.tensors)
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 576/9 = 64; f16 cache: 30 x 2 x 3 x 64 x 2 B
    assert kv_bytes_per_token(spec, "float16") == 23_040
