"""GGUF file -> ModelConfig: geometry from the metadata, exact weight bytes from the tensor infos.

The one reader of GGUF metadata (the file itself is parsed once, by `kvlab.gguf_file.GGUFFile`).
Keys are llama.cpp's, prefixed by the architecture (`llama.block_count`, ...). Per-layer arrays
(`head_count_kv` with 0 for recurrent layers) are honoured; biases, q/k norms and norms per block
are read off the tensors each block has. llama.cpp keeps the KV cache in f16 by default and every
recurrent state in f32, so those are the description's defaults here.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path

from kvlab.config.layers import MLA, Attention, DenseMLP, GatedDeltaNet, Layer, Mamba2, MoE
from kvlab.config.model import FileWeights, ModelConfig, ParamCounts
from kvlab.config.rope import RopeConfig, rope_from_gguf
from kvlab.errors import KvlabError
from kvlab.gguf_file import GGUFFile

# llama.cpp hard-codes these interleavings: layer i is sliding unless i % period == period - 1
SWA_PERIODS = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2, "cohere2": 4}
GATED_DELTANET_ARCHS = {"qwen3next", "qwen35", "qwen35moe"}  # other ssm_* blocks are Mamba-2
GELU_ARCHS = {"gemma", "gemma2", "gemma3"}  # their MLPs gate with tanh-approximated GELU, the rest with SiLU
SWA_ROPE_BASE = {"gemma3": 10_000.0}  # sliding layers' rotary base where the file has no freq_base_swa
# llama.cpp's Gemma converter adds 1 to every norm weight (Gemma computes x̂ · (1 + w)): applied as x̂ · w
NORM_SHIFTED_ARCHS = GELU_ARCHS
_BLOCK_NORMS = ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm")
# llama.cpp's expert_gating_func ids → MoE.routing (2, sigmoid, is DeepSeek-V3's: kept so it can be refused by name)
_GATING = {1: "softmax_topk", 2: "sigmoid_topk", 3: "topk_softmax"}
# what llama.cpp's graph hard-codes where the file has no expert_gating_func / expert_weights_norm
_DEFAULT_ROUTING = {"gpt-oss": "topk_softmax"}
_NORMALISED_TOP_K = {"qwen3moe", "mixtral", "llama4"}  # llama.cpp renormalises the top-k weights of these


def config_from_gguf(gguf: GGUFFile, *, name: str | None = None) -> ModelConfig:
    """Read an open .gguf file's metadata and tensor infos into a ModelConfig with exact weight bytes."""
    path = gguf.path
    meta = _Meta(gguf.metadata, path)
    arch = meta.str("general.architecture")
    n = meta.int(f"{arch}.block_count")
    tensors = gguf.tensors
    # multi-token-prediction blocks (DeepSeek-V3's, GLM's, Qwen3.5's): block_count counts them, last, and
    # their tensors are blk.N.nextn.*; they are kept out of the trunk (and so of the KV pool), and reported
    num_mtp = mtp_block_count(gguf.metadata, arch, tensors, n)
    n -= num_mtp
    recurrent = {int(t.split(".")[1]) for t in tensors if t.startswith("blk.") and ".ssm_" in t}
    rope = rope_from_gguf(gguf.metadata, arch)
    if arch in GATED_DELTANET_ARCHS:  # partial rotary: rope.dimension_count of each head's key_length channels
        rotated, key = meta.int(f"{arch}.rope.dimension_count", required=False), meta.int(f"{arch}.attention.key_length")
        rope = dataclasses.replace(rope, partial_rotary_factor=rotated / key if rotated else 1.0)
    layers = tuple(_layer(meta, arch, i, i in recurrent, tensors) for i in range(n))
    mtp_layers = tuple(dataclasses.replace(_layer(meta, arch, i, False, tensors), mtp=True)
                       for i in range(n, n + num_mtp))  # fmt: skip
    weights = _file_weights(gguf, meta, arch)
    vocab = meta.int(f"{arch}.vocab_size", required=False)
    if "token_embd.weight" in tensors:  # rows of the embedding: the model's vocabulary
        vocab = tensors["token_embd.weight"].shape[0]
    elif vocab is None and isinstance(gguf.metadata.get("tokenizer.ggml.tokens"), list):
        vocab = len(gguf.metadata["tokenizer.ggml.tokens"])
    has_state = any(isinstance(layer.mixer, (GatedDeltaNet, Mamba2)) for layer in layers)
    eps = gguf.metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    hidden = meta.int(f"{arch}.embedding_length")
    softcap = gguf.metadata.get(f"{arch}.final_logit_softcapping")
    bos, eos = gguf.metadata.get("tokenizer.ggml.bos_token_id"), gguf.metadata.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        hidden_size=hidden,
        vocab_size=vocab,
        layers=tuple(_with_rope(layer, arch, gguf.metadata, rope) for layer in layers),
        tie_word_embeddings="output.weight" not in tensors,
        max_position_embeddings=meta.int(f"{arch}.context_length", required=False),
        rms_norm_eps=float(eps),
        rope=rope,
        embedding_scale=hidden**0.5 if arch in NORM_SHIFTED_ARCHS else None,  # llama.cpp scales Gemmas' embeddings
        norm_offset=0.0 if arch in NORM_SHIFTED_ARCHS else None,
        final_logit_softcap=float(softcap) if isinstance(softcap, (int, float)) and softcap > 0 else None,
        dtype="float16",  # llama.cpp's default cache type
        state_dtype="float32" if has_state else None,  # llama.cpp keeps recurrent states in f32
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        name=name or path.stem,
        source=str(path),
        file_weights=weights,
        mtp_layers=tuple(_with_rope(layer, arch, gguf.metadata, rope) for layer in mtp_layers),
    )


