"""Exact draws from filtered distributions without sorting the vocabulary.

    draw(logits [D, V], top_k, top_p, min_p, uniforms [D]) → token ids [D]
    filtered_probabilities(logits, top_k, top_p, min_p)   → probs [D, V], what each row draws from

`logits` are already processed and divided by the temperature. Rows without a filter draw from the
whole softmax by inverse CDF (one float64 cumulative sum: float32 would give the vocabulary's tail
tokens a rounded share). Filtered rows need only the most likely tokens: `torch.topk` takes the first
64 (or top_k's k), and a row is decided when the cut ends inside them — top-k's k is inside; top-p's
mass is reached (`cumsum[K-1] >= top_p`: every later token is dropped); min-p's threshold is passed.
An undecided row (a flat distribution) keeps every token above a probability threshold that still
holds its whole cut, and sorts only those. The kept set is exactly the one a full sort gives (as
transformers: top-k → top-p on the renormalised top-k → min-p relative to the most likely token). A
full sort of 49,152 logits took 3-6 ms here on one thread; the topk about 0.1 ms.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

FIRST_K = 64


def is_filtered(top_k: int, top_p: float, min_p: float, vocab_size: int) -> bool:
    return 0 < top_k < vocab_size or top_p < 1.0 or min_p > 0.0


def draw(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float],
         uniforms: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One token per row: u in [0, 1) per row (float64), mapped through the row's kept distribution."""
    vocab = logits.shape[1]
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    filtered = [i for i in range(len(top_k)) if is_filtered(top_k[i], top_p[i], min_p[i], vocab)]
    plain = sorted(set(range(len(top_k))) - set(filtered))
    u = uniforms.double().cpu().numpy()
    if plain:
        index = torch.tensor(plain, device=logits.device)
        cdf = torch.softmax(logits[index], dim=-1).cumsum(-1, dtype=torch.float64)
        tokens[index] = _invert_torch(cdf, uniforms.to(logits.device)[index])
    if filtered:
        sub = logits if len(filtered) == logits.shape[0] else logits[torch.tensor(filtered, device=logits.device)]
        for rows, ids, kept in _rounds(sub, *(_pick(x, filtered) for x in (top_k, top_p, min_p))):
            where = [filtered[r] for r in rows]
            picked = ids[np.arange(len(rows)), _invert(np.cumsum(kept, axis=1), u[where])]
            tokens[torch.tensor(where, device=logits.device)] = torch.from_numpy(picked).to(logits.device)
    return tokens


