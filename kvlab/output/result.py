"""What a finished (or streaming) request reports: its text, tokens, and what each phase cost."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a plain dataclass; named only in annotations (no torch at import)
    from kvlab.sampling.logprobs import Logprob


@dataclass
class RequestMetrics:
    """Timings and memory of one request. Seconds, tokens, bytes.

    prefill covers the forward over the new prompt tokens and the first sample (so TTFT ≈ prefill
    plus tokenization); decode covers every later token, one forward each.
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V were already in the cache (prefix cache, chat turns)
    cached_prompt_tokens_disk: int = 0  # of those, tokens whose blocks were read back from --prompt-cache-dir
    generated_tokens: int = 0
    ttft_s: float = 0.0  # arrival → first token: queue_s + prefill_s
    prefill_s: float = 0.0  # first scheduled → first token (wall time, chunks and the steps between them)
    decode_s: float = 0.0  # first token → last token
    kv_cache_bytes: int = 0  # bytes of K/V holding this sequence's tokens at the end
    kv_cache_allocated_bytes: int = 0  # bytes the cache reserved (paged: whole blocks)
    peak_memory_bytes: int = 0  # process peak RSS on CPU, peak allocated on CUDA
    # the serving engine's timing split (kvlab.engine.LLMEngine); zero from the single-sequence engine
    queue_s: float = 0.0  # arrival → first scheduled
    prefill_compute_s: float = 0.0  # time of the engine steps that carried its prompt (shared with others)
    prefill_chunks: int = 0  # steps its prompt was split over (and recomputed in, after a preemption)
    prefill_shared_steps: int = 0  # of those, steps that carried other requests' tokens too
    decode_steps: int = 0  # steps that fed back one of its tokens
    mean_decode_batch: float = 0.0  # requests per step, averaged over its decode steps
    num_preemptions: int = 0  # times its blocks were taken back and its tokens recomputed
    kv_blocks: int = 0  # KV blocks it held at the end
    # speculative decoding: its drafted / accepted / per-position counts, α, mean acceptance length and
    # the speedup predicted from them beside the measured one (spec_decode/: SpecReport.to_dict); None: off
    spec_decoding: dict | None = None

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

    def timing_split(self) -> dict:
        """Where this request's time went: the `kvlab` field of the server's responses."""
        keys = ("queue_s", "prefill_s", "prefill_compute_s", "prefill_chunks", "prefill_shared_steps", "ttft_s",
                "decode_s", "decode_steps", "mean_decode_batch", "tpot_s", "prompt_tokens", "cached_prompt_tokens",
                "cached_prompt_tokens_disk",
                "prefill_tokens", "generated_tokens", "num_preemptions", "kv_blocks", "kv_cache_bytes")  # fmt: skip
        d = self.to_dict()
        split = {k: round(d[k], 6) if isinstance(d[k], float) else d[k] for k in keys}
        if self.spec_decoding is not None:
            split["spec_decoding"] = self.spec_decoding
        return split

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
class CompletionOutput:
    """One choice of a request (n > 1 gives several): its text, tokens, why it ended, what it cost.

    `logprobs` has one entry per generated token shown as text (end-of-sequence tokens are not), when
    SamplingParams.logprobs asked; `cumulative_logprob` sums them (also kept to rank best_of)."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length" (max_tokens or context), "abort"
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    logprobs: list[Logprob] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """A generation's result: its choices (`outputs`, one unless n > 1), the prompt, its log-probabilities.

    `text`, `token_ids`, `finish_reason` and `metrics` are the first choice's, as users reach for them.
    `prompt_logprobs` (SamplingParams.prompt_logprobs) has one entry per prompt token, None for the first.
    """

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=lambda: [CompletionOutput()])
    prompt_logprobs: list[Logprob | None] | None = None
    request_id: str | None = None
    # prompt tokens the prefix cache served, set when the request ends: its prompt sequence's (choice 0
    # before best_of ranks them), not a forked choice's, which shared the whole prompt's blocks
    cached_prompt_tokens: int | None = None

    # the first choice's fields, flat
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @text.setter
    def text(self, value: str) -> None:
        self.outputs[0].text = value

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @finish_reason.setter
    def finish_reason(self, value: str | None) -> None:
        self.outputs[0].finish_reason = value

    @property
    def metrics(self) -> RequestMetrics:
        return self.outputs[0].metrics

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
        if len(self.outputs) > 1:
            d["choices"] = [{"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                            for c in self.outputs]  # fmt: skip
        return d
