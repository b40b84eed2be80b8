"""What a finished (or streaming) request reports: its text, tokens, and what each phase cost."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestMetrics:
    """Timings and memory of one request. Seconds, tokens, bytes.

    prefill covers the forward over the new prompt tokens and the first sample (so TTFT ≈ prefill
    plus tokenization); decode covers every later token, one forward each.
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V were already in the cache (chat turns)
    generated_tokens: int = 0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    kv_cache_bytes: int = 0  # bytes of K/V holding this sequence's tokens at the end
    kv_cache_allocated_bytes: int = 0  # bytes the cache reserved
    peak_memory_bytes: int = 0  # process peak RSS on CPU, peak allocated on CUDA

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens that went through the model in the prefill pass."""
        return self.prompt_tokens - self.cached_prompt_tokens

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first one (TPOT's inverse)."""
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first."""
        steps = self.generated_tokens - 1
        return self.decode_s / steps if steps > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            prefill_tokens=self.prefill_tokens,
            prefill_tok_s=self.prefill_tok_s,
            decode_tok_s=self.decode_tok_s,
            tpot_s=self.tpot_s,
        )
        return d


@dataclass
class RequestOutput:
    """A generation's result: text (stop strings removed), token ids, why it ended, what it cost."""

    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length" (max_tokens or context)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    # the headline figures, flat, as users reach for them
    @property
    def prompt_tokens(self) -> int:
        return self.metrics.prompt_tokens

    @property
    def generated_tokens(self) -> int:
        return self.metrics.generated_tokens

    @property
    def ttft_s(self) -> float:
        return self.metrics.ttft_s

    @property
    def prefill_tok_s(self) -> float:
        return self.metrics.prefill_tok_s

    @property
    def decode_tok_s(self) -> float:
        return self.metrics.decode_tok_s

    @property
    def kv_cache_bytes(self) -> int:
        return self.metrics.kv_cache_bytes

    def to_dict(self) -> dict:
        d = {
            "text": self.text,
            "token_ids": self.token_ids,
            "prompt_token_ids": self.prompt_token_ids,
            "finish_reason": self.finish_reason,
        }
        d.update(self.metrics.to_dict())
        return d
