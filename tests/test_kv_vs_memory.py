"""`kvlab mem`'s figures against the caches the engine really allocates, byte for byte."""

from __future__ import annotations

import pytest
import torch

from kvlab.kv.cache import ContiguousKVCache
from kvlab.memory import kv_bytes, kv_bytes_per_token, load_config
from tiny import build_tiny

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "llama-tied"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_tiny_model_caches_match_the_calculator(tmp_path, kind, dtype):
    directory = build_tiny(kind, tmp_path)
    config = load_config(directory)
    for tokens, batch in [(1, 1), (77, 1), (512, 3)]:
        cache = ContiguousKVCache.for_model(config, tokens, batch_size=batch, dtype=DTYPES[dtype])
        assert kv_bytes(config, context=tokens, batch=batch, kv_dtype=dtype) == cache.nbytes()
    assert kv_bytes_per_token(config, kv_dtype=dtype) == cache.bytes_per_token()


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-coder-0.5b-instruct"])
def test_bundled_configs_match_an_allocated_cache(name):
    """The seeds' models, with their real shapes, on the meta device (no memory is touched)."""
    config = load_config(name)
    cache = ContiguousKVCache.for_model(config, 512, dtype=torch.bfloat16, device="meta")
    assert kv_bytes(config, context=512, kv_dtype="bfloat16") == cache.nbytes()
    if name == "qwen3-0.6b":  # seed 000: 29,360,128 numbers for 512 tokens, 112 KiB per token
        assert cache.numel() == 29_360_128 and cache.bytes_per_token() == 114_688


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_real_gguf_cache_matches_the_calculator(real_model, name):
    path = real_model(name)
    config = load_config(path)
    cache = ContiguousKVCache.for_model(config, 1024, dtype=torch.float32, device="meta")
    assert kv_bytes(config, context=1024, kv_dtype="float32") == cache.nbytes()
