"""Verification: the target's k + 1 logits rows of a request that drafted k tokens → the tokens it keeps.

    greedy    the longest prefix of drafts equal to the target's argmax, then the target's own next token
              (the argmax after the last accepted draft: the "bonus" token when every draft is accepted)
    sampled   Leviathan et al.'s rule: accept draft x with probability min(1, p(x) / q(x)); at the first
              rejection draw from norm(max(0, p − q)) and stop; when all k are accepted draw one more from p

p is the target's distribution at that row, after logit_bias, temperature, top-k / top-p / min-p (what
plain sampling draws from); q the draft's, processed the same way. Every uniform comes from the
request's own seeded generator, so the same seed gives the same text.

A proposer without a distribution (prompt lookup: q is one-hot at its token) gets the rule in its
coupled form: draw x from p exactly as plain sampling would, with the next uniform, and accept the
draft when x equals it (P(accept) = p(d), and on rejection x is distributed as p without d, renormalised
— the rule's residual). A round uses one uniform per kept token, as plain decoding would; uniforms of
rows past a rejection are put back (the generator's state is restored), so the text equals plain
decoding's with the same seed, token for token.
"""

from __future__ import annotations

import torch

from kvlab.sampling.draw import draw, filtered_probabilities
from kvlab.sampling.sampler import BatchSampler, SequenceState, _Draw, _filters


def eligible(params) -> bool:
    """Whether a request's sampling can be verified here: nothing that depends on the tokens before a row
    (penalties, a grammar) and no per-token log-probabilities."""
    return not params.has_penalties and params.structured_outputs is None and not params.needs_logprob


def _invert(probs: torch.Tensor, u: torch.Tensor) -> int:
    """The token at cumulative mass u × total of one row (float64; never a zero-mass token)."""
    cdf = probs.to(torch.float64).cumsum(0)
    total = cdf[-1]
    target = torch.minimum(u.to(cdf.device) * total, torch.nextafter(total, torch.zeros_like(total)))
    return int(torch.searchsorted(cdf, target[None], right=True)[0].clamp(max=cdf.shape[0] - 1))


class RejectionSampler:
    def __init__(self, sampler: BatchSampler):
        self.sampler = sampler

    def _state(self, request) -> SequenceState:
        return self.sampler.state(request.request_id, request.params, request.prompt_token_ids, request.index)

    def processed(self, request, logits: torch.Tensor) -> torch.Tensor:
        """[R, V]: the request's rows after logit_bias (penalties and grammars never speculate)."""
        state = self._state(request)
        _, x = self.sampler._processed(logits, [_Draw(i, request.request_id, state) for i in range(logits.shape[0])])
        return x

    def verify_greedy_many(self, requests, logits: torch.Tensor, spans) -> dict[str, tuple[list[int], int]]:
        """Plain-greedy requests together: one argmax over every row. spans: (lo, hi) rows of each."""
        argmax = logits.argmax(dim=-1).tolist()
        out = {}
        for r, (lo, hi) in zip(requests, spans):
            out[r.request_id] = self._accept_prefix(argmax[lo:hi], r.spec_token_ids[: hi - lo - 1])
        return out

    @staticmethod
    def _accept_prefix(targets: list[int], drafts: list[int]) -> tuple[list[int], int]:
        a = 0
        while a < len(drafts) and targets[a] == drafts[a]:
            a += 1
        return targets[: a + 1], a

    def verify(self, request, logits: torch.Tensor, draft_probs: torch.Tensor | None) -> tuple[list[int], int]:
        """(tokens to append, drafts accepted) for one request: logits [k + 1, V], its k drafts in
        request.spec_token_ids, draft_probs [k, V] (None: a proposer without a distribution)."""
        params, state = request.params, self._state(request)
        k = logits.shape[0] - 1
        drafts = request.spec_token_ids[:k]
        x = self.processed(request, logits)
        if params.is_greedy:
            tokens, a = self._accept_prefix(x.argmax(dim=-1).tolist(), drafts)
        elif draft_probs is None:
            tokens, a = self._coupled(x, drafts, params, state)
        else:
            tokens, a = self._rejection(x, drafts, draft_probs[:k], params, state)
        for t in tokens:
            state.record(t, None)
        return tokens, a

    def _coupled(self, x, drafts, params, state: SequenceState) -> tuple[list[int], int]:
        rows = x.shape[0]
        scaled = x.float() / params.temperature
        gen = state.generator
        saved = gen.get_state() if gen is not None else None
        uniforms = torch.stack([state.uniform() for _ in range(rows)])
        f = _filters([params])
        drawn = draw(scaled, f[0] * rows, f[1] * rows, f[2] * rows, uniforms).tolist()
        tokens, a = self._accept_prefix(drawn, drafts)
        if gen is not None:  # put back the uniforms of rows past the first rejection
            gen.set_state(saved)
            for _ in tokens:
                state.uniform()
        return tokens, a

    def _rejection(self, x, drafts, q, params, state: SequenceState) -> tuple[list[int], int]:
        rows = x.shape[0]
        f = _filters([params])
        p = filtered_probabilities(x.float() / params.temperature, f[0] * rows, f[1] * rows, f[2] * rows)
        p, q = p.to(torch.float64), q.to(device=p.device, dtype=torch.float64)
        tokens = []
        for j, d in enumerate(drafts):
            u = state.uniform()
            if float(u) * float(q[j, d]) < float(p[j, d]):  # u < p/q: accepted with probability min(1, p/q)
                tokens.append(d)
                continue
            residual = torch.clamp(p[j] - q[j], min=0.0)
            if float(residual.sum()) <= 0.0:  # p == q up to rounding: a rejection had probability 0
                residual = p[j]
            tokens.append(_invert(residual, state.uniform()))
            return tokens, j
        tokens.append(_invert(p[len(drafts)], state.uniform()))  # every draft accepted: one more from p
        return tokens, len(drafts)


def draft_distribution(logits: torch.Tensor, params, vocab_size: int, bias_state: SequenceState | None = None):
    """The draft's q for one row [V_draft] under the request's sampling (bias, temperature, filters),
    laid out over the target's vocabulary (ids past it dropped; a smaller draft vocabulary padded)."""
    x = logits.float()
    if x.shape[0] > vocab_size:
        x = x[:vocab_size]
    elif x.shape[0] < vocab_size:
        x = torch.cat([x, x.new_full((vocab_size - x.shape[0],), float("-inf"))])
    if bias_state is not None and bias_state.bias_ids is not None:
        x = x.clone()
        x[bias_state.bias_ids.to(x.device)] += bias_state.bias_values.to(x.device)
    f = _filters([params])
    return filtered_probabilities((x / params.temperature)[None], *f)[0]
