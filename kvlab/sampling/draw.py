"""Exact draws from filtered distributions without sorting the vocabulary.

    draw(logits [D, V], top_k, top_p, min_p, uniforms [D]) → token ids [D]
    filtered_probabilities(logits, top_k, top_p, min_p)   → probs [D, V], what each row draws from

`logits` are already processed and divided by the temperature. Rows without a filter draw from the
whole softmax by inverse CDF (one float64 cumulative sum: float32 would give the vocabulary's tail
tokens a rounded share). Filtered rows need only the most likely tokens: `torch.topk` takes the first
64 (or top_k's k), and a row is decided when the cut ends inside them — top-k's k is inside; top-p's
mass is reached (every later token is dropped); min-p's threshold is passed.
An undecided row (a flat distribution) keeps every token above a probability threshold that still
holds its whole cut, and sorts only those. The kept set is exactly the one a full sort gives (as
transformers: top-k → top-p on the renormalised top-k → min-p relative to the most likely token). A
full sort of 49,152 logits took 3-6 ms here on one thread; the topk about 0.1 ms.

The boundaries, as vLLM and transformers draw them: top-p keeps the smallest set of most likely tokens
whose mass reaches top_p (a set holding exactly top_p suffices: the next token is dropped); min-p keeps
a token whose probability equals min_p × p_max. Both compare numbers computed from float32 logits, and
the last bit of a float32 log or exp differs between CPUs' vector math (`exp(log(0.5))` lands on either
side of 0.5), so a comparison within rounding of its boundary is decided as at the boundary: a mass
below top_p by a relative `SLACK` (1e-6, about eight float32 ulps) or less reaches it, and a probability
that close below min-p's floor is kept. The slack moves a cut only where rounding would otherwise
decide it.
"""

from __future__ import annotations

import torch

FIRST_K = 64
SLACK = 1e-6  # differences this small are float32 rounding, not the distribution (see the module's docstring)


def reaches(mass: float, top_p: float) -> bool:
    """Whether a nucleus holding `mass` (of 1) has reached top_p: at it or below by a relative SLACK."""
    return mass >= top_p * (1.0 - SLACK)


def below_floor(q: float, floor: float) -> bool:
    """Whether min-p drops a token of probability q: below the floor by more than rounding."""
    return q < floor * (1.0 - SLACK)


def is_filtered(top_k: int, top_p: float, min_p: float, vocab_size: int) -> bool:
    return 0 < top_k < vocab_size or top_p < 1.0 or min_p > 0.0


def draw(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float],
         uniforms: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One token per row: u in [0, 1) per row (float64), mapped through the row's kept distribution."""
    vocab = logits.shape[1]
    filtered = [i for i in range(len(top_k)) if is_filtered(top_k[i], top_p[i], min_p[i], vocab)]
    if len(filtered) == logits.shape[0]:  # the usual step: every row filtered, no gather or scatter
        return torch.tensor([t for t, _ in _kept(logits, top_k, top_p, min_p, uniforms.tolist())], device=logits.device)
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    plain = sorted(set(range(len(top_k))) - set(filtered))
    if plain:
        index = torch.tensor(plain, device=logits.device)
        cdf = torch.softmax(logits[index], dim=-1).cumsum(-1, dtype=torch.float64)
        tokens[index] = _invert(cdf, uniforms.to(logits.device)[index])
    if filtered:
        index = torch.tensor(filtered, device=logits.device)
        u = [float(uniforms[i]) for i in filtered]
        picked = _kept(logits[index], *(_pick(x, filtered) for x in (top_k, top_p, min_p)), u)
        tokens[index] = torch.tensor([t for t, _ in picked], device=logits.device)
    return tokens


