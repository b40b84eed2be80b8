"""One description of a model: `kvlab mem` and the engine read the same ModelConfig, and agree on every fact.

For every bundled config the engine can build, the model is made on the meta device (no memory) and
its modules are compared with the description the calculator sizes; the ones it cannot build are
refused in one line that names why. The real GGUF files are loaded for real (marked `real`).
"""

from __future__ import annotations

import pytest
import torch

from kvlab.config import MLA, GatedDeltaNet, MoE, bundled_names, load_config
from kvlab.errors import KvlabError
from kvlab.kv.cache import ContiguousKVCache
from kvlab.kv.layout import KVLayout
from kvlab.memory import count_params, kv_bytes, kv_bytes_per_token, weight_bytes, window_bytes_per_token
from kvlab.model.registry import architecture_of
from kvlab.model.experts import Experts
from kvlab.model.deltanet import GatedDeltaNet as DeltaNet
from kvlab.model.mla import MLAttention
from kvlab.model.layers import Vector
from kvlab.model.transformer import Transformer


def model_facts(model: Transformer) -> list[tuple]:
    """What the built model holds, layer by layer: heads, kv heads, head size, biases, q/k norm, MLP size."""
    return [
        (layer.attn.num_v_heads, layer.attn.num_k_heads, layer.attn.k_dim, layer.attn.v_dim, layer.attn.kernel,
         layer.mlp.intermediate_size) if isinstance(layer.attn, DeltaNet) else  # a hybrid's recurrent layer
        (layer.attn.num_heads, layer.attn.rank, layer.attn.rope_dim, layer.attn.v_dim,
         getattr(getattr(layer.attn, "q_a_proj", None), "out_features", None),
         layer.mlp.intermediate_size) if isinstance(layer.attn, MLAttention) else  # DeepSeek's latent attention
        (layer.attn.num_heads, layer.attn.num_kv_heads, layer.attn.head_dim, layer.attn.qkv_proj.bias is not None,
         layer.attn.q_norm is not None, layer.mlp.intermediate_size)  # an MoE block's: one expert's width
        for layer in model.layers
    ]  # fmt: skip


def config_facts(config) -> list[tuple]:
    return [
        (*((m.num_value_heads, m.num_key_heads, m.key_head_dim, m.value_head_dim, m.conv_kernel)
           if isinstance(m, GatedDeltaNet) else
           (m.num_heads, m.kv_lora_rank, m.qk_rope_head_dim, m.v_head_dim, m.q_lora_rank) if isinstance(m, MLA) else
           (m.num_heads, m.kv_heads, m.head_dim, m.qkv_bias, m.qk_norm)),
         layer.mlp.expert_size if isinstance(layer.mlp, MoE) else layer.mlp.intermediate_size)
        for layer in config.layers
        for m in [layer.mixer]
    ]


def held_params(model: Transformer) -> int:
    """Weights the model computes with, counted from its layers (float or packed): each matrix once."""
    total, seen = 0, set()
    for m in model.weight_modules():
        key = id(m.weight_tensors()[0])
        if key in seen:  # a tied LM head: the embedding's own table
            continue
        seen.add(key)
        if isinstance(m, (Experts, Vector)):  # every expert, not the top_k a token multiplies with
            total += sum(t.numel() for t in m.weight_tensors())
        elif hasattr(m, "macs_per_token"):
            total += m.macs_per_token + (m.bias.numel() if m.bias is not None else 0)
        elif hasattr(m, "shape"):  # a packed embedding
            total += m.shape[0] * m.shape[1]
        else:
            total += m.weight.numel()
    return total


def check_agreement(config, model: Transformer) -> None:
    assert model_facts(model) == config_facts(config)
    embed, head = model.embed_tokens, model.lm_head
    assert tuple(getattr(embed, "shape", None) or embed.weight.shape) == (config.vocab_size, config.hidden_size)
    assert (head.weight_tensors()[0] is embed.weight_tensors()[0]) == config.tie_word_embeddings
    assert held_params(model) == count_params(config).total  # the calculator's parameter count
    cache = ContiguousKVCache.for_model(config, 64, dtype=torch.bfloat16, device="meta")
    assert cache.nbytes() == kv_bytes(config, 64, kv_dtype="bfloat16")
    # the contiguous cache keeps every token of every layer: the growing layers' and the sliding layers' cost
    assert cache.bytes_per_token() == kv_bytes_per_token(config, "bfloat16") + window_bytes_per_token(config, "bfloat16")


@pytest.mark.parametrize("name", bundled_names())
def test_every_bundled_config_is_built_as_the_calculator_describes_it_or_refused(name):
    config = load_config(name)
    try:
        architecture_of(config)
    except KvlabError as e:  # an architecture or layer kind the decoder does not compute
        assert "\n" not in str(e) and ("unsupported architecture" in str(e) or "cannot run yet" in str(e))
        return
    with torch.device("meta"):
        model = Transformer(config, max_positions=1)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # what loading does
    check_agreement(config, model)


def test_a_sliding_window_llama_runs_with_its_window():
    config = load_config({"model_type": "mistral", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "sliding_window": 4096, "max_position_embeddings": 8192})  # fmt: skip
    assert architecture_of(config).family == "llama"
    layout = KVLayout.for_model(config)  # every layer slides: one KV group, which frees what the window left
    assert [(g.window, g.layers) for g in layout.groups] == [(4096, (0, 1))]


def test_gemma3_layers_carry_their_own_window_and_rotary_base():
    config = load_config("gemma-3-27b")
    kinds = [(layer.mixer.window, layer.mixer.rope.theta if layer.mixer.rope else None) for layer in config.layers]
    assert kinds[:6] == [(1024, 10_000.0)] * 5 + [(None, None)]
    assert config.rope.theta == 1_000_000.0 and config.rope.type == "linear" and config.rope.factor == 8.0
    assert {layer.mlp.activation for layer in config.layers} == {"gelu_pytorch_tanh"}


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_the_real_gguf_files_load_as_the_calculator_describes_them(real_model, name):
    from kvlab.model.loader import load_model

    path = real_model(name)
    config = load_config(path)
    loaded = load_model(path)
    assert loaded.config == config  # the very same description, from the same reader
    check_agreement(config, loaded.model)
    if loaded.weight_format.endswith("(as stored)"):  # blocks kept: the bytes held are the file's, as kvlab mem says
        assert loaded.weight_bytes == weight_bytes(config).bytes
