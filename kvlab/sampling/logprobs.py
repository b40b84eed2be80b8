"""Log-probabilities of tokens: the chosen one, its rank, and the most likely others.

    Logprob(token_id, logprob, rank, top)     one position: top = [(token id, logprob)], most likely first
    token_logprobs(rows [L, V], tokens, k)    log-softmax of each row, read at its token, with the top k

Which distribution the rows are is the caller's choice (SamplingParams.logprobs_mode): the sampler
hands in the processed logits (after bias, penalties, the structured-output mask and temperature) or
the raw ones; prompt log-probabilities are always the model's own (`prompt_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Logprob:
    """One position's log-probabilities (natural log). `rank` 1 is the most likely token."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprobs(rows: torch.Tensor, tokens: list[int], k: list[int]) -> list[Logprob]:
    """rows [L, V] logits (any float dtype), tokens [L], k[i] top entries for row i (0..20)."""
    if not tokens:
        return []
    lp = torch.log_softmax(rows.float(), dim=-1)  # [L, V]
    index = torch.tensor(tokens, device=lp.device)[:, None]
    chosen = lp.gather(1, index)  # [L, 1]
    ranks = ((lp > chosen).sum(-1) + 1).tolist()
    most = max(k)
    top_v, top_i = lp.topk(most, dim=-1) if most else (None, None)
    top_v = top_v.tolist() if most else None
    top_i = top_i.tolist() if most else None
    out = []
    for j, (token, value, rank) in enumerate(zip(tokens, chosen[:, 0].tolist(), ranks)):
        top = list(zip(top_i[j][: k[j]], top_v[j][: k[j]])) if k[j] else []
        out.append(Logprob(token, value, rank, top))
    return out


def prompt_logprobs(logits: torch.Tensor, next_tokens: list[int], k: int) -> list[Logprob]:
    """logits [L, V] at prompt positions q, next_tokens[q] the prompt token at q + 1: its log-probability."""
    return token_logprobs(logits, next_tokens, [k] * len(next_tokens))
