"""Tiny random mixture-of-experts models, built with transformers' own classes and saved as folders.

Every matrix is redrawn at std 0.15 (transformers' 0.02 leaves the router's logits so close that the
top-k is decided by rounding, and the LM head's logits flat), norms at 1 ± 0.1, biases and sinks random.
"""

from __future__ import annotations

from pathlib import Path

import torch

MOE_ARCHS = ["qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss"]
GPT_OSS_WINDOW = 8  # tokens: shorter than the tests' prompts, so the sliding layers slide
COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)  # fmt: skip


def build_tiny_moe(kind: str, directory: Path, seed: int = 0, init_std: float = 0.15, yarn_truncate: bool = False,
                   **overrides) -> Path:
    """Save a tiny random MoE model of `kind` (MOE_ARCHS) as safetensors in `directory`; return it.

    qwen3_moe: 8 experts, top-2 renormalised, layer 1 dense (decoder_sparse_step 2 would skip two; here
    mlp_only_layers); olmoe: q/k norms over whole projections, top-2 not renormalised; qwen2_moe: a shared
    expert behind its sigmoid gate, q/k/v biases, layer 1 dense; gpt_oss: sinks, biases everywhere,
    sliding (8) and full layers alternating, YaRN, clamped SwiGLU experts stored fused and interleaved.
    `yarn_truncate`: gpt-oss's own configs say False; llama.cpp's YaRN always rounds its ramp's ends (True),
    so a model meant to be compared with its GGUF says True. `overrides`: config fields set last.
    """
    import transformers

    common = dict(COMMON)
    if kind == "qwen3_moe":
        cls, config_cls = transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig
        common.update(head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1])  # fmt: skip
    elif kind == "olmoe":
        cls, config_cls = transformers.OlmoeForCausalLM, transformers.OlmoeConfig
        common.update(intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_key_value_heads=4)
    elif kind == "qwen2_moe":
        cls, config_cls = transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig
        common.update(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1])  # fmt: skip
    elif kind == "gpt_oss":
        cls, config_cls = transformers.GptOssForCausalLM, transformers.GptOssConfig
        common.update(head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                      sliding_window=GPT_OSS_WINDOW,
                      layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                      rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                                       "beta_slow": 1.0, "truncate": yarn_truncate, "original_max_position_embeddings": 64})  # fmt: skip
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(config_cls(**{**common, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(("bias", "sinks")) or p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(init_std * torch.randn_like(p))
    model.save_pretrained(directory)
    return directory


GGUF_ARCH = {"qwen3_moe": "qwen3moe", "olmoe": "olmoe", "qwen2_moe": "qwen2moe", "gpt_oss": "gpt-oss"}
_ATTENTION_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias", "self_attn.sinks": "attn_sinks.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight", "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight", "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}  # fmt: skip


def gguf_tensors(hf_dir: Path) -> dict[str, "torch.Tensor"]:
    """The checkpoint's tensors under llama.cpp's names: experts stacked [E, rows, in] as ffn_{gate,up,down}_exps
    (gpt-oss's fused, interleaved, transposed ones taken apart), the shared expert's gate as [hidden]."""
    import json
    import re

    from safetensors.torch import load_file

    arch = json.loads((hf_dir / "config.json").read_text())["model_type"]
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
        elif rest == "mlp.experts.gate_up_proj":  # gpt-oss: [E, hidden, 2I], gate and up interleaved
            out[f"blk.{i}.ffn_gate_exps.weight"] = t[..., 0::2].transpose(1, 2)
            out[f"blk.{i}.ffn_up_exps.weight"] = t[..., 1::2].transpose(1, 2)
        elif rest == "mlp.experts.gate_up_proj_bias":
            out[f"blk.{i}.ffn_gate_exps.bias"], out[f"blk.{i}.ffn_up_exps.bias"] = t[:, 0::2], t[:, 1::2]
        elif rest == "mlp.experts.down_proj":  # gpt-oss: [E, I, hidden]
            out[f"blk.{i}.ffn_down_exps.weight"] = t.transpose(1, 2)
        elif rest == "mlp.experts.down_proj_bias":
            out[f"blk.{i}.ffn_down_exps.bias"] = t
        else:
            gguf_name = _ATTENTION_NAMES[rest]
            if arch == "gpt_oss" and gguf_name == "ffn_norm.weight":  # llama.cpp's name of gpt-oss's MLP norm
                gguf_name = "post_attention_norm.weight"
            out[f"blk.{i}.{gguf_name}"] = t.reshape(-1) if rest == "mlp.shared_expert_gate.weight" else t
    for (i, which), by_expert in experts.items():
        out[f"blk.{i}.ffn_{which}_exps.weight"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    assert arch in GGUF_ARCH
    return {k: v.contiguous() for k, v in out.items()}


def build_tiny_moe_gguf(hf_dir: Path, out: Path, experts_type: str = "F32") -> Path:
    """Write a tiny MoE folder (with its tokenizer) as a GGUF file with the `gguf` package's writer, under
    llama.cpp's names and keys. `experts_type`: the GGML type of the routed experts' matrices; every other
    tensor stays F32."""
    import json

    import gguf
    import numpy as np
    from tiny import add_gguf_tokenizer

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["model_type"]]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if "norm_topk_prob" in cfg:
        w.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))
    if arch == "gpt-oss":
        w.add_sliding_window(cfg["sliding_window"])
    add_gguf_tokenizer(w, hf_dir, cfg["vocab_size"])
    for name, t in gguf_tensors(hf_dir).items():
        data = t.float().numpy()
        if name.endswith("_exps.weight") and experts_type != "F32":
            qtype = gguf.GGMLQuantizationType[experts_type]
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def gpt_oss_as_mxfp4(hf_dir: Path, mxfp4_dir: Path, float_dir: Path) -> tuple[Path, Path]:
    """The tiny gpt-oss's experts rounded to MXFP4 (the gguf package's quantizer), saved twice: as OpenAI
    stores them (`*_blocks` [E, out, in/32, 16] with codes 2k, 2k + 1 in byte k, `*_scales` [E, out, in/32],
    quantization_config mxfp4) in `mxfp4_dir`, and as the floats those blocks hold in `float_dir`."""
    import json
    import shutil

    import gguf
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(hf_dir / "model.safetensors"))
    packed, floats = {}, {}
    for name, t in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[name] = floats[name] = t
            continue
        rows_first = t.transpose(1, 2).contiguous()  # [E, out, in], out interleaving gate and up
        E, out, n = rows_first.shape
        q = gguf.quants.quantize(rows_first.reshape(E * out, n).numpy(), gguf.GGMLQuantizationType.MXFP4)
        blocks = torch.from_numpy(q).reshape(E, out, n // 32, 17)
        ggml = blocks[..., 1:]  # byte j: codes j (low) and j + 16 (high)
        codes = torch.cat([ggml & 0x0F, ggml >> 4], dim=-1)  # [.., 32] in order
        packed[f"{name}_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
        packed[f"{name}_scales"] = blocks[..., 0].contiguous()
        values = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.MXFP4).reshape(E, out, n)
        floats[name] = torch.from_numpy(values).transpose(1, 2).contiguous()
    for directory, weights in ((mxfp4_dir, packed), (float_dir, floats)):
        directory.mkdir(parents=True, exist_ok=True)
        for f in hf_dir.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, directory / f.name)
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((mxfp4_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    (mxfp4_dir / "config.json").write_text(json.dumps(config))
    return mxfp4_dir, float_dir
