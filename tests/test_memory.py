"""kvlab.memory: the seeds' figures, every bundled config checked by hand, weights, fits, pairs.

Expected numbers are written out from the config files by hand in the comments, never computed by
the code under test.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from kvlab.errors import KvlabError
from kvlab.memory import (
    bundled_names, count_params, kv_bytes, kv_bytes_per_token, load_config, pairs_with_cache,
    pairs_without_cache, params_bytes, state_bytes, weight_bytes, window_bytes_per_token,
)
from kvlab.memory.fit import Query, estimate, total_bytes, workspace_bytes
from kvlab.memory.units import GIB, KIB, kv_dtype_bits, parse_size, weight_format_bits

BUNDLED = [
    "deepseek-v3", "gemma-3-27b", "gpt-oss-20b", "nemotron-h-56b", "qwen2.5-0.5b", "qwen2.5-72b",
    "qwen2.5-7b", "qwen2.5-coder-0.5b-instruct", "qwen3-0.6b", "qwen3-next-80b-a3b", "qwen3.5-35b-a3b",
    "qwen3.5-9b",
]


def llama_like(layers: int, heads: int, kv_heads: int, hidden: int, **extra) -> dict:
    """A plain decoder config, for the seed-004 examples and generic checks."""
    return {"model_type": "llama", "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "hidden_size": hidden, "intermediate_size": 4 * hidden,
            "vocab_size": 32000, "torch_dtype": "bfloat16", **extra}


# --------------------------------------------------------------------------- the seeds' figures

def test_qwen3_06b_seed_figures():
    spec = load_config("qwen3-0.6b")
    # 28 layers x 2 (K, V) x 8 KV heads x 128 (explicit head_dim, not 1024/16) x 2 bytes
    assert kv_bytes_per_token(spec, "bfloat16") == 114_688 == 112 * KIB
    # the K tensor of each layer is [1, 8, 512, 128]: 28 x 2 x 8 x 512 x 128 numbers
    assert kv_bytes(spec, 512, 1, "bfloat16") == 29_360_128 * 2
    assert kv_bytes(spec, 512, 1, "float32") == 29_360_128 * 4
    # 40,960 tokens: 114,688 x 40,960 = 4,697,620,480 B = 4.70 GB
    assert kv_bytes(spec, 40_960) == 4_697_620_480
    assert round(4_697_620_480 / 1e9, 2) == 4.70


@pytest.mark.parametrize("name, kib", [("qwen2.5-0.5b", 12), ("qwen2.5-7b", 56), ("qwen2.5-72b", 320)])
def test_qwen25_seed_kib_per_token(name, kib):
    assert kv_bytes_per_token(load_config(name), "bfloat16") == kib * KIB


def test_qwen25_72b_at_32k_is_10_gib():
    assert kv_bytes(load_config("qwen2.5-72b"), 32_768) == 10 * GIB


def test_deepseek_v3_mla_numbers_per_token():
    spec = load_config("deepseek-v3")
    # one latent (kv_lora_rank 512) + one shared RoPE key (64) per token per layer, 61 layers, no V
    assert kv_bytes_per_token(spec, "bfloat16") == 61 * (512 + 64) * 2
    assert kv_bytes_per_token(spec, "fp8") == 61 * (512 + 64)
    # the config's num_nextn_predict_layers = 1 adds one more MLA layer when MTP is used
    assert len(spec.mtp_layers) == 1
    assert kv_bytes_per_token(spec.with_mtp(), "bfloat16") == 62 * (512 + 64) * 2


@pytest.mark.parametrize("kv_heads, context, gib", [(8, 8192, 1), (8, 65536, 8), (32, 8192, 4), (32, 65536, 32)])
def test_seed_004_examples(kv_heads, context, gib):
    # 2 x L=32 x B=1 x S x Hkv x D=128 x b=2
    spec = load_config(llama_like(32, 32, kv_heads, 4096))
    assert kv_bytes(spec, context, 1, "bfloat16") == gib * GIB


def test_seed_004_weights_35b():
    assert params_bytes(35_000_000_000, "4") == 17_500_000_000
    assert round(params_bytes(35_000_000_000, "4") / GIB, 2) == 16.30
    assert params_bytes(35_000_000_000, "float16") == 70_000_000_000
    assert round(params_bytes(35_000_000_000, "fp16") / GIB, 2) == 65.19


def test_seed_004_pairs():
    assert pairs_with_cache(6, 2) == 36  # 21 + 7 + 8
    assert pairs_without_cache(6, 2) == 85  # 21 + 28 + 36


@pytest.mark.parametrize("n, m", [(0, 1), (1, 0), (3, 4), (10, 10), (100, 7)])
def test_pairs_formulas_match_counting(n, m):
    with_cache = sum(p for p in range(1, n + m + 1))  # every position attends to itself and all before
    without = sum(p * (p + 1) // 2 for p in ([n] if n else []) + list(range(n + 1, n + m + 1)))
    assert pairs_with_cache(n, m) == with_cache == n * (n + 1) // 2 + m * n + m * (m + 1) // 2
    assert pairs_without_cache(n, m) == without


# ------------------------------------------------------------- every bundled config, by hand

def test_every_bundled_config_is_listed():
    assert bundled_names() == BUNDLED


# (name, growing bytes/token, sliding bytes/token, window, state bytes/sequence), all bf16
HAND_CHECKED = [
    # 28 full layers x 2 x 8 kv x 128 head_dim x 2 B
    ("qwen3-0.6b", 114_688, 0, None, 0),
    # 24 x 2 x 2 kv x (896/14 = 64) x 2; sliding_window 32768 is off (use_sliding_window false)
    ("qwen2.5-0.5b", 12_288, 0, None, 0),
    ("qwen2.5-coder-0.5b-instruct", 12_288, 0, None, 0),
    # 28 x 2 x 4 x (3584/28 = 128) x 2
    ("qwen2.5-7b", 57_344, 0, None, 0),
    # 80 x 2 x 8 x (8192/64 = 128) x 2
    ("qwen2.5-72b", 327_680, 0, None, 0),
    # 61 MLA layers x (512 + 64) x 2
    ("deepseek-v3", 70_272, 0, None, 0),
    # layer_types: 12 full + 12 sliding(128); each 2 x 8 kv x 64 head_dim x 2 = 2,048 B per token
    ("gpt-oss-20b", 12 * 2_048, 12 * 2_048, 128, 0),
    # text_config: 62 layers, pattern 6 (class default) -> 10 global + 52 local(1024);
    # each 2 x 16 kv x 128 x 2 = 8,192 B per token
    ("gemma-3-27b", 10 * 8_192, 52 * 8_192, 1024, 0),
    # full_attention_interval 4 -> 12 full + 36 Gated DeltaNet; full: 2 x 2 kv x 256 x 2 = 2,048 B.
    # state per linear layer: conv (2*16*128 + 32*128 = 8,192 channels) x (4 - 1) = 24,576 numbers,
    # SSM 32 v-heads x 128 x 128 = 524,288 numbers; all bf16: 1,097,728 B
    ("qwen3-next-80b-a3b", 12 * 2_048, 0, None, 36 * 1_097_728),
    # layer_types: 8 full (2 x 4 kv x 256 x 2 = 4,096 B) + 24 linear; same state shapes but
    # mamba_ssm_dtype float32: 24,576 x 2 + 524,288 x 4 = 2,146,304 B per linear layer
    ("qwen3.5-9b", 8 * 4_096, 0, None, 24 * 2_146_304),
    # 10 full (2 x 2 kv x 256 x 2 = 2,048 B) + 30 linear at 2,146,304 B
    ("qwen3.5-35b-a3b", 10 * 2_048, 0, None, 30 * 2_146_304),
    # pattern: 54 M, 54 -, 10 *; attention 2 x 8 kv x 128 (attention_head_dim) x 2 = 4,096 B.
    # Mamba-2: d_inner 256 x 64 = 16,384; conv (16,384 + 2 x 8 x 256) x 3 = 61,440 numbers;
    # SSM 256 x 64 x 256 = 4,194,304 numbers; bf16: 8,511,488 B per Mamba layer
    ("nemotron-h-56b", 10 * 4_096, 0, None, 54 * 8_511_488),
]


@pytest.mark.parametrize("name, growing, sliding, window, state", HAND_CHECKED, ids=[h[0] for h in HAND_CHECKED])
def test_bundled_config_by_hand(name, growing, sliding, window, state):
    spec = load_config(name)
    assert kv_bytes_per_token(spec, "bfloat16") == growing
    assert window_bytes_per_token(spec, "bfloat16") == sliding
    assert state_bytes(spec) == state
    # one token: every layer holds it; a long context: sliding layers hold only their window
    assert kv_bytes(spec, 1) == growing + sliding
    long = 100_000
    assert kv_bytes(spec, long) == growing * long + sliding * min(long, window or long)


def test_hand_checked_covers_every_bundled_config():
    assert sorted(h[0] for h in HAND_CHECKED) == BUNDLED


def test_gpt_oss_at_full_context():
    # 24,576 x 131,072 + 3 MiB of sliding cache = 3,224,371,200 B
    assert kv_bytes(load_config("gpt-oss-20b"), 131_072) == 3_224_371_200


def test_gemma3_class_defaults_are_noted():
    spec = load_config("gemma-3-27b")
    assert spec.max_position_embeddings == 131_072
    assert [i for i, layer in enumerate(spec.layers) if layer.label == "full_attention"] == list(range(5, 62, 6))
    assert any("class default" in note for note in spec.notes)


def test_state_dtype_override():
    spec = load_config("qwen3.5-9b")
    # everything in bf16: (24,576 + 524,288) x 2 B per layer, 24 layers
    assert state_bytes(spec, 1, state_dtype="bfloat16") == 24 * 1_097_728
    assert state_bytes(spec, 3) == 3 * 24 * 2_146_304


def test_kv_dtypes_scale_the_cache():
    spec = load_config("qwen3-0.6b")
    assert kv_bytes_per_token(spec, "float32") == 2 * 114_688
    assert kv_bytes_per_token(spec, "fp8") == kv_bytes_per_token(spec, "int8") == 114_688 // 2
    assert kv_bytes_per_token(spec, "int4") == 114_688 // 4
    assert kv_bytes_per_token(spec, "torch.float16") == 114_688
    assert kv_bytes_per_token(spec, "auto") == 114_688  # the model's own dtype, bfloat16
    with pytest.raises(KvlabError, match="unknown KV dtype"):
        kv_bytes_per_token(spec, "int3")


def test_batch_multiplies_and_windows_cap():
    spec = load_config("gpt-oss-20b")
    assert kv_bytes(spec, 1000, 4) == 4 * kv_bytes(spec, 1000, 1)
    assert kv_bytes(spec, 100) == 100 * 24 * 2_048  # under the window every layer grows
    assert kv_bytes(spec, 129) - kv_bytes(spec, 128) == 12 * 2_048  # past it only full layers do


@pytest.mark.parametrize("context, batch", [(0, 1), (-5, 1), (10, 0), (2**41, 1), (10, -1)])
def test_absurd_sizes_refused(context, batch):
    with pytest.raises(KvlabError, match="out of range"):
        kv_bytes(load_config("qwen3-0.6b"), context, batch)


# ------------------------------------------------------------------------ weights and formats

@pytest.mark.parametrize("fmt, bits", [
    ("float32", 32), ("bfloat16", 16), ("float16", 16), ("fp8", 8), ("int8", 8),
    ("int4", Fraction(33, 8)),  # group 128 with an fp16 scale: 4 + 16/128 = 4.125
    ("mxfp4", Fraction(17, 4)),  # 32 values + one 8-bit scale: 4.25
    ("q8_0", Fraction(17, 2)), ("q4_0", Fraction(9, 2)), ("q4_1", 5), ("q4_k", Fraction(9, 2)),
    ("q5_0", Fraction(11, 2)), ("q5_k", Fraction(11, 2)), ("q6_k", Fraction(105, 16)), ("4.5", Fraction(9, 2)),
])
def test_weight_format_bits(fmt, bits):
    assert weight_format_bits(fmt) == bits


def test_gguf_bits_agree_with_gguf_package():
    gguf = pytest.importorskip("gguf")
    for name in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_K", "Q6_K"):
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
        assert weight_format_bits(name) == Fraction(size * 8, block)


def test_gguf_mixes_are_refused():
    with pytest.raises(KvlabError, match="mix"):
        weight_format_bits("Q4_K_M")


def test_param_counts():
    # Qwen2.5-0.5B: 24 x 14,912,384 per layer + 151,936 x 896 tied embedding + 896 final norm
    assert count_params(load_config("qwen2.5-0.5b")).total == 494_032_768
    # Qwen3-0.6B, tied: 596,049,920 (transformers' own count on the meta device)
    assert count_params(load_config("qwen3-0.6b")).total == 596_049_920
    # gpt-oss-20b: 20.9B in total, 3.6B active (OpenAI's figures)
    params = count_params(load_config("gpt-oss-20b"))
    assert params.total == 20_914_757_184
    assert round(params.active / 1e9, 1) == 3.6
    # DeepSeek-V3: 671B in total, about 37B active
    params = count_params(load_config("deepseek-v3"))
    assert round(params.total / 1e9) == 671
    assert 36e9 < params.active < 38e9


def test_weight_bytes_formats():
    spec = load_config("qwen2.5-0.5b")
    params = count_params(spec)
    assert weight_bytes(spec).bytes == params.total * 2  # bfloat16 as the config says
    q4k = weight_bytes(spec, "q4_k")
    # matrices at 4.5 bits, 1-D vectors (norms, biases) at 16
    assert q4k.bytes == math.ceil(((params.total - params.vectors) * Fraction(9, 2) + params.vectors * 16) / 8)
    assert not q4k.exact


def test_checkpoint_quantization_from_config():
    params = count_params(load_config("gpt-oss-20b"))
    w = weight_bytes(load_config("gpt-oss-20b"))  # MXFP4 experts (4.25 bits), the rest bf16
    assert w.bytes == math.ceil((params.experts * Fraction(17, 4) + (params.total - params.experts) * 16) / 8)
    assert round(w.bytes / 1e9, 1) == 13.8  # the size of the published checkpoint


# ------------------------------------------------------------------------------ totals and fit

def test_workspace_formula_qwen3():
    # 2,048 tokens x (2 x 1,024 hidden + widest 2 x 3,072 gate/up) x 2 B + 151,936 logits x 4 B
    assert workspace_bytes(load_config("qwen3-0.6b"), 40_960, 1) == 2048 * (2048 + 6144) * 2 + 151_936 * 4


@pytest.mark.parametrize("name, context", [("qwen3-0.6b", 40_960), ("gpt-oss-20b", 4096), ("qwen3.5-9b", 65_536),
                                           ("nemotron-h-56b", 8192)])
def test_max_batch_and_context_are_tight(name, context):
    spec = load_config(name)
    q = Query(context=context, batch=2, device_bytes=parse_size("141GiB"), utilization=0.9)
    r = estimate(spec, q)
    usable, w = r.usable_bytes, r.weight_bytes
    assert total_bytes(spec, r.query, w, context, r.max_batch) <= usable
    assert total_bytes(spec, r.query, w, context, r.max_batch + 1) > usable
    assert total_bytes(spec, r.query, w, r.max_context, 2) <= usable
    assert total_bytes(spec, r.query, w, r.max_context + 1, 2) > usable
    assert r.fits == (r.total_bytes <= usable)


def test_sliding_only_model_has_unbounded_context():
    spec = load_config(llama_like(4, 8, 2, 512, model_type="mistral", sliding_window=4096))
    r = estimate(spec, Query(context=8192, device_bytes=parse_size("80GiB")))
    assert r.context_unbounded and r.max_context is None
    assert r.kv_bytes_per_token == 0 and r.window_bytes_per_token == 4 * 2 * 2 * 64 * 2


def test_report_json_has_the_required_keys():
    r = estimate(load_config("qwen3.5-9b"), Query(context=1000, batch=2))
    j = r.to_json()
    for key in ("kv_bytes_per_token", "kv_bytes", "state_bytes", "weight_bytes", "total_bytes", "layer_kinds"):
        assert key in j
    assert j["kv_bytes"] == 2 * 1000 * 32_768
    assert j["state_bytes"] == 2 * 24 * 2_146_304
    assert j["total_bytes"] == j["kv_bytes"] + j["state_bytes"] + j["weight_bytes"] + j["workspace_bytes"]
    kinds = {k["label"]: k for k in j["layer_kinds"]}
    assert kinds["full_attention"]["num_layers"] == 8 and kinds["linear_attention"]["num_layers"] == 24


def test_units():
    assert parse_size("80GiB") == 80 * GIB
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("1.5 TiB") == 3 * 2**39
    assert kv_dtype_bits("bf16") == 16
    for bad in ("80", "80 gigs", "-1GiB", "0GB", "2000TiB"):
        with pytest.raises(KvlabError):
            parse_size(bad)
