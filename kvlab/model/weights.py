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
    "post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",  # gpt-oss's MLP input norm
    "attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "attn_sinks.weight": "model.layers.{i}.self_attn.sinks",
    # a mixture of experts: the router, the experts' 3-D tensors [E, rows, in], the shared expert
    "ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",
    "ffn_gate_inp.bias": "model.layers.{i}.mlp.router.bias",
    "ffn_gate_exps.weight": "model.layers.{i}.mlp.experts.gate_exps",
    "ffn_up_exps.weight": "model.layers.{i}.mlp.experts.up_exps",
    "ffn_gate_up_exps.weight": "model.layers.{i}.mlp.experts.gate_up_proj",
    "ffn_down_exps.weight": "model.layers.{i}.mlp.experts.down_proj",
    "ffn_gate_exps.bias": "model.layers.{i}.mlp.experts.gate_exps_bias",
    "ffn_up_exps.bias": "model.layers.{i}.mlp.experts.up_exps_bias",
    "ffn_down_exps.bias": "model.layers.{i}.mlp.experts.down_proj_bias",
    "ffn_gate_shexp.weight": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
    # deepseek2: multi-head latent attention (k_b / v_b: kv_b split by llama.cpp, joined by kvlab.model.mla)
    "attn_q_a.weight": "model.layers.{i}.self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "model.layers.{i}.self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "model.layers.{i}.self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "model.layers.{i}.self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "model.layers.{i}.self_attn.kv_b_proj.weight",
    "attn_k_b.weight": "model.layers.{i}.self_attn.k_b_proj.weight",
    "attn_v_b.weight": "model.layers.{i}.self_attn.v_b_proj.weight",
    "exp_probs_b.bias": "model.layers.{i}.mlp.gate.e_score_correction_bias",
    # Gated DeltaNet (qwen35, qwen3next; kvlab.model.hybrid_weights undoes the converter's changes)
    "attn_qkv.weight": "model.layers.{i}.linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "model.layers.{i}.linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "model.layers.{i}.linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "model.layers.{i}.linear_attn.in_proj_a.weight",
    "ssm_ba.weight": "model.layers.{i}.linear_attn.in_proj_ba.weight",
    "ssm_conv1d.weight": "model.layers.{i}.linear_attn.conv1d.weight",
    "ssm_dt.bias": "model.layers.{i}.linear_attn.dt_bias",
    "ssm_a": "model.layers.{i}.linear_attn.A",  # −exp(A_log), as llama.cpp stores it
    "ssm_norm.weight": "model.layers.{i}.linear_attn.norm.weight",
    "ssm_out.weight": "model.layers.{i}.linear_attn.out_proj.weight",
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
    "self_attn.o_proj.bias": ("attn.o_proj.bias", None),
    "self_attn.sinks": ("attn.sinks.weight", None),
    # a mixture of experts (kvlab.model.moe): the router, the experts stacked, the shared expert
    "mlp.gate.weight": ("mlp.router.weight", None),
    "mlp.router.weight": ("mlp.router.weight", None),
    "mlp.router.bias": ("mlp.router.bias", None),
    "mlp.experts.gate_up_proj": ("mlp.experts.gate_up", None),  # [E, 2I, hidden]: transformers 5's fused form
    "mlp.experts.down_proj": ("mlp.experts.down", None),  # [E, hidden, I]
    "mlp.experts.gate_up_proj_bias": ("mlp.experts.gate_up_bias", None),
    "mlp.experts.down_proj_bias": ("mlp.experts.down_bias", None),
    "mlp.experts.gate_exps": ("mlp.experts.gate_up", 0),  # GGUF's gate and up apart: [E, I, hidden] each
    "mlp.experts.up_exps": ("mlp.experts.gate_up", 1),
    "mlp.experts.gate_exps_bias": ("mlp.experts.gate_up_bias", 0),  # [E, I] each
    "mlp.experts.up_exps_bias": ("mlp.experts.gate_up_bias", 1),
    "mlp.shared_expert.gate_proj.weight": ("mlp.shared_expert.gate_up_proj.weight", 0),
    "mlp.shared_expert.up_proj.weight": ("mlp.shared_expert.gate_up_proj.weight", 1),
    "mlp.shared_expert.down_proj.weight": ("mlp.shared_expert.down_proj.weight", None),
    "mlp.shared_expert_gate.weight": ("mlp.shared_expert_gate.weight", None),
    # DeepSeek-V3 (kvlab.model.mla): the latent attention's projections, the routing bias, ungated shared experts
    "self_attn.q_a_proj.weight": ("attn.q_a_proj.weight", None),
    "self_attn.q_a_layernorm.weight": ("attn.q_a_norm.weight", None),
    "self_attn.q_b_proj.weight": ("attn.q_b_proj.weight", None),
    "self_attn.kv_a_proj_with_mqa.weight": ("attn.kv_a_proj.weight", None),
    "self_attn.kv_a_layernorm.weight": ("attn.kv_a_norm.weight", None),
    "self_attn.kv_b_proj.weight": ("attn.kv_b_proj.weight", None),
    "mlp.gate.e_score_correction_bias": ("mlp.score_bias.weight", None),
    "mlp.shared_experts.gate_proj.weight": ("mlp.shared_expert.gate_up_proj.weight", 0),
    "mlp.shared_experts.up_proj.weight": ("mlp.shared_expert.gate_up_proj.weight", 1),
    "mlp.shared_experts.down_proj.weight": ("mlp.shared_expert.down_proj.weight", None),
    # Qwen3.5 / Qwen3-Next (after kvlab.model.hybrid_weights): the attention's output gate, Gated DeltaNet layers
    "self_attn.gate_proj.weight": ("attn.gate_proj.weight", None),
    "linear_attn.in_proj_qkv.weight": ("attn.in_proj.weight", 0),
    "linear_attn.in_proj_z.weight": ("attn.in_proj.weight", 1),
    "linear_attn.in_proj_b.weight": ("attn.in_proj.weight", 2),
    "linear_attn.in_proj_a.weight": ("attn.in_proj.weight", 3),
    "linear_attn.conv1d.weight": ("attn.conv.weight", None),
    "linear_attn.A_log": ("attn.A_log.weight", None),
    "linear_attn.dt_bias": ("attn.dt_bias.weight", None),
    "linear_attn.norm.weight": ("attn.norm.weight", None),
    "linear_attn.out_proj.weight": ("attn.out_proj.weight", None),
}
# one expert's own matrices (checkpoints that store a module per expert): expert e's gate and up are parts
# 2e and 2e + 1 of the stacked gate_up [E, 2I, hidden], its down part e of down [E, hidden, I]
_EXPERT_RE = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_TOP_TO_OURS = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_FUSED_PARTS = {"attn.qkv_proj.weight": 3, "attn.qkv_proj.bias": 3, "mlp.gate_up_proj.weight": 2, "attn.in_proj.weight": 4,
                "mlp.shared_expert.gate_up_proj.weight": 2}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def to_our_name(hf_name: str) -> tuple[str, int | None] | None:
    """Hugging Face tensor name → (our parameter name, fused part index), None if unused."""
    if hf_name in _TOP_TO_OURS:
        return _TOP_TO_OURS[hf_name], None
    match = _LAYER_RE.fullmatch(hf_name)
    if match and match.group(2) in _LAYER_TO_OURS:
        ours, part = _LAYER_TO_OURS[match.group(2)]
        return f"layers.{match.group(1)}.{ours}", part
    expert = _EXPERT_RE.fullmatch(match.group(2)) if match else None
    if expert:
        e, which = int(expert.group(1)), expert.group(2)
        if which == "down":
            return f"layers.{match.group(1)}.mlp.experts.down", e
        return f"layers.{match.group(1)}.mlp.experts.gate_up", 2 * e + (which == "up")
    return None