def filtered_probabilities(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """The distribution each row draws from, dense [D, V] float32 (zeros for dropped tokens)."""
    vocab = logits.shape[1]
    probs = torch.softmax(logits.float(), dim=-1)
    filtered = [i for i in range(len(top_k)) if is_filtered(top_k[i], top_p[i], min_p[i], vocab)]
    if filtered:
        sub = logits[torch.tensor(filtered, device=logits.device)]
        for rows, ids, kept in _rounds(sub, *(_pick(x, filtered) for x in (top_k, top_p, min_p))):
            dense = np.zeros((len(rows), vocab))
            np.put_along_axis(dense, ids, kept / kept.sum(axis=1, keepdims=True), axis=1)
            probs[torch.tensor([filtered[r] for r in rows], device=logits.device)] = (
                torch.from_numpy(dense).float().to(logits.device)
            )
    return probs


def _pick(values: list, rows: list[int]) -> list:
    return [values[i] for i in rows]


def _invert_torch(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first position whose cumulative mass exceeds u × total (never a zero-mass one)."""
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)


def _invert(cdf: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The same on the candidates (numpy: a few hundred numbers, where torch's per-call cost dominates)."""
    total = cdf[:, -1]
    target = np.minimum(u * total, np.nextafter(total, 0))
    return np.minimum((cdf <= target[:, None]).sum(axis=1), cdf.shape[1] - 1)


def _rounds(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> Iterator[tuple[list[int], np.ndarray, np.ndarray]]:
    """Yield (rows, ids [R, K], kept [R, K] float64 unnormalised masses) for rows as they are decided.

    First the FIRST_K most likely tokens of every row (torch's topk; the cut on them is numpy's). A row
    not decided by them (a flat distribution: its nucleus is larger) goes to `_by_threshold`."""
    vocab = logits.shape[1]
    k_of = np.array([k if 0 < k < vocab else 0 for k in top_k])
    tp, mp = np.array(top_p, dtype=np.float64), np.array(min_p, dtype=np.float64)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [F, 1]
    lse_np = lse.double().cpu().numpy()
    size = min(vocab, max(FIRST_K, int(k_of.max())))
    values, ids = torch.topk(logits, size, dim=-1)  # [F, K], most likely first
    p = np.exp(values.double().cpu().numpy() - lse_np)  # probability in the whole distribution
    keep, decided = _cut(p, k_of, tp, mp, full=size == vocab)
    if decided.any():
        yield np.flatnonzero(decided).tolist(), ids.cpu().numpy()[decided], np.where(keep[decided], p[decided], 0.0)
    for r in np.flatnonzero(~decided):  # no top-k here (its k candidates decide it): top-p and/or min-p
        row_ids, row_p = _by_threshold(logits[r], lse[r], float(p[r, -1]), tp[r], mp[r])
        row_keep, _ = _cut(row_p[None], k_of[r : r + 1], tp[r : r + 1], mp[r : r + 1], full=True)
        yield [int(r)], row_ids[None], np.where(row_keep, row_p[None], 0.0)


def _by_threshold(row: torch.Tensor, lse: torch.Tensor, below: float, top_p: float, min_p: float):
    """(ids, probabilities) of every token at or above a threshold that keeps the whole cut, sorted most
    likely first. Top-p's nucleus lies within {p >= t} as soon as that set holds top_p of the mass (it is
    the sorted prefix that reaches top_p); min-p's within {p >= min_p × p_max}. `below`: a probability
    the nucleus already goes under (the first round's last candidate), where the search for t starts."""
    p = torch.exp(row.float() - lse.float())  # [V]
    t = min_p * float(p.max()) if min_p > 0 else 0.0
    if top_p < 1.0:
        nucleus = below / 16
        while nucleus > 0 and float(p[p >= nucleus].sum(dtype=torch.float64)) < top_p:
            nucleus = nucleus / 16 if nucleus > 1e-30 else 0.0
        t = max(t, nucleus) if min_p > 0 else nucleus
    ids = torch.nonzero(p >= t)[:, 0]
    exact = (row[ids].double() - lse.double()).exp()  # float64, as the first round's
    order = torch.argsort(exact, descending=True)
    return ids[order].cpu().numpy(), exact[order].cpu().numpy()


def _cut(p: np.ndarray, tk: np.ndarray, tp: np.ndarray, mp: np.ndarray, full: bool) -> tuple[np.ndarray, np.ndarray]:
    """The kept positions [R, K] of candidates sorted most likely first, and whether each row is decided."""
    positions = np.arange(p.shape[1])
    has_k, has_p, has_m = tk > 0, tp < 1.0, mp > 0.0
    keep = ~has_k[:, None] | (positions[None, :] < tk[:, None])
    # top-p on the distribution renormalised to the top-k (the candidates hold all k of them)
    mass = np.where(has_k, (p * keep).sum(axis=1), 1.0)
    rel = p / mass[:, None]
    cum = np.cumsum(rel, axis=1)
    keep &= ~has_p[:, None] | ((cum - rel) < tp[:, None])  # drop a token once those before it reach top_p
    keep &= ~has_m[:, None] | (p >= mp[:, None] * p[:, :1])
    decided = has_k | (has_p & (cum[:, -1] >= tp)) | (has_m & (p[:, -1] < mp * p[:, 0]))
    return keep, decided | full
