"""GGUF files of a real model's layer shape filled with random blocks, for `kvlab lab moe` and
benchmarks/bench_moe.py.

The values are noise: every block's codes and scales are drawn at random (scales small enough that the
activations stay finite). The bytes and the shapes are a real model's, and a decode step's speed does not
depend on the values — except through routing, which random weights spread evenly over the experts, as
trained routers roughly do. Both kvlab and llama.cpp load these files (arch qwen3moe, or qwen3 for the
dense twin; a byte-level vocabulary padded with unused tokens).

    QWEN3_30B_A3B        hidden 2048, 128 experts of width 768, 8 active, GQA 32/4 of 128, qk norms
    dense_twin(shape)    the same attention, one dense MLP as wide as the active experts (8 × 768)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class LayerShape:
    """A decoder's shape: its attention, and its MLP (experts > 0: a mixture of experts)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    experts: int = 0  # 0: a dense MLP of `intermediate`
    top_k: int = 0
    expert_size: int = 0
    intermediate: int = 0
    context: int = 4096

    @property
    def active_mlp_width(self) -> int:
        return self.top_k * self.expert_size if self.experts else self.intermediate


QWEN3_30B_A3B = LayerShape("Qwen3-30B-A3B-shaped", hidden=2048, heads=32, kv_heads=4, head_dim=128, layers=4,
                           vocab=8192, experts=128, top_k=8, expert_size=768)  # fmt: skip
TINY_MOE = LayerShape("tiny MoE", hidden=64, heads=4, kv_heads=2, head_dim=16, layers=2, vocab=512, experts=8,
                      top_k=2, expert_size=32, context=512)  # fmt: skip


def dense_twin(shape: LayerShape) -> LayerShape:
    """The dense model with the same attention and the same active MLP parameters per token."""
    return dataclasses.replace(shape, name=f"dense twin of {shape.name}", experts=0, top_k=0, expert_size=0,
                               intermediate=shape.active_mlp_width)  # fmt: skip


def _random_blocks(rng: np.random.Generator, qtype, rows: tuple[int, ...], cols: int) -> np.ndarray:
    """uint8 [*rows, row bytes] of random blocks of `qtype`, their fp16 scales about 0.002."""
    from gguf import GGML_QUANT_SIZES

    values, size = GGML_QUANT_SIZES[qtype]
    count = int(np.prod(rows)) * cols // values
    blocks = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    scales = (rng.standard_normal(count) * 0.002).astype(np.float16).view(np.uint8).reshape(-1, 2)
    blocks[:, 0:2] = scales  # Q4_0 / Q8_0: d first
    return blocks.reshape(*rows, cols // values * size)


def write_random_gguf(shape: LayerShape, path: Path, qtype_name: str = "Q4_0", seed: int = 0) -> Path:
    """Write `shape` as a GGUF file of random `qtype_name` blocks (Q4_0 or Q8_0; norms 1, F32)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    if qtype_name not in ("Q4_0", "Q8_0"):
        raise ValueError(f"random blocks are written as Q4_0 or Q8_0, not {qtype_name}")
    rng = np.random.default_rng(seed)
    arch = "qwen3moe" if shape.experts else "qwen3"
    w = gguf.GGUFWriter(str(path), arch, use_temp_file=True)  # each tensor to a spooled file: a model's full
    w.add_name(shape.name)  # size (Qwen3-30B-A3B's 48 layers, 17 GB) is written without holding it in memory
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.intermediate or shape.expert_size)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.top_k)
        w.add_expert_feed_forward_length(shape.expert_size)
        w.add_expert_weights_norm(True)
    _vocabulary(w, shape.vocab)
    E, D = shape.hidden, shape.head_dim

    def matrix(name: str, rows: tuple[int, ...], cols: int) -> None:
        w.add_tensor(name, _random_blocks(rng, qtype, rows, cols), raw_dtype=qtype)

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    matrix("token_embd.weight", (shape.vocab,), E)
    ones("output_norm.weight", E)
    matrix("output.weight", (shape.vocab,), E)
    for i in range(shape.layers):
        b = f"blk.{i}."
        ones(b + "attn_norm.weight", E)
        ones(b + "ffn_norm.weight", E)
        ones(b + "attn_q_norm.weight", D)
        ones(b + "attn_k_norm.weight", D)
        matrix(b + "attn_q.weight", (shape.heads * D,), E)
        matrix(b + "attn_k.weight", (shape.kv_heads * D,), E)
        matrix(b + "attn_v.weight", (shape.kv_heads * D,), E)
        matrix(b + "attn_output.weight", (E,), shape.heads * D)
        if shape.experts:
            w.add_tensor(b + "ffn_gate_inp.weight", (rng.standard_normal((shape.experts, E)) * 0.02).astype(np.float32))
            matrix(b + "ffn_gate_exps.weight", (shape.experts, shape.expert_size), E)
            matrix(b + "ffn_up_exps.weight", (shape.experts, shape.expert_size), E)
            matrix(b + "ffn_down_exps.weight", (shape.experts, E), shape.expert_size)
        else:
            matrix(b + "ffn_gate.weight", (shape.intermediate,), E)
            matrix(b + "ffn_up.weight", (shape.intermediate,), E)
            matrix(b + "ffn_down.weight", (E,), shape.intermediate)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _vocabulary(w, vocab: int) -> None:
    """A byte-level vocabulary (the 256 byte tokens of GPT-2's alphabet) padded to `vocab` unused tokens:
    both engines load it; the benchmarks feed token ids, never text."""
    from gguf import TokenType

    alphabet = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)] + [chr(c) for c in range(174, 256)]
    alphabet += [chr(256 + i) for i in range(256 - len(alphabet))]
    alphabet.append("ab")  # llama.cpp's BPE wants at least one merge
    tokens = alphabet + [f"<unused{i}>" for i in range(vocab - len(alphabet))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.NORMAL] * len(alphabet) + [TokenType.UNUSED] * (vocab - len(alphabet)))
    w.add_token_merges(["a b"])
    w.add_eos_token_id(0)