def mtp_block_count(metadata: dict, arch: str, tensors, block_count: int) -> int:
    """MTP blocks at the end of block_count: `{arch}.nextn_predict_layers`, or the blocks holding nextn tensors."""
    n = metadata.get(f"{arch}.nextn_predict_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        n = len({t.split(".")[1] for t in tensors if t.startswith("blk.") and ".nextn." in t})
    return min(n, max(block_count - 1, 0))


def _with_rope(layer: Layer, arch: str, metadata: dict, rope: RopeConfig) -> Layer:
    """Sliding layers of architectures whose windowed layers rotate with a base of their own."""
    mixer = layer.mixer
    if not isinstance(mixer, Attention) or not mixer.window or arch not in SWA_ROPE_BASE:
        return layer
    base = float(metadata.get(f"{arch}.rope.freq_base_swa", SWA_ROPE_BASE[arch]))
    return dataclasses.replace(layer, mixer=dataclasses.replace(mixer, rope=RopeConfig(theta=base)))


def _attention_scale(meta: _Meta, arch: str, heads: int, head_dim: int) -> float | None:
    """llama.cpp scales Gemma 3's q·k by 1/√head_dim, except for the 27B (62 blocks): 1/√(hidden / heads),
    which is its query_pre_attn_scalar of 168; None means 1/√head_dim."""
    if arch != "gemma3" or meta.int(f"{arch}.block_count") != 62:
        return None
    return (meta.int(f"{arch}.embedding_length") / heads) ** -0.5


class _Meta:
    """Typed access to GGUF metadata; a missing key is a one-line KvlabError naming it."""

    def __init__(self, metadata: dict, path: Path):
        self.fields, self.path = metadata, path

    def value(self, key: str):
        return self.fields.get(key)

    def str(self, key: str) -> str:
        value = self.value(key)
        if not isinstance(value, str):
            raise KvlabError(f"{self.path}: GGUF metadata has no '{key}'")
        return value

    def int(self, key: str, required: bool = True, layer: int | None = None) -> int | None:
        value = self.value(key)
        if isinstance(value, list) and layer is not None:  # per-layer array
            value = value[layer] if layer < len(value) else None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            if required:
                raise KvlabError(f"{self.path}: GGUF metadata has no '{key}', needed for the memory count")
            return None
        if value < (1 if required else 0) or value > 2**40:
            raise KvlabError(f"{self.path}: GGUF metadata '{key}' = {value} is out of range")
        return int(value)


def _layer(meta: _Meta, arch: str, i: int, recurrent: bool, tensors: dict) -> Layer:
    """Block i: recurrent when it has ssm_* tensors, attention when it has KV heads, else MLP only."""
    heads = meta.int(f"{arch}.attention.head_count", required=False, layer=i) or 0
    kv_heads = meta.int(f"{arch}.attention.head_count_kv", required=False, layer=i)
    kv_heads = heads if kv_heads is None else kv_heads
    has = lambda part: f"blk.{i}.{part}" in tensors  # noqa: E731
    mixer = _recurrent(meta, arch) if recurrent else _attention(meta, arch, i, heads, kv_heads, has, tensors)
    mlp = _mlp(meta, arch, i, has, tensors)
    norms = sum(has(f"{norm}.weight") for norm in _BLOCK_NORMS) or 2
    return Layer(mixer=mixer, mlp=mlp, norms=norms)


def _attention(meta: _Meta, arch: str, i: int, heads: int, kv_heads: int, has, tensors: dict):
    if kv_heads == 0 or heads == 0:
        return None
    rank = meta.int(f"{arch}.attention.kv_lora_rank", required=False)
    if rank:
        rope = meta.int(f"{arch}.rope.dimension_count")
        key = (meta.int(f"{arch}.attention.key_length_mla", required=False)
               or meta.int(f"{arch}.attention.key_length"))
        value = (meta.int(f"{arch}.attention.value_length_mla", required=False)
                 or meta.int(f"{arch}.attention.value_length"))
        return MLA(num_heads=heads, kv_lora_rank=rank, qk_rope_head_dim=rope, qk_nope_head_dim=key - rope,
                   v_head_dim=value, q_lora_rank=meta.int(f"{arch}.attention.q_lora_rank", required=False) or None)
    hidden = meta.int(f"{arch}.embedding_length")
    key = meta.int(f"{arch}.attention.key_length", required=False) or hidden // heads
    value = meta.int(f"{arch}.attention.value_length", required=False) or key
    q_norm = tensors.get(f"blk.{i}.attn_q_norm.weight")
    return Attention(num_heads=heads, kv_heads=kv_heads, head_dim=key, v_head_dim=value,
                     window=_window(meta, arch, i), qkv_bias=has("attn_q.bias"), o_bias=has("attn_output.bias"),
                     qk_norm=q_norm is not None, qk_norm_whole=q_norm is not None and q_norm.shape[0] != key,
                     sinks=has("attn_sinks.weight"), scale=_attention_scale(meta, arch, heads, key),
                     output_gate=arch in GATED_DELTANET_ARCHS)  # Qwen3.5 / Qwen3-Next: attn_q holds a gate per head  # fmt: skip


def _window(meta: _Meta, arch: str, i: int) -> int | None:
    window = meta.int(f"{arch}.attention.sliding_window", required=False)
    if not window:
        return None
    pattern = meta.value(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag per layer: True = sliding
        return window if i < len(pattern) and pattern[i] else None
    period = int(pattern) if isinstance(pattern, (int, float)) and pattern else SWA_PERIODS.get(arch)
    if period is None:
        return window  # every layer slides (Mistral-style)
    return window if i % period < period - 1 else None


def _recurrent(meta: _Meta, arch: str):
    kernel = meta.int(f"{arch}.ssm.conv_kernel")
    inner = meta.int(f"{arch}.ssm.inner_size")
    state = meta.int(f"{arch}.ssm.state_size")
    groups = meta.int(f"{arch}.ssm.group_count", required=False) or 1
    heads = meta.int(f"{arch}.ssm.time_step_rank")
    if arch in GATED_DELTANET_ARCHS:  # llama.cpp maps k heads to groups, v heads to dt rank
        return GatedDeltaNet(num_key_heads=groups, num_value_heads=heads, key_head_dim=state,
                             value_head_dim=inner // heads, conv_kernel=kernel)
    return Mamba2(num_heads=heads, head_dim=inner // heads, state_size=state, n_groups=groups, conv_kernel=kernel)


def _mlp(meta: _Meta, arch: str, i: int, has, tensors: dict):
    experts = meta.int(f"{arch}.expert_count", required=False)
    leading_dense = meta.int(f"{arch}.leading_dense_block_count", required=False) or 0
    sparse = has("ffn_gate_inp.weight") if any(t.startswith("blk.") for t in tensors) else i >= leading_dense
    if experts and sparse:  # a block with a router; without tensors (a header-only read), after the dense lead
        return _moe(meta, arch, i, experts, has, tensors)
    size = meta.int(f"{arch}.feed_forward_length", required=False, layer=i)
    activation = "gelu_pytorch_tanh" if arch in GELU_ARCHS else "silu"
    return DenseMLP(size, activation=activation) if size else None


def _moe(meta: _Meta, arch: str, i: int, experts: int, has, tensors: dict) -> MoE:
    """Block i's mixture of experts, from llama.cpp's keys and the block's tensors."""
    gating = meta.int(f"{arch}.expert_gating_func", required=False)
    routing = _GATING.get(gating, f"gating function {gating}") if gating else _DEFAULT_ROUTING.get(arch, "softmax_topk")
    norm = meta.value(f"{arch}.expert_weights_norm")
    shared = meta.int(f"{arch}.expert_shared_feed_forward_length", required=False)
    shexp = tensors.get(f"blk.{i}.ffn_up_shexp.weight")
    if shexp is not None and not shared:
        shared = shexp.shape[0]
    gpt_oss = arch == "gpt-oss"
    return MoE(
        num_experts=experts,
        top_k=meta.int(f"{arch}.expert_used_count"),
        expert_size=meta.int(f"{arch}.expert_feed_forward_length", required=False)
        or meta.int(f"{arch}.feed_forward_length", layer=i),
        shared_size=shared or 0 if shexp is not None else 0,
        shared_gate=has("ffn_gate_inp_shexp.weight"),
        router_bias=has("ffn_gate_inp.bias"),
        expert_bias=has("ffn_down_exps.bias"),
        score_bias=has("exp_probs_b.bias") or has("exp_probs_b"),
        routing=routing,
        norm_topk_prob=bool(norm) if isinstance(norm, bool) else arch in _NORMALISED_TOP_K,
        activation="clamped_swiglu" if gpt_oss else "silu",
        swiglu_limit=7.0 if gpt_oss else None,  # llama.cpp's gpt-oss graph: limit 7, alpha 1.702
        swiglu_alpha=1.702 if gpt_oss else None,
        num_groups=meta.int(f"{arch}.expert_group_count", required=False) or 1,  # DeepSeek-V3's n_group
        top_k_groups=meta.int(f"{arch}.expert_group_used_count", required=False) or 1,
        routed_scaling_factor=_positive(meta.value(f"{arch}.expert_weights_scale"), 1.0),
    )


def _positive(value, default: float) -> float:
    """A positive number from the metadata, else `default` (llama.cpp writes 0 or nothing for "unset")."""
    number_like = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if number_like and value > 0 else default


def _file_weights(gguf: GGUFFile, meta: _Meta, arch: str) -> FileWeights:
    """Exact tensor bytes by GGUF type, and parameters by role from the tensor names."""
    by_type: dict[str, int] = defaultdict(int)
    roles: dict[str, int] = defaultdict(int)
    for t in gguf.tensors.values():
        by_type[t.type_name] += t.nbytes
        roles[_role(t.name, len(t.shape))] += t.num_elements
    experts = meta.int(f"{arch}.expert_count", required=False)
    used = meta.int(f"{arch}.expert_used_count", required=False)
    params = ParamCounts(
        embedding=roles["embedding"], lm_head=roles["lm_head"], dense=roles["dense"],
        experts=roles["experts"], experts_active=roles["experts"] * used // experts if experts and used else 0,
        routers=roles["routers"], vectors=roles["vectors"],
    )
    return FileWeights(
        path=str(gguf.path),
        tensor_bytes=sum(by_type.values()),
        num_elements=sum(roles.values()),
        bytes_by_type=tuple(sorted(by_type.items(), key=lambda kv: -kv[1])),
        file_bytes=gguf.path.stat().st_size,
        params=params,
    )


def _role(name: str, ndim: int) -> str:
    """What a GGUF tensor is, from llama.cpp's naming (blk.N.ffn_up_exps.weight, token_embd.weight...)."""
    if name.startswith("token_embd."):
        return "embedding"
    if name.startswith("output."):
        return "lm_head" if name.endswith(".weight") and ndim == 2 else "vectors"
    if "_exps." in name:
        return "experts"
    if "ffn_gate_inp" in name:
        return "routers"
    if ndim == 1 or "ssm_conv1d" in name or name.endswith((".ssm_a", ".ssm_d")):
        return "vectors"
    return "dense"
