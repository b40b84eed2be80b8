"""EngineConfig: how the serving engine is sized and what it keeps, chosen by the user (flags, LLM options)."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.config.model import ModelConfig
from kvlab.errors import KvlabError

# --kv-cache-dtype's choices (kv/formats.py stores each; "auto" is the activations' dtype)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "q8_0", "q4_0")
KV_ROTATIONS = ("auto", "on", "off")  # auto: rotate q8_0 / q4_0 sides (kv/formats.py)
# requests running at once when --max-num-seqs is not given: vLLM's CPU server's default. A model with
# recurrent layers (Gated DeltaNet) keeps one state slot per seat, paid out of the KV budget whether used
# or not (kv/state_pool.py), so it gets fewer. 64 requests of (256 in, 128 out) through the engine
# (SmolLM2, int8, 2 threads, 2 rounds alternated): 32 seats 483 output tok/s, TTFT p50 6.0 s, TPOT p50
# 62 ms; 128 seats 512 tok/s, 3.4 s, 98 ms (docs/serving.md)
DEFAULT_MAX_NUM_SEQS = 128
RECURRENT_MAX_NUM_SEQS = 32


@dataclass(frozen=True)
class EngineConfig:
    """How the serving engine is sized. None means: the model's context / a share of free memory."""

    max_model_len: int | None = None
    block_size: int = 16
    kv_memory_bytes: int | None = None
    kv_memory_fraction: float | None = None
    max_num_seqs: int | None = None  # None: seats_for's default
    # tokens a step: 16 prompts of 64 in one pass; Qwen2.5-Coder-0.5B served 12% more output tok/s than at
    # 512 (docs/serving.md, "the step budget"); vLLM's CPU server takes 2,048
    max_num_batched_tokens: int = 1024
    enable_prefix_caching: bool = True
    use_cache: bool = True  # False: recompute every token every step (the KV cache's counterfactual)
    pack_prompts: bool = True  # prompt chunks in the decodes' forward (True) or in forwards of their own
    # sliding-window layers keep only the blocks their window still reaches (False: every layer keeps
    # every token, the window only a mask — llama.cpp's --swa-full; kv/layout.py)
    windowed_kv: bool = True
    # how keys and values are stored (kv/formats.py): vLLM's --kv-cache-dtype for both, llama.cpp's
    # --cache-type-k / --cache-type-v for each; "auto" is the activations' dtype
    kv_cache_dtype: str = "auto"
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    kv_rotation: str = "auto"  # Hadamard-rotate K and V before quantizing (kv/formats.py)
    # speculative decoding (config/speculative.py): a SpeculativeConfig, its dict or JSON; None: off
    speculative_config: object = None
    # the prefix cache's second tier (kv/prompt_cache.py): full blocks kept as files in this directory,
    # at most prompt_cache_size bytes (an int, or '4GiB'; None: 4 GiB), least recently used evicted
    prompt_cache_dir: str | None = None
    prompt_cache_size: int | str | None = None

    def seats_for(self, recurrent: bool) -> int:
        """Requests that may run at once: --max-num-seqs, or the default for a model with (`recurrent`) or
        without per-sequence recurrent state."""
        if self.max_num_seqs is not None:
            if self.max_num_seqs < 1:
                raise KvlabError(f"max_num_seqs (--max-num-seqs) must be at least 1, got {self.max_num_seqs}")
            return self.max_num_seqs
        return RECURRENT_MAX_NUM_SEQS if recurrent else DEFAULT_MAX_NUM_SEQS

    def context_len(self, model: ModelConfig) -> int:
        """Tokens a sequence may hold: --max-model-len, or the model's trained context; never more than that."""
        trained = model.context_limit  # max_position_embeddings, or what a --rope-scaling override stretched it to
        if self.max_model_len is None:
            return trained
        if self.max_model_len > trained:
            stretched = (f" stretched by --rope-scaling from {model.max_position_embeddings:,}"
                         if model.extended_context else "")  # fmt: skip
            raise KvlabError(
                f"--max-model-len {self.max_model_len:,} is longer than the model's context of {trained:,} "
                f"tokens (max_position_embeddings{stretched}): give at most {trained:,}"
                + ("" if model.extended_context else ", or stretch it with --rope-scaling (docs/lab.md)")
            )
        return self.max_model_len
