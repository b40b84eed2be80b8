"""Tiny random models of every supported architecture, built with transformers' own classes.

They are the correctness oracle: transformers' outputs on the same weights are the reference.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ["llama", "qwen2", "qwen3", "llama-rope-llama3", "qwen2-rope-yarn", "llama-tied", "gemma3"]
GEMMA3_WINDOW = 20  # tokens: shorter than the tests' longer prompts, longer than a 16-token block
GEMMA3_LAYERS = ["sliding_attention"] * 5 + ["full_attention"]  # llama.cpp's 5:1 pattern (layer 5 is global)


def build_tiny(kind: str, directory: Path, seed: int = 0, head_dim: int | None = None, **gemma3) -> Path:
    """Save a tiny random model of `kind` (see ARCHS) as safetensors in `directory`; return it.

    `head_dim`: the heads' size where not hidden / heads (a quantized KV cache needs blocks of 32).
    `gemma3` options (kind "gemma3"): `window` (GEMMA3_WINDOW) and `layer_types` (GEMMA3_LAYERS).
    """
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
    elif kind == "gemma3":
        cls, config_cls = transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig
        layer_types = list(gemma3.get("layer_types", GEMMA3_LAYERS))
        common.update(
            num_hidden_layers=len(layer_types), layer_types=layer_types,
            sliding_window=gemma3.get("window", GEMMA3_WINDOW), head_dim=32, tie_word_embeddings=True,
            # not head_dim: the scale is read, not derived (llama.cpp ignores it: give 32 to convert to GGUF)
            query_pre_attn_scalar=gemma3.get("query_pre_attn_scalar", 24),
            final_logit_softcapping=30.0,  # None in Gemma 3's own configs; set here so the cap is exercised
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        )  # fmt: skip
    else:
        raise ValueError(kind)
    if head_dim is not None:
        common["head_dim"] = head_dim
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


def add_gguf_tokenizer(w, hf_dir: Path, vocab_size: int, chat_template: str = CHATML) -> None:
    """The folder's tokenizer.json as GGUF metadata (byte-level BPE), padded to `vocab_size` named rows
    (llama.cpp wants a name per embedding row)."""
    import json

    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok["added_tokens"]}
    padding = [f"<pad{i}>" for i in range(vocab_size - len(vocab))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([t for t, _ in vocab] + padding)
    w.add_token_types([3 if t in specials else 1 for t, _ in vocab] + [3] * len(padding))
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template)


def _permute_like_llama_cpp(w: "torch.Tensor", num_heads: int) -> "torch.Tensor":
    """llama.cpp's converter reorders llama q/k rows for its interleaved rotary layout."""
    rows = w.shape[0]
    return w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def build_tiny_gguf(hf_dir: Path, out: Path, quant="F32", mtp_blocks: int = 0) -> Path:
    """Convert a tiny llama/qwen2/qwen3/gemma3 model (with its tokenizer) into a GGUF file, as llama.cpp would
    (Gemma 3: 1 added to every norm weight, its four norms' names, the window; its 5:1 pattern and local
    rotary base are llama.cpp's own, not written).

    `quant`: the GGML type of every matrix ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0"), or a
    function from the GGUF tensor name to one (a mixed file, as Q4_K_M files are); vectors stay F32.
    """
    import json

    import gguf
    import numpy as np
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
            "Gemma3ForCausalLM": "gemma3"}[cfg["architectures"][0]]  # fmt: skip
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(cfg["num_hidden_layers"] + mtp_blocks)  # llama.cpp counts MTP blocks in block_count
    if mtp_blocks:  # DeepSeek-V3 / GLM style: nextn_predict_layers, and the extra blocks' blk.N.nextn.* tensors
        writer.add_uint32(f"{arch}.nextn_predict_layers", mtp_blocks)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters", {})
    writer.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 10000.0))
    if arch == "gemma3":
        writer.add_sliding_window(cfg["sliding_window"])
        if cfg.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    add_gguf_tokenizer(writer, hf_dir, cfg["vocab_size"])

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
    if arch == "gemma3":
        names.update({"post_attention_layernorm.weight": "post_attention_norm.weight",
                      "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                      "post_feedforward_layernorm.weight": "post_ffw_norm.weight"})  # fmt: skip
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        if name.startswith("model.layers."):
            _, _, index, rest = name.split(".", 3)
            gguf_name = f"blk.{index}.{names[rest]}"
        else:
            gguf_name = names[name]
        if arch == "gemma3" and gguf_name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp's converter folds Gemma's (1 + w) into the stored weight
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
    for extra in range(cfg["num_hidden_layers"], cfg["num_hidden_layers"] + mtp_blocks):  # the MTP block's own tensors
        hidden = cfg["hidden_size"]
        writer.add_tensor(f"blk.{extra}.nextn.eh_proj.weight", np.zeros((hidden, 2 * hidden), dtype=np.float32))
        writer.add_tensor(f"blk.{extra}.nextn.enorm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{extra}.nextn.hnorm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{extra}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
