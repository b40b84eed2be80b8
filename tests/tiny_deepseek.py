"""Tiny random DeepSeek-V3 models (multi-head latent attention, sigmoid-routed experts), built with transformers'
own DeepseekV3Config and saved as folders with a small tokenizer.

Widths are chosen so that the latent (kv_lora_rank + qk_rope_head_dim = 48 + 16 = 64 numbers) fills two q8_0
blocks; every matrix is redrawn at std 0.15, norms at 1 ± 0.1, the routing bias at ±0.1 (as tiny_moe does).
"""

from __future__ import annotations

from pathlib import Path

import torch

DEEPSEEK_KINDS = ["q_lora", "no_q_lora", "grouped"]
COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
              n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
              kv_lora_rank=48, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24,
              max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False, rope_interleave=True)  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip


def deepseek_config(kind: str, **overrides):
    """The DeepseekV3Config of `kind`: q_lora (the query's low-rank path, YaRN with mscale), no_q_lora (q_proj
    straight from the hidden state, plain RoPE), grouped (8 experts in 4 groups, the top 2 groups kept)."""
    import transformers

    common = dict(COMMON)
    if kind == "q_lora":
        common.update(rope_parameters=YARN)
    elif kind == "no_q_lora":
        common.update(q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif kind == "grouped":
        common.update(n_group=4, topk_group=2, num_experts_per_tok=3, num_hidden_layers=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
    else:
        raise ValueError(kind)
    return transformers.DeepseekV3Config(**{**common, **overrides})


def build_tiny_deepseek(kind: str, directory: Path, seed: int = 0, init_std: float = 0.15, **overrides) -> Path:
    """Save a tiny random DeepSeek-V3 of `kind` (DEEPSEEK_KINDS) as safetensors in `directory`; return it."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(deepseek_config(kind, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(init_std * torch.randn_like(p))
        for layer in model.model.layers:  # a buffer, not a parameter: the correction bias only chooses experts
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(0.1 * torch.randn_like(gate.e_score_correction_bias))
    model.save_pretrained(directory)
    return directory


_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight", "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight", "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}  # fmt: skip


def deepseek_gguf_tensors(hf_dir: Path, split_kv_b: bool) -> dict[str, torch.Tensor]:
    """The checkpoint under llama.cpp's deepseek2 names: experts stacked [E, rows, in]; with `split_kv_b`, kv_b as
    its converter writes it now: k_b [H, r, dn] (transposed) and v_b [H, dv, r]."""
    import json
    import re

    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    H, dn, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    out, experts = {}, {}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        if not name.startswith("model.layers."):
            out[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = t  # fmt: skip
            continue
        _, _, i, rest = name.split(".", 3)
        per_expert = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", rest)
        if per_expert:
            experts.setdefault((i, per_expert.group(2)), {})[int(per_expert.group(1))] = t
        elif rest == "self_attn.kv_b_proj.weight" and split_kv_b:
            k_b, v_b = t.view(H, dn + dv, -1).split([dn, dv], dim=1)
            out[f"blk.{i}.attn_k_b.weight"], out[f"blk.{i}.attn_v_b.weight"] = k_b.transpose(1, 2), v_b
        else:
            out[f"blk.{i}.{_NAMES[rest]}"] = t
    for (i, which), by_expert in experts.items():
        out[f"blk.{i}.ffn_{which}_exps.weight"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    return {k: v.contiguous() for k, v in out.items()}


def build_tiny_deepseek_gguf(hf_dir: Path, out: Path, split_kv_b: bool = True) -> Path:
    """Write a tiny DeepSeek-V3 folder (with its tokenizer) as a deepseek2 GGUF with the `gguf` package's writer,
    under llama.cpp's names and keys (its converter's: one KV head of kv_lora_rank + rope numbers, the MLA
    sizes apart, the YaRN log multiplier 0.1 · mscale_all_dim), every tensor F32."""
    import json

    import gguf
    import numpy as np
    from tiny import add_gguf_tokenizer

    cfg = json.loads((hf_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), "deepseek2")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    rank, rope_dim = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    w.add_kv_lora_rank(rank)
    w.add_key_length(rank + rope_dim)
    w.add_value_length(rank)
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope_dim)
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_rope_dimension_count(rope_dim)
    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(cfg["norm_topk_prob"])
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    add_gguf_tokenizer(w, hf_dir, cfg["vocab_size"])
    for name, t in deepseek_gguf_tensors(hf_dir, split_kv_b).items():
        w.add_tensor(name, np.ascontiguousarray(t.float().numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
