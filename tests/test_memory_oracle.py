"""kvlab.memory against transformers: real cache tensors of tiny random models, and parameter counts.

transformers is the oracle here (a dev dependency). Where its cache deliberately differs from the
intrinsic figure, the difference is the documented one (docs/memory.md):
  - a sliding layer keeps window - 1 tokens between steps (the new token makes `window` inside a step);
  - a linear-attention / Mamba-2 conv state keeps `kernel` inputs, where `kernel - 1` are needed.
"""

from __future__ import annotations

import json

import pytest

from kvlab.memory import count_params, kv_bytes, load_config, state_bytes, state_numbers
from kvlab.memory.kv import numbers_per_token, window_of
from kvlab.config import bundled_dir

pytestmark = pytest.mark.slow  # about 20 s: builds tiny transformers models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              num_hidden_layers=4)


def tiny(kind: str):
    """A tiny config of each architecture with a cache worth checking."""
    t = transformers
    return {
        "llama": lambda: t.LlamaConfig(**COMMON),
        "qwen2": lambda: t.Qwen2Config(**COMMON),
        "qwen3": lambda: t.Qwen3Config(**COMMON, head_dim=32),  # head_dim != hidden / heads
        "mistral": lambda: t.MistralConfig(**COMMON, sliding_window=8),
        "gemma3_text": lambda: t.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 7}, head_dim=16, sliding_window=8),
        "gpt_oss": lambda: t.GptOssConfig(**COMMON, head_dim=16, sliding_window=8, num_local_experts=4,
                                          num_experts_per_tok=2),
        "qwen3_next": lambda: t.Qwen3NextConfig(
            **COMMON, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=32),
        "nemotron_h": lambda: t.NemotronHConfig(
            **{k: v for k, v in COMMON.items() if k != "num_hidden_layers"}, head_dim=16,
            hybrid_override_pattern="M-*M", mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2,
            conv_kernel=4),
    }[kind]()


def run_cache(config, batch: int, tokens: int, dtype=torch.float32):
    """Prefill `tokens` random tokens for `batch` sequences; return the cache transformers kept."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with torch.no_grad():
        out = model(torch.randint(0, config.vocab_size, (batch, tokens)), use_cache=True)
    return out.past_key_values


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def kv_tensor_bytes(cache) -> int:
    return sum(tensor_bytes([getattr(layer, "keys", None), getattr(layer, "values", None)]) for layer in cache.layers)


def state_tensor_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name, None)
            if isinstance(states, dict):
                total += tensor_bytes(states.values())
    return total


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("batch, tokens, dtype", [(1, 7, torch.float32), (3, 20, torch.bfloat16)])
def test_full_attention_cache_is_exact(kind, batch, tokens, dtype):
    config = tiny(kind)
    cache = run_cache(config, batch, tokens, dtype)
    assert kv_tensor_bytes(cache) == kv_bytes(load_config(config.to_dict()), tokens, batch, dtype)


@pytest.mark.parametrize("kind", ["mistral", "gemma3_text", "gpt_oss"])
def test_sliding_window_cache(kind):
    config = tiny(kind)
    spec = load_config(config.to_dict())
    assert any(window_of(layer.mixer) == 8 for layer in spec.layers)
    # under the window every layer holds every token
    assert kv_tensor_bytes(run_cache(config, 2, 6)) == kv_bytes(spec, 6, 2, "float32")
    # past it transformers keeps window - 1 tokens per sliding layer between steps
    sliding = sum(numbers_per_token(layer.mixer) for layer in spec.layers if window_of(layer.mixer))
    assert kv_tensor_bytes(run_cache(config, 2, 20)) == kv_bytes(spec, 20, 2, "float32") - 2 * sliding * 4


@pytest.mark.parametrize("kind", ["qwen3_next", "nemotron_h"])
def test_constant_state_shapes(kind):
    config = tiny(kind)
    spec = load_config(config.to_dict())
    cache = run_cache(config, 2, 9)
    assert kv_tensor_bytes(cache) == kv_bytes(spec, 9, 2, "float32")
    # transformers keeps one more conv input (kernel instead of kernel - 1) per channel
    conv_channels = sum(state_numbers(layer.mixer)[0] // (layer.mixer.conv_kernel - 1)
                        for layer in spec.layers if state_numbers(layer.mixer)[0])
    assert state_tensor_bytes(cache) == state_bytes(spec, 2, "float32") + 2 * conv_channels * 4
    assert state_tensor_bytes(run_cache(config, 2, 30)) == state_tensor_bytes(cache)  # constant in length


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen2.5-0.5b", "gpt-oss-20b", "gemma-3-27b", "qwen3-next-80b-a3b",
                                  "qwen3.5-9b", "qwen3.5-35b-a3b", "nemotron-h-56b", "deepseek-v3"])
def test_param_count_matches_transformers(name):
    raw = json.loads((bundled_dir() / f"{name}.json").read_text())
    text = raw.get("text_config")
    config = transformers.AutoConfig.for_model(**(text or raw))
    if text is not None:
        config.tie_word_embeddings = raw.get("tie_word_embeddings", config.tie_word_embeddings)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    theirs = sum(p.numel() for p in model.parameters())
    ours = count_params(load_config(name)).total
    # DeepSeek-V3's routing correction bias (256 per MoE layer, 58 layers) is a buffer in transformers
    # but a tensor of the checkpoint; we count it
    assert ours - theirs == (58 * 256 if name == "deepseek-v3" else 0)