def _num_parts(name: str, shape: tuple[int, ...], part) -> int:
    """How many checkpoint tensors make our fused parameter `name` of `shape`: q/k/v 3, gate/up 2; the
    stacked experts 2 when they come stacked (GGUF's gate and up), else one per expert and matrix."""
    if ".mlp.experts." in name and len(part.shape) == len(shape):
        return 2  # gate and up, each [E, I, hidden] (or their biases [E, I])
    if name.endswith("mlp.experts.gate_up"):
        return 2 * shape[0]
    if name.endswith("mlp.experts.down"):
        return shape[0]
    return _FUSED_PARTS[name.split(".", 2)[2]]


def from_gpt_oss(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor | PackedTensor]]:
    """gpt-oss's expert layout → transformers' usual one: its fused gate_up_proj [E, hidden, 2I] holds gate
    and up interleaved column by column (gate = [..., ::2], up = [..., 1::2]) and down_proj is [E, I, hidden];
    here gate_up [E, 2I, hidden] is every expert's gate rows then its up rows, and down [E, hidden, I].

    OpenAI's own checkpoints store the experts as MXFP4 (`*_blocks` [E, out, in/32, 16], `*_scales` [E, out,
    in/32]); they stay blocks, repacked into GGML's MXFP4 (`mxfp4_from_openai`) and kept packed."""
    mx: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        if name.endswith(("_proj_blocks", "_proj_scales")):
            stem, _, kind = name.rpartition("_")
            pair = mx.setdefault(stem, {})
            pair[kind] = t
            if len(pair) == 2:
                yield stem, mxfp4_from_openai(pair["blocks"], pair["scales"], gate_up=stem.endswith("gate_up_proj"))
                del mx[stem]
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            t = t.transpose(1, 2)  # [E, 2I, hidden], rows interleaved
            t = torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()
        elif name.endswith("mlp.experts.gate_up_proj_bias"):
            t = torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            t = t.transpose(1, 2).contiguous()
        yield name, t


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
        if native and len(info.shape) in (2, 3) and info.type_name != "F32":  # F32 is float already
            yield hf_name, _packed(gguf, name, heads)
            continue
        w = gguf.dequantize(name)
        if heads:
            w = _unpermute_llama(w, heads)
        if rest == "ffn_gate_inp_shexp.weight":  # llama.cpp's [hidden]: the shared expert's gate is [1, hidden]
            w = w.reshape(1, -1)
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


