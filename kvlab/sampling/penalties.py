"""The logit processors of a step, batched over its rows: logit_bias, then the penalties.

    apply_logit_bias(x, rows, states)       x[row, token] += bias            (one index_put for the step)
    apply_penalties(x, rows, states)        repetition, then frequency and presence, as one [P, V] update

x is [D, V] float32, the step's own copy of the logits (processors work in place). Each sequence's
token counts live in its SequenceState ([V] float32, updated by one indexed add per sampled token),
so a step with 16 penalised rows does 16 row reads and a few [16, V] operations — never a Python loop
over tokens. Definitions (OpenAI's, and vLLM's):

    frequency / presence:  logit -= frequency_penalty × count(output) + presence_penalty × (count > 0)
    repetition (CTRL):     a token seen in the prompt or the output: logit / r if > 0, else logit × r
"""

from __future__ import annotations

import torch


def apply_logit_bias(x: torch.Tensor, rows: list[int], states: list) -> None:
    ids = torch.cat([states[r].bias_ids for r in rows])
    values = torch.cat([states[r].bias_values for r in rows])
    which = torch.cat([torch.full((states[r].bias_ids.numel(),), r, dtype=torch.long) for r in rows])
    x.index_put_((which.to(x.device), ids.to(x.device)), values.to(x.device), accumulate=True)


def apply_penalties(x: torch.Tensor, rows: list[int], states: list) -> None:
    every = len(rows) == x.shape[0]  # usual: every row penalised, updated in place (x is the step's own copy)
    index = None if every else torch.tensor(rows, device=x.device)
    counts = states[rows[0]].counts[None] if len(rows) == 1 else torch.stack([states[r].counts for r in rows])
    sub = x if every else x[index]  # [P, V]
    params = [states[r].params for r in rows]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = (counts > 0) | torch.stack([states[r].prompt_seen for r in rows])
        r = _per_row([p.repetition_penalty for p in params], x.device)
        sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    freq, pres = [p.frequency_penalty for p in params], [p.presence_penalty for p in params]
    if any(freq):
        sub = sub.sub_(counts * _per_row(freq, x.device))
    if any(pres):
        sub = sub.sub_((counts > 0) * _per_row(pres, x.device))
    if not every:
        x[index] = sub
    elif sub is not x:
        x.copy_(sub)


def _per_row(values: list[float], device) -> float | torch.Tensor:
    """One value for every row as a plain number (no tensor to build), else a [P, 1] column."""
    return values[0] if len(set(values)) == 1 else torch.tensor(values, device=device)[:, None]


def penalize(logits: torch.Tensor, output_counts: torch.Tensor, presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's formula on one row (the reference the tests check the batched path against)."""
    return logits - frequency * output_counts - presence * (output_counts > 0).float()
