"""DeepSeek-V3's real config: the paged cache the engine allocates holds what `kvlab mem` counts, and the lab
shows the latent cache beside plain multi-head attention of its 128 heads (the course, seed 000: "about 70×")."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvlab.config import MLA, load_config
from kvlab.config.hf import config_from_hf
from kvlab.kv.formats import KVFormats
from kvlab.kv.paged import PagedKVCache
from kvlab.lab import kv_latent, kv_verify
from kvlab.memory import kv_bytes, kv_bytes_per_token
from kvlab.model.registry import architecture_of

SHARED = "/work/shared/model-configs/deepseek-ai--DeepSeek-V3.json"


def real_configs():
    """The bundled config, and the shared copy of DeepSeek's own config.json where this checkout has one."""
    configs = [load_config("deepseek-v3")]
    try:
        with open(SHARED) as f:
            configs.append(config_from_hf(json.load(f), name="DeepSeek-V3", source=SHARED))
    except FileNotFoundError:
        pass
    return configs


@pytest.mark.parametrize("kv", ["bfloat16", "float32", "q8_0", "fp8_e4m3"])
def test_a_shortened_deepseek_v3_cache_holds_what_kvlab_mem_counts(kv):
    """2 layers of real widths (kv_lora_rank 512, rope 64), allocated uninitialised (pages never touched)."""
    for config in real_configs():
        short = dataclasses.replace(config, layers=config.layers[:2])
        formats = KVFormats.resolve(kv, model_dtype=torch.bfloat16)
        cache = PagedKVCache.for_model(short, 2, 16, torch.bfloat16, formats=formats)
        assert cache.bytes_per_token() == kv_bytes_per_token(short, kv) == PagedKVCache.bytes_per_token_for(
            short, torch.bfloat16, formats)  # fmt: skip
        assert cache.nbytes() == kv_bytes(short, 32, kv_dtype=kv)  # 2 blocks of 16 tokens
        per_layer = {"bfloat16": 576 * 2, "float32": 576 * 4, "q8_0": 18 * 34, "fp8_e4m3": 576 + 4}[kv]
        assert cache.bytes_per_token() == 2 * per_layer


def test_the_whole_deepseek_v3_is_61_latents_per_token_and_the_registry_takes_it():
    for config in real_configs():
        assert all(isinstance(layer.mixer, MLA) for layer in config.layers) and config.num_layers == 61
        assert kv_bytes_per_token(config, "bfloat16") == 61 * (512 + 64) * 2
        cache = PagedKVCache.for_model(config, 1, 16, torch.bfloat16, device="meta")
        assert cache.bytes_per_token() == 70_272
        assert architecture_of(config).family == "deepseek_v3"


def test_kv_verify_shows_the_latent_cache_about_70_times_smaller_than_full_heads():
    latent = kv_latent.compare()
    assert (latent.layers, latent.heads, latent.latent_numbers, latent.mha_numbers) == (61, 128, 576, 128 * 320)
    assert latent.equal and latent.mla_bytes_per_token == 70_272 and latent.mha_bytes_per_token == 4_997_120
    assert round(latent.ratio, 1) == 71.1
    data = dataclasses.asdict(latent)
    text = kv_latent.table(data)
    assert "71.1×" in text and "about 70×" in text and "4,997,120" in text
    verdict = kv_verify.verdict({"exact": True, "context": 16, "seed_models": [], "latent": data,
                                 "checks": [{"what": "numbers", "measured": 1, "equal": True}]})  # fmt: skip
    assert "71.1× more" in verdict


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_deepseek_v3s_576_number_latent_rotates_and_round_trips(kv):
    """576 = 9 × 64: the Hadamard rotation works on blocks of 64 (the largest power of two dividing it), and the
    rotated q8_0 / q4_0 latent decodes back to the vector within the format's rounding; outliers are spread."""
    formats = KVFormats.resolve(kv, model_dtype=torch.float32)
    assert formats.rotate_k
    x = torch.randn(4, 1, 576, generator=torch.Generator().manual_seed(0))
    x[..., 7] = 40.0  # one large channel, as latents have: rotation keeps it from drowning its block
    back = formats.k.decode(formats.k.encode(x), torch.float32)
    plain = KVFormats.resolve(kv, model_dtype=torch.float32, rotation="off").k
    unrotated = plain.decode(plain.encode(x), torch.float32)
    error, error_unrotated = (back - x).norm() / x.norm(), (unrotated - x).norm() / x.norm()
    assert error < {"q8_0": 0.01, "q4_0": 0.15}[kv] and error < error_unrotated
