"""Tiny random hybrid models (Gated DeltaNet + gated attention), built with transformers' own classes.

qwen3_5: Qwen3_5TextConfig (dense MLP), 4 layers, attention every 2nd; qwen3_next: Qwen3NextConfig with a
mixture of experts and a gated shared expert, 4 layers. Matrices are redrawn at std 0.15 so that the logits
are not flat, norms at ±0.1 around their (1 + w) centre, A_log and dt_bias as the classes draw them.
"""

from __future__ import annotations

from pathlib import Path

import torch

HYBRID_ARCHS = ["qwen3_5", "qwen3_next"]
COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, tie_word_embeddings=False, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])  # fmt: skip


def build_tiny_hybrid(kind: str, directory: Path, seed: int = 0, init_std: float = 0.15, mtp: bool = False) -> Path:
    """Save a tiny random hybrid of `kind` (HYBRID_ARCHS) with a tokenizer in `directory`; return it.

    `mtp`: also store one random MTP module (`mtp.*`, as Qwen3.5 / Qwen3-Next checkpoints do)."""
    import transformers
    from tiny import add_tiny_tokenizer

    common = dict(COMMON)
    if kind == "qwen3_5":
        cls, config_cls = transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig
        common.update(intermediate_size=96)
    elif kind == "qwen3_next":
        cls, config_cls = transformers.Qwen3NextForCausalLM, transformers.Qwen3NextConfig
        common.update(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1)  # fmt: skip
    else:
        raise ValueError(kind)
    if mtp:
        common.update(mtp_num_hidden_layers=1)
    torch.manual_seed(seed)
    config = config_cls(**common)
    config.dtype = torch.float32
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue
            if "norm" in name:
                centre = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0  # the gated norm is x̂ · w
                p.copy_(centre + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(init_std * torch.randn_like(p))
    model.save_pretrained(directory)
    if mtp:
        add_random_mtp(directory, kind, seed)
    add_tiny_tokenizer(directory)
    return directory


def add_random_mtp(directory: Path, kind: str, seed: int, std: float = 0.15) -> None:
    """Random `mtp.*` tensors in the checkpoint (transformers drops them): fc, two pre-fc norms, one decoder
    layer like the model's full-attention layers, and its final norm."""
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(seed + 1)
    rnd = lambda *shape: std * torch.randn(*shape, generator=g)  # noqa: E731
    E = COMMON["hidden_size"]
    mtp = {"mtp.fc.weight": rnd(E, 2 * E), "mtp.pre_fc_norm_embedding.weight": rnd(E) * 0.7,
           "mtp.pre_fc_norm_hidden.weight": rnd(E) * 0.7, "mtp.norm.weight": rnd(E) * 0.7}  # fmt: skip
    layer = "model.layers.1."  # a full-attention layer: its tensors' shapes are the MTP layer's
    for name, t in tensors.items():
        if name.startswith(layer):
            mtp["mtp.layers.0." + name[len(layer) :]] = rnd(*t.shape) * (0.7 if "norm" in name else 1.0)
    save_file({**tensors, **mtp}, str(path), metadata={"format": "pt"})


GGUF_ARCH = {"qwen3_5": "qwen35", "qwen3_next": "qwen3next"}
_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight", "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight", "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.A_log": "ssm_a", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
}  # fmt: skip