def mxfp4_from_openai(blocks: torch.Tensor, scales: torch.Tensor, gate_up: bool) -> PackedTensor:
    """OpenAI's MXFP4 experts → GGML's MXFP4 blocks, uint8 [E, out, in/32 · 17], the same numbers.

    OpenAI: byte k of a block holds codes 2k (low nibble) and 2k + 1 (high), w = fp4(q) · 2^(s − 127); GGML:
    the exponent byte, then byte j holds codes j and j + 16, w = 2·fp4(q) · 2^(s − 128). The exponent byte
    is the same; only the nibbles move. gate_up: rows interleave gate and up; they become gate rows, then up."""
    E, rows, groups, _ = blocks.shape  # [E, out, in/32, 16]
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(E, rows, groups, 32)  # in order
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # GGML: byte j = codes j, j + 16
    data = torch.cat([scales.to(torch.uint8).unsqueeze(-1), packed], dim=-1).reshape(E, rows, groups * 17)
    if gate_up:
        data = torch.cat([data[:, 0::2], data[:, 1::2]], dim=1)
    return PackedTensor("MXFP4", (E, rows, groups * 32), data.contiguous())


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
        if isinstance(value, list) and len(expected) == 3:  # an MoE layer's stacked experts, kept as blocks
            shape = (value[0].shape[0], sum(p.shape[1] for p in value), value[0].shape[2])
            parts = [PackedTensor(p.fmt, p.shape, p.data.to(device)) for p in value]
            if shape == expected:
                model.get_submodule(module_name).set_packed(attr, parts)
        elif isinstance(value, list):
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
        if name not in params and part == 0 and name.replace(".qkv_proj.", ".q_proj.") in params:
            name, part = name.replace(".qkv_proj.", ".q_proj."), None  # MLA's own q_proj (no q/k/v to fuse)
        if name not in params:
            continue
        if part is None:
            assign(name, [tensor] if isinstance(tensor, PackedTensor) else tensor)
            continue
        parts = pending.setdefault(name, {})
        parts[part] = tensor
        shape = tuple(params[name].shape)
        if len(parts) == _num_parts(name, shape, tensor):
            values = [parts[i] for i in range(len(parts))]
            if all(isinstance(v, PackedTensor) for v in values):
                assign(name, values)
            else:
                floats = [v.dequantize() if isinstance(v, PackedTensor) else v for v in values]
                if len(floats[0].shape) == len(shape) and ".mlp.experts." in name:  # [E, I, ...] each: per expert
                    assign(name, torch.cat(floats, dim=1))
                else:
                    stacked = torch.cat(floats)
                    assign(name, stacked.view(shape) if stacked.numel() == params[name].numel() else stacked)
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
