"""Tiny random models of every supported architecture, built with transformers' own classes.

They are the correctness oracle: transformers' outputs on the same weights are the reference.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ["llama", "qwen2", "qwen3", "llama-rope-llama3", "qwen2-rope-yarn", "llama-tied"]


def build_tiny(kind: str, directory: Path, seed: int = 0) -> Path:
    """Save a tiny random model of `kind` (see ARCHS) as safetensors in `directory`; return it."""
    import transformers

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if kind.startswith("llama"):
        cls, config_cls = transformers.LlamaForCausalLM, transformers.LlamaConfig
        if kind == "llama-rope-llama3":
            common["rope_parameters"] = {
                "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            }  # fmt: skip
        if kind == "llama-tied":
            common["tie_word_embeddings"] = True
    elif kind.startswith("qwen2"):
        cls, config_cls = transformers.Qwen2ForCausalLM, transformers.Qwen2Config
        if kind == "qwen2-rope-yarn":
            common["rope_parameters"] = {
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            }  # fmt: skip
    elif kind == "qwen3":
        cls, config_cls = transformers.Qwen3ForCausalLM, transformers.Qwen3Config
        common["head_dim"] = 32  # Qwen3 sets head_dim apart from hidden/heads
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(config_cls(**common)).eval()
    with torch.no_grad():  # random biases, so that the q/k/v bias path is exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    return directory


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def add_tiny_tokenizer(directory: Path, vocab_size: int = 512) -> Path:
    """Train a byte-level BPE of `vocab_size` tokens into `directory` (ids 0-4 are special, 2 is EOS)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["The capital of France is Paris. Héllo wörld, ça va? 日本語 😀 " * 3, "def f(x):\n    return x + 1\n"] * 50
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHATML, "add_bos_token": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _permute_like_llama_cpp(w: "torch.Tensor", num_heads: int) -> "torch.Tensor":
    """llama.cpp's converter reorders llama q/k rows for its interleaved rotary layout."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def build_tiny_gguf(hf_dir: Path, out: Path, quant="F32") -> Path:
    """Convert a tiny llama/qwen2 model (with its tokenizer) into a GGUF file, as llama.cpp would.

    `quant`: the GGML type of every matrix ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"), or a
    function from the GGUF tensor name to one (a mixed file, as Q4_K_M files are); vectors stay F32.
    """
    import json

    import gguf
    import numpy as np
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[
        cfg["architectures"][0]
    ]
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)

    names = {
        "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }  # fmt: skip
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        if name.startswith("model.layers."):
            _, _, index, rest = name.split(".", 3)
            gguf_name = f"blk.{index}.{names[rest]}"
        else:
            gguf_name = names[name]
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg["num_attention_heads"] if "attn_q" in gguf_name else cfg["num_key_value_heads"]
            tensor = _permute_like_llama_cpp(tensor, heads)
        data = tensor.float().numpy()
        kind = (quant(gguf_name) if callable(quant) else quant) if data.ndim == 2 else "F32"
        if kind == "F32":
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
