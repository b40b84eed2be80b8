"""SpeculativeConfig: how a request's next tokens are guessed and then checked (vLLM's speculative_config).

    SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
    SpeculativeConfig.parse('{"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 3}')

`method`: "ngram" (prompt lookup: the tokens that followed the longest earlier match of the sequence's
last n tokens, prompt_lookup_min ≤ n ≤ prompt_lookup_max), "draft_model" (a smaller model with the
same tokenizer; `model` names it; "draft_model" is implied when only `model` is given), or "mtp" (a
model's own multi-token-prediction module: Qwen3.5's and Qwen3-Next's `mtp.*`, spec_decode/mtp_proposer.py;
others refused with the reason). No torch here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from kvlab.errors import KvlabError

METHODS = ("ngram", "draft_model", "mtp")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model: a registry name, .gguf file or Hugging Face directory
    prompt_lookup_min: int = 2  # ngram: the shortest suffix matched
    prompt_lookup_max: int = 5  # ngram: the longest suffix matched (tried first)
    # stop speculating for a request whose own acceptance makes it lose, by the measured costs
    adaptive: bool = False

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """A SpeculativeConfig from a dict, a JSON string or itself (None: no speculation); KvlabError if bad."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise KvlabError(f"--speculative-config is not JSON: {e.msg} at character {e.pos}") from None
        if not isinstance(value, dict):
            raise KvlabError("the speculative config is a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}')  # fmt: skip
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise KvlabError(f"unknown speculative config key {unknown[0]!r}: use {', '.join(sorted(known))}")
        d = dict(value)
        if d.get("method") is None:
            if d.get("model") is None:
                raise KvlabError('the speculative config needs a "method" (ngram, draft_model) or a draft "model"')
            d["method"] = "draft_model"
        if "num_speculative_tokens" not in d:
            raise KvlabError('the speculative config needs "num_speculative_tokens" (k, tokens drafted per step)')
        return cls(**d)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise KvlabError(f"unknown speculative method {self.method!r}: use ngram or draft_model")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise KvlabError(f"num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        if self.method == "draft_model" and not self.model:
            raise KvlabError('speculative method draft_model needs the draft "model" (--speculative-model)')
        if self.method == "ngram":
            if self.model is not None:
                raise KvlabError("speculative method ngram takes no model (it looks the tokens up in the prompt)")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in (lo, hi)) or not 1 <= lo <= hi:
                raise KvlabError(f"ngram needs 1 ≤ prompt_lookup_min ≤ prompt_lookup_max, got {lo!r} and {hi!r}")
        if not isinstance(self.adaptive, bool):
            raise KvlabError(f"adaptive is true or false, got {self.adaptive!r}")

    def describe(self) -> str:
        what = f"{self.method} {self.model}" if self.model else self.method
        if self.method == "ngram":
            what += f" (n {self.prompt_lookup_min}..{self.prompt_lookup_max})"
        return f"{what}, k={self.num_speculative_tokens}" + (", adaptive" if self.adaptive else "")


def from_flags(config_json: str | None, model: str | None, num_tokens: int | None) -> SpeculativeConfig | None:
    """--speculative-config JSON, with the shorthands --speculative-model and --num-speculative-tokens
    (they override the JSON's keys). None when no flag is given."""
    if config_json is None and model is None and num_tokens is None:
        return None
    d = {}
    if config_json is not None:
        try:
            d = json.loads(config_json)
        except json.JSONDecodeError as e:
            raise KvlabError(f"--speculative-config is not JSON: {e.msg} at character {e.pos}") from None
        if not isinstance(d, dict):
            return SpeculativeConfig.parse(d)  # the one error for a non-object
    if model is not None:
        d["model"] = model
        d.setdefault("method", "draft_model")
    if num_tokens is not None:
        d["num_speculative_tokens"] = num_tokens
    if "method" not in d and "model" not in d:
        raise KvlabError("--num-speculative-tokens needs a proposer: --speculative-model NAME or "
                         '--speculative-config \'{"method": "ngram", ...}\'')  # fmt: skip
    return SpeculativeConfig.parse(d)
