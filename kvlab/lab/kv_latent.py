"""kv-verify's latent section: DeepSeek-V3's cache as the engine allocates it, against the same model with plain
multi-head attention.

The course (seed 000): "MLA stores one compressed latent per token: DeepSeek-V3 needs 61 × (512 + 64) numbers
per token. Plain multi-head attention with 128 full heads would need about 70× more." Both paged caches are allocated
(a few blocks, uninitialised: the pages are never touched) from the bundled config: the MLA model's, one latent
of kv_lora_rank + qk_rope_head_dim numbers per token and layer, and its twin whose every layer is softmax
attention with 128 KV heads of (qk_nope + qk_rope) key and v_head_dim value numbers, which is what MLA's
up-projection rebuilds per head. Their bytes per token are measured from the tensors, set beside `kvlab mem`'s,
and divided.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvlab.config import MLA, Attention, ModelConfig
from kvlab.kv.paged import PagedKVCache
from kvlab.lab.sources import COURSE
from kvlab.memory import kv_bytes_per_token, load_config

LATENT_MODEL = "deepseek-v3"
SEED_RATIO = 70  # "about 70× more"
NUM_BLOCKS, BLOCK_SIZE = 2, 16


@dataclass
class LatentComparison:
    model: str
    layers: int
    heads: int
    latent_numbers: int  # per token and layer: kv_lora_rank + qk_rope_head_dim
    mha_numbers: int  # per token and layer: heads × (K + V head sizes)
    mla_bytes_per_token: int  # the allocated paged cache's, bfloat16
    mha_bytes_per_token: int
    mla_calculator: int  # kvlab.memory's for the same configs
    mha_calculator: int
    ratio: float  # mha / mla, measured
    equal: bool  # measured == calculator for both


def with_full_heads(config: ModelConfig) -> ModelConfig:
    """The same model with every MLA layer as plain multi-head attention: one K (nope + rope) and one V per head."""
    layers = []
    for layer in config.layers:
        m = layer.mixer
        if isinstance(m, MLA):
            m = Attention(num_heads=m.num_heads, kv_heads=m.num_heads, head_dim=m.qk_nope_head_dim + m.qk_rope_head_dim,
                          v_head_dim=m.v_head_dim)  # fmt: skip
        layers.append(dataclasses.replace(layer, mixer=m))
    return dataclasses.replace(config, layers=tuple(layers), name=f"{config.name} (full MHA)")


def compare(name: str = LATENT_MODEL, device: str = "cpu") -> LatentComparison:
    """Allocate both caches (NUM_BLOCKS blocks of BLOCK_SIZE tokens, bfloat16) and measure bytes per token."""
    mla = load_config(name)
    mha = with_full_heads(mla)
    caches = [PagedKVCache.for_model(c, NUM_BLOCKS, BLOCK_SIZE, torch.bfloat16, device) for c in (mla, mha)]
    measured = [cache.bytes_per_token() for cache in caches]
    calculated = [kv_bytes_per_token(c, "bfloat16") for c in (mla, mha)]
    latent = next(layer.mixer for layer in mla.layers if isinstance(layer.mixer, MLA))
    return LatentComparison(
        model=name, layers=mla.num_layers, heads=latent.num_heads,
        latent_numbers=latent.kv_lora_rank + latent.qk_rope_head_dim,
        mha_numbers=mha.num_kv_heads * (mha.head_dim + mha.attention.v_head_dim),
        mla_bytes_per_token=measured[0], mha_bytes_per_token=measured[1],
        mla_calculator=calculated[0], mha_calculator=calculated[1],
        ratio=measured[1] / measured[0], equal=measured == calculated,
    )  # fmt: skip


def table(latent: dict) -> str:
    from kvlab.lab.report import md_table, num

    rows = [
        ["multi-head latent attention (the engine's cache)", num(latent["latent_numbers"]),
         num(latent["mla_bytes_per_token"]), num(latent["mla_calculator"])],
        [f"plain multi-head attention, {latent['heads']} full heads", num(latent["mha_numbers"]),
         num(latent["mha_bytes_per_token"]), num(latent["mha_calculator"])],
    ]  # fmt: skip
    head = [f"{latent['model']}, {latent['layers']} layers, bfloat16", "numbers per token and layer",
            "allocated bytes per token", "kvlab mem"]  # fmt: skip
    ratio = (f"Measured ratio: {latent['ratio']:.1f}× ({COURSE.short}: \"about {SEED_RATIO}×\"); allocated and "
             f"calculated bytes {'agree' if latent['equal'] else '**disagree**'}.")  # fmt: skip
    return md_table(head, rows) + "\n\n" + ratio
