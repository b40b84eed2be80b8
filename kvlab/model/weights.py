"""Checkpoint tensors → the model's parameters.

Every source is first read as Hugging Face tensor names (GGUF names are translated), then mapped
onto our modules, where q/k/v and gate/up are fused into one matrix each. Weights load only from
safetensors or GGUF: never from pickle files, which can run code.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from kvlab.config import ModelConfig
from kvlab.errors import KvlabError
from kvlab.gguf_file import GGUFFile

# GGUF tensor names → Hugging Face names ({i} = layer index)
_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

# Hugging Face names (after "model.layers.{i}.") → (our parameter, part index within a fused matrix)
_LAYER_TO_OURS = {
    "input_layernorm.weight": ("input_norm.weight", None),
    "post_attention_layernorm.weight": ("post_attn_norm.weight", None),
    "self_attn.q_proj.weight": ("attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("attn.qkv_proj.weight", 2),
    "self_attn.q_proj.bias": ("attn.qkv_proj.bias", 0),
    "self_attn.k_proj.bias": ("attn.qkv_proj.bias", 1),
    "self_attn.v_proj.bias": ("attn.qkv_proj.bias", 2),
    "self_attn.o_proj.weight": ("attn.o_proj.weight", None),
    "self_attn.q_norm.weight": ("attn.q_norm.weight", None),
    "self_attn.k_norm.weight": ("attn.k_norm.weight", None),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
    "mlp.down_proj.weight": ("mlp.down_proj.weight", None),
}
_TOP_TO_OURS = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_FUSED_PARTS = {"attn.qkv_proj": 3, "mlp.gate_up_proj": 2}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def to_our_name(hf_name: str) -> tuple[str, int | None] | None:
    """Hugging Face tensor name → (our parameter name, fused part index), None if unused."""
    if hf_name in _TOP_TO_OURS:
        return _TOP_TO_OURS[hf_name], None
    match = _LAYER_RE.fullmatch(hf_name)
    if match and match.group(2) in _LAYER_TO_OURS:
        ours, part = _LAYER_TO_OURS[match.group(2)]
        return f"layers.{match.group(1)}.{ours}", part
    return None


# ---- sources ------------------------------------------------------------------------------


def iter_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) from model.safetensors or a sharded index."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / s for s in shards]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in directory.glob("*.bin")] + [p.name for p in directory.glob("*.pt")]
        hint = f" (found {pickles[0]}: pickle checkpoints are refused, convert to safetensors)" if pickles else ""
        raise KvlabError(f"no .safetensors weights in {directory}{hint}")
    for file in files:
        if not file.is_file():
            raise KvlabError(f"weight shard {file.name} listed in the index is missing from {directory}")
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _unpermute_llama(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows (interleaved rotary pairs → rotate-half halves)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf(gguf: GGUFFile, config: ModelConfig, permuted_qk: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor of a GGUF file, dequantized.

    `permuted_qk`: the converter reordered q/k rows for its own rotary layout (llama.cpp's llama)."""
    for name in gguf.tensors:
        rest = name
        if name.startswith("blk."):
            _, index, rest = name.split(".", 2)
            template = _GGUF_TO_HF.get(rest)
            hf_name = template.format(i=index) if template else None
        else:
            hf_name = _GGUF_TO_HF.get(name)
        if hf_name is None:
            continue  # e.g. rope_freqs: recomputed from the config
        w = gguf.dequantize(name)
        if permuted_qk and rest in ("attn_q.weight", "attn_k.weight"):
            heads = config.num_heads if rest == "attn_q.weight" else config.num_kv_heads
            w = _unpermute_llama(w, heads)
        yield hf_name, torch.from_numpy(np.array(w, dtype=np.float32))  # a copy: the file map is read-only


# ---- loading into the model --------------------------------------------------------------


def load_weights(model: torch.nn.Module, tensors: Iterator[tuple[str, torch.Tensor]], dtype, device) -> None:
    """Fill every parameter of `model` (built on the meta device) from (HF name, tensor) pairs."""
    params = dict(model.named_parameters())
    pending: dict[str, dict[int, torch.Tensor]] = {}  # fused parameter → parts seen so far
    loaded: set[str] = set()

    def assign(name: str, tensor: torch.Tensor) -> None:
        expected = params[name].shape
        if tuple(tensor.shape) != tuple(expected):
            raise KvlabError(f"weight {name} has shape {tuple(tensor.shape)}, the config implies {tuple(expected)}")
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, attr, torch.nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False))
        loaded.add(name)

    for hf_name, tensor in tensors:
        target = to_our_name(hf_name)
        if target is None:
            continue
        name, part = target
        if name not in params:
            continue
        if part is None:
            assign(name, tensor)
            continue
        parts = pending.setdefault(name, {})
        parts[part] = tensor
        if len(parts) == _FUSED_PARTS[name.split(".", 2)[2].rsplit(".", 1)[0]]:
            assign(name, torch.cat([parts[i] for i in range(len(parts))], dim=0))
            del pending[name]

    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # tied: one matrix serves both
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise KvlabError(f"checkpoint has no tensor for {missing[0]} ({len(missing)} missing)")
