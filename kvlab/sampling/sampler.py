"""Pick the next token from one sequence's logits.

Order of the filters (as in transformers): repetition penalty → temperature → top-k → top-p → min-p,
then one draw from the remaining distribution. Greedy (temperature 0) is a plain argmax after the
penalty. Each sampler owns its random generator, so a seed reproduces a request on its own.
"""

from __future__ import annotations

import torch

from kvlab.sampling.params import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params = params
        self.generator = None
        if not params.is_greedy and params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor, history: torch.Tensor | None = None) -> int:
        """logits [V] float32, history [N] token ids seen so far (prompt and output) → token id."""
        p = self.params
        if p.repetition_penalty != 1.0 and history is not None and history.numel():
            logits = apply_repetition_penalty(logits, history, p.repetition_penalty)
        if p.is_greedy:
            return int(logits.argmax())
        probs = self.probabilities(logits)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a non-greedy draw uses, after temperature and the filters."""
        p = self.params
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            logits = _top_p(logits, p.top_p)
        probs = torch.softmax(logits, dim=-1)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
            probs = probs / probs.sum()
        return probs


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """Make every token already seen less likely: positive logits divided, negative multiplied."""
    seen = logits[history]
    logits = logits.clone()
    logits[history] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities sum to at least top_p."""
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    # drop a token when the tokens before it already reach top_p (the first always stays)
    drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
