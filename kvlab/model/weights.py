"""Checkpoint tensors → the model's parameters.

Every source is first read as Hugging Face tensor names (GGUF names are translated), then mapped
onto our modules, where q/k/v and gate/up are fused into one matrix each. Weights load only from
safetensors or GGUF: never from pickle files, which can run code.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from kvlab.config import ModelConfig
from kvlab.errors import KvlabError
from kvlab.gguf_file import GGUFFile
from kvlab.quant.formats import FORMATS
from kvlab.quant.linear import PackedEmbedding, PackedLinear, PackedTensor

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
# Gemma's four norms per block: llama.cpp's ffn_norm is the MLP's input norm there too, but
# transformers calls it pre_feedforward_layernorm (post_attention_layernorm normalises the attention's output)
_GGUF_TO_HF_SANDWICH = {
    **_GGUF_TO_HF,
    "post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}

# Hugging Face names (after "model.layers.{i}.") → (our parameter, part index within a fused matrix)
_LAYER_TO_OURS = {
    "input_layernorm.weight": ("input_norm.weight", None),
    "post_attention_layernorm.weight": ("post_attn_norm.weight", None),
    "pre_feedforward_layernorm.weight": ("pre_mlp_norm.weight", None),
    "post_feedforward_layernorm.weight": ("post_mlp_norm.weight", None),
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


def iter_gguf(
    gguf: GGUFFile, config: ModelConfig, permuted_qk: bool, native: bool = True
) -> Iterator[tuple[str, torch.Tensor | PackedTensor]]:
    """(Hugging Face name, tensor) for every tensor of a GGUF file.

    `native`: every matrix not in F32 comes as a PackedTensor of the file's own bytes (memory-mapped,
    no copy, no float round trip); vectors (norms, biases) and F32 matrices as float32 tensors. Otherwise every tensor is
    dequantized to float32. `permuted_qk`: the converter reordered q/k rows for its own rotary layout
    (llama.cpp's llama), undone here — on the blocks' rows, which is exact.
    """
    names = _GGUF_TO_HF_SANDWICH if any(layer.norms == 4 for layer in config.layers) else _GGUF_TO_HF
    for name, info in gguf.tensors.items():
        rest = name
        if name.startswith("blk."):
            _, index, rest = name.split(".", 2)
            if int(index) >= config.num_layers:  # an MTP block (config.mtp_layers): not part of the trunk
                continue
            template = names.get(rest)
            hf_name = template.format(i=index) if template else None
        else:
            hf_name = names.get(name)
        if hf_name is None:
            continue  # e.g. rope_freqs: recomputed from the config
        heads = None
        if permuted_qk and rest in ("attn_q.weight", "attn_k.weight"):
            heads = config.num_heads if rest == "attn_q.weight" else config.num_kv_heads
        if native and len(info.shape) == 2 and info.type_name != "F32":  # F32 is float already
            yield hf_name, _packed(gguf, name, heads)
            continue
        w = gguf.dequantize(name)
        if heads:
            w = _unpermute_llama(w, heads)
        yield hf_name, torch.from_numpy(np.array(w, dtype=np.float32))  # a copy: the file map is read-only


def _packed(gguf: GGUFFile, name: str, heads: int | None) -> PackedTensor:
    """A matrix's blocks as stored, viewed in place in the file's memory map (rows reordered: a copy)."""
    info = gguf.tensors[name]
    if info.type_name not in FORMATS:
        hint = " or --dequantize to expand it to floats at load" if _can_dequantize(info.type_name) else ""
        raise KvlabError(f"tensor {name} is stored as {info.type_name}, a GGUF block type kvlab cannot compute "
                         f"with: use a file quantized to one of {', '.join(FORMATS)}{hint}")  # fmt: skip
    raw = gguf.raw(name)  # uint8 [rows, row bytes], read-only
    if heads:
        raw = np.ascontiguousarray(_unpermute_llama(raw, heads))
    with warnings.catch_warnings():  # the map is read-only and kvlab never writes to weights
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        data = torch.from_numpy(raw)
    return PackedTensor(info.type_name, tuple(info.shape), data)


def _can_dequantize(type_name: str) -> bool:
    from gguf import GGMLQuantizationType, quants

    try:
        quants.dequantize(np.zeros(quants.GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1], np.uint8),
                          GGMLQuantizationType[type_name])  # fmt: skip
    except (NotImplementedError, KeyError, ValueError):
        return False
    return True


# ---- loading into the model --------------------------------------------------------------


def load_weights(model: torch.nn.Module, tensors: Iterator[tuple[str, torch.Tensor | PackedTensor]], dtype,
                 device) -> None:  # fmt: skip
    """Fill every parameter of `model` (built on the meta device) from (HF name, tensor) pairs.

    A PackedTensor (a matrix kept in its stored format) replaces its Linear by a PackedLinear, or the
    embedding by a PackedEmbedding; every other tensor becomes a parameter in `dtype`.
    """
    params = dict(model.named_parameters())
    pending: dict[str, dict[int, torch.Tensor | PackedTensor]] = {}  # fused parameter → parts seen so far
    packed: dict[str, list[PackedTensor]] = {}  # module → its stored matrices, in part order
    loaded: set[str] = set()

    def assign(name: str, value: torch.Tensor | list[PackedTensor]) -> None:
        expected = tuple(params[name].shape)
        module_name, _, attr = name.rpartition(".")
        if isinstance(value, list):
            shape = (sum(p.shape[0] for p in value), value[0].shape[1])
            packed[module_name] = [PackedTensor(p.fmt, p.shape, p.data.to(device)) for p in value]
        else:
            shape = tuple(value.shape)
            setattr(model.get_submodule(module_name), attr,
                    torch.nn.Parameter(value.to(device=device, dtype=dtype), requires_grad=False))  # fmt: skip
        if shape != expected:
            raise KvlabError(f"weight {name} has shape {shape}, the config implies {expected}")
        loaded.add(name)

    for hf_name, tensor in tensors:
        target = to_our_name(hf_name)
        if target is None:
            continue
        name, part = target
        if name not in params:
            continue
        if part is None:
            assign(name, [tensor] if isinstance(tensor, PackedTensor) else tensor)
            continue
        parts = pending.setdefault(name, {})
        parts[part] = tensor
        if len(parts) == _FUSED_PARTS[name.split(".", 2)[2].rsplit(".", 1)[0]]:
            values = [parts[i] for i in range(len(parts))]
            if all(isinstance(v, PackedTensor) for v in values):
                assign(name, values)
            else:
                assign(name, torch.cat([v.dequantize() if isinstance(v, PackedTensor) else v for v in values]))
            del pending[name]

    _install_packed(model, packed, dtype)
    if model.config.tie_word_embeddings:
        tie_embeddings(model)
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise KvlabError(f"checkpoint has no tensor for {missing[0]} ({len(missing)} missing)")


def _install_packed(model: torch.nn.Module, packed: dict[str, list[PackedTensor]], dtype) -> None:
    """Swap each module whose matrices were kept stored for its packed form (its bias carried over)."""
    for module_name, parts in packed.items():
        parent_name, _, attr = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if module_name == "embed_tokens":
            setattr(parent, attr, PackedEmbedding(parts[0], dtype))
        else:
            setattr(parent, attr, PackedLinear(parts, bias=old.bias))


def tie_embeddings(model: torch.nn.Module) -> None:
    """The LM head reads the embedding's own matrix (one table in memory serves both)."""
    if isinstance(model.embed_tokens, PackedEmbedding):
        model.lm_head = model.embed_tokens.as_linear()
    else:
        model.lm_head.weight = model.embed_tokens.weight