def _tiled(t: torch.Tensor, dim: int, num_k_heads: int, per_k: int, head_dim: int) -> torch.Tensor:
    """Value heads grouped by key head → tiled (llama.cpp's qwen35 converter: head g·r + j moves to j·Hk + g)."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], num_k_heads, per_k, head_dim, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def gguf_tensors(hf_dir: Path, kind: str) -> dict[str, torch.Tensor]:
    """The checkpoint as llama.cpp's converter writes it: its names, norms + 1 (not the gated norm), A = −exp(A_log),
    conv taps [C, K], Qwen3-Next's in_proj_qkvz as attn_qkv + attn_gate, qwen35's value heads tiled."""
    from safetensors.torch import load_file

    c = COMMON
    Hk, Hv, Dk, Dv = c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]
    r = Hv // Hk
    out, experts = {}, {}
    n = c["num_hidden_layers"]  # an MTP module becomes block n: blk.n.nextn.* and the layer's own names
    nextn = {"mtp.fc.weight": "eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "enorm.weight",
             "mtp.pre_fc_norm_hidden.weight": "hnorm.weight", "mtp.norm.weight": "shared_head_norm.weight"}  # fmt: skip
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        if name in nextn:
            out[f"blk.{n}.nextn.{nextn[name]}"] = t if name == "mtp.fc.weight" else t + 1  # renamed, then + 1
            continue
        name = name.replace("mtp.layers.0.", f"model.layers.{n}.")
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if not name.startswith("model.layers."):
            out[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = t  # fmt: skip
            continue
        _, _, i, rest = name.split(".", 3)
        if rest.startswith("mlp.experts."):
            _, _, e, which, _ = rest.split(".")
            experts.setdefault((i, which.removesuffix("_proj")), {})[int(e)] = t
            continue
        if rest == "linear_attn.A_log":
            t = -t.exp()
        elif rest == "linear_attn.conv1d.weight":
            t = t.squeeze(1)
        if rest == "linear_attn.in_proj_qkvz.weight":
            groups = t.reshape(Hk, 2 * Dk + 2 * r * Dv, -1)
            q, k, v, z = groups.split((Dk, Dk, r * Dv, r * Dv), dim=1)
            out[f"blk.{i}.attn_qkv.weight"] = torch.cat([x.reshape(-1, t.shape[1]) for x in (q, k, v)])
            out[f"blk.{i}.attn_gate.weight"] = z.reshape(-1, t.shape[1])
            continue
        if kind == "qwen3_5" and rest.startswith("linear_attn."):
            t = _tiled_v(rest, t, Hk, r, Dk, Dv)
        out[f"blk.{i}.{_NAMES[rest]}"] = t.reshape(-1) if rest == "mlp.shared_expert_gate.weight" else t
    for (i, which), by_expert in experts.items():
        out[f"blk.{i}.ffn_{which}_exps.weight"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return {k: v.contiguous() for k, v in out.items()}


def _tiled_v(rest: str, t: torch.Tensor, Hk: int, r: int, Dk: int, Dv: int) -> torch.Tensor:
    if rest in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        qk = 2 * Hk * Dk
        return torch.cat([t[:qk], _tiled(t[qk:], 0, Hk, r, Dv)])
    if rest == "linear_attn.in_proj_z.weight":
        return _tiled(t, 0, Hk, r, Dv)
    if rest in ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight", "linear_attn.A_log", "linear_attn.dt_bias"):
        return _tiled(t, 0, Hk, r, 1)
    if rest == "linear_attn.out_proj.weight":
        return _tiled(t, 1, Hk, r, Dv)
    return t


def build_tiny_hybrid_gguf(hf_dir: Path, out: Path, kind: str, matrix_type: str = "F32") -> Path:
    """Write a tiny hybrid folder (with its tokenizer) as GGUF with the `gguf` package's writer, under llama.cpp's
    names and keys: matrices (not the conv taps) as `matrix_type`, the rest F32."""
    import json

    import gguf
    import numpy as np
    from tiny import add_gguf_tokenizer

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[kind]
    w = gguf.GGUFWriter(str(out), arch)
    mtp = cfg.get("mtp_num_hidden_layers") or 0
    w.add_block_count(cfg["num_hidden_layers"] + mtp)
    if mtp:
        w.add_nextn_predict_layers(mtp)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"]))
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_full_attention_interval(cfg["full_attention_interval"])
    if kind == "qwen3_next":
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        w.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))
    add_gguf_tokenizer(w, hf_dir, cfg["vocab_size"])
    for name, t in gguf_tensors(hf_dir, kind).items():
        data = np.ascontiguousarray(t.float().numpy())
        if matrix_type != "F32" and data.ndim >= 2 and "conv1d" not in name and data.shape[-1] % 32 == 0:
            qtype = gguf.GGMLQuantizationType[matrix_type]
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def make_agreeing(directory: Path) -> None:
    """Rewrite a checkpoint with `mtp.*` so that its MTP head predicts exactly what the model does.

    Every mixer's and MLP's output projection is zeroed: the model's next token is then a function of the
    current token alone, g(x) = argmax lm_head(norm(embed(x))). The MTP head computes the same g of the token
    it is given: fc passes the (normalised) embedding and ignores the hidden state, its layer's output
    projections are zero, its final norm is the model's. Its drafts after x are g(x), g(g(x)), ...: what the
    model will generate, so every draft is accepted (α = 1 up to rounding ties)."""
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    E = COMMON["hidden_size"]
    for name, t in tensors.items():
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(t)
    tensors["mtp.fc.weight"] = torch.cat([torch.eye(E), torch.zeros(E, E)], dim=1)
    tensors["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(E)  # x̂ · (1 + 0)
    tensors["mtp.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(path), metadata={"format": "pt"})