def filtered_probabilities(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """The distribution each row draws from, dense [D, V] float32 (zeros for dropped tokens)."""
    vocab = logits.shape[1]
    probs = torch.softmax(logits.float(), dim=-1)
    filtered = [i for i in range(len(top_k)) if is_filtered(top_k[i], top_p[i], min_p[i], vocab)]
    if filtered:
        sub = logits[torch.tensor(filtered, device=logits.device)]
        for r, (_, (ids, kept)) in zip(filtered, _kept(sub, *(_pick(x, filtered) for x in (top_k, top_p, min_p)))):
            dense = torch.zeros(vocab, dtype=torch.float64)
            dense[torch.tensor(ids, dtype=torch.long)] = torch.tensor(kept, dtype=torch.float64) / sum(kept)
            probs[r] = dense.float().to(logits.device)
    return probs


def _pick(values: list, rows: list[int]) -> list:
    return [values[i] for i in rows]


def _invert(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first position whose cumulative mass exceeds u × total (never a zero-mass one)."""
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)


def _kept(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float], uniforms=None):
    """Per row: (the drawn token, or None without uniforms; (ids, kept probabilities) most likely first).

    The vocabulary-wide passes are torch's, batched (logsumexp, topk); the cut walks each row's few
    candidates in plain Python (at that size every torch or numpy call costs more than its work)."""
    vocab = logits.shape[1]
    k_of = [k if 0 < k < vocab else 0 for k in top_k]
    size = min(vocab, max(FIRST_K, max(k_of)))
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [F, 1]
    values, ids = torch.topk(logits, size, dim=-1)  # [F, K], most likely first
    probs = (values.double() - lse.double()).exp().tolist()  # probability in the whole distribution
    ids_l = ids.tolist()
    out = []
    for r in range(logits.shape[0]):
        kept = _cut(probs[r], k_of[r], top_p[r], min_p[r], full=size == vocab)
        row_ids = ids_l[r]
        if kept is None:  # a flat distribution: its cut lies beyond the first candidates
            row_ids, row_p = _by_threshold(logits[r], lse[r], probs[r][-1], top_p[r], min_p[r])
            kept = _cut(row_p, 0, top_p[r], min_p[r], full=True)
        row = (row_ids[: len(kept)], kept)
        out.append((_walk(row, uniforms[r]) if uniforms is not None else None, row))
    return out


def _cut(p: list[float], top_k: int, top_p: float, min_p: float, full: bool) -> list[float] | None:
    """The kept probabilities of candidates sorted most likely first (a prefix of them), or None when the
    cut may go on past them. Top-p on the distribution renormalised to the top-k; min-p relative to the
    most likely; a token is dropped once those before it reach top_p."""
    if top_k:
        p = p[:top_k]
    mass = sum(p) if top_k else 1.0
    floor = min_p * p[0]
    kept, before, stopped = [], 0.0, False
    for q in p:
        if q <= 0.0 or (top_p < 1.0 and reaches(before, top_p)) or (min_p > 0.0 and below_floor(q, floor)):
            stopped = True
            break
        kept.append(q)
        before += q / mass
    if full or top_k or stopped or (top_p < 1.0 and reaches(before, top_p)):
        return kept
    return None


def _walk(row: tuple[list[int], list[float]], u: float) -> int:
    """Inverse CDF over one row's kept candidates: the first whose cumulative mass exceeds u × total."""
    ids, kept = row
    target, cum = u * sum(kept), 0.0
    for token, q in zip(ids, kept):
        cum += q
        if cum > target:
            return token
    return ids[len(kept) - 1]


def _by_threshold(row: torch.Tensor, lse: torch.Tensor, below: float, top_p: float, min_p: float):
    """(ids, probabilities) of every token at or above a threshold that keeps the whole cut, sorted most
    likely first. Top-p's nucleus lies within {p >= t} as soon as that set holds top_p of the mass (it is
    the sorted prefix that reaches top_p); min-p's within {p >= min_p × p_max}. `below`: a probability
    the nucleus already goes under (the first round's last candidate), where the search for t starts."""
    p = torch.exp(row.float() - lse.float())  # [V]
    t = min_p * float(p.max()) * (1.0 - 2 * SLACK) if min_p > 0 else 0.0  # a float32 bound: kept wider
    if top_p < 1.0:
        nucleus = below / 16
        while nucleus > 0 and float(p[p >= nucleus].sum(dtype=torch.float64)) < top_p:
            nucleus = nucleus / 16 if nucleus > 1e-30 else 0.0
        t = max(t, nucleus) if min_p > 0 else nucleus
    ids = torch.nonzero(p >= t)[:, 0]
    exact = (row[ids].double() - lse.double()).exp()  # float64, as the first round's
    order = torch.argsort(exact, descending=True)
    return ids[order].tolist(), exact[order].tolist()
