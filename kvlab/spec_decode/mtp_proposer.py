"""The MTP proposer: the target's own multi-token-prediction module (kvlab.model.mtp) drafts k tokens.

It is a draft model (spec_decode/draft_model.py: its own paged KV cache, shadow requests, the same drawing)
whose inputs are the target's hidden states. Its shadow of a request holds the target's tokens shifted by
one (position p carries x_{p+1}); its K/V at p is right only when written with the target's h_p. A round:

    1. every target pass hands over its rows' hidden states (`observe_pass`: the last layer's output, through
       the target's final norm), kept per request and position
    2. truncate the shadow to the positions written with the target's states; catch up on the positions the
       target has accepted since (a whole prompt the first time) → logits of the last → draft 1
    3. k − 1 passes of one row each, fed the module's own output state and the previous draft → drafts 2..k
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from kvlab.request import Request
from kvlab.scheduler import ScheduledChunk, SchedulerOutput
from kvlab.spec_decode.draft_model import DraftModelProposer


class MTPProposer(DraftModelProposer):
    def __init__(self, head, target_loaded, target_config, target_plan, policy):
        loaded = SimpleNamespace(model=head, config=head.config, path=target_loaded.path)
        super().__init__(loaded, target_loaded.config.vocab_size, target_config, target_plan, policy, "mtp")
        self.head, self.target = head, target_loaded.model
        self.states: dict[str, dict[int, torch.Tensor]] = {}  # request → position → the target's h [E]
        self.written: dict[str, int] = {}  # request → leading positions whose K/V hold the target's states
        self._captured: torch.Tensor | None = None
        self.target.layers[-1].register_forward_hook(self._capture)

    def _capture(self, module, args, output) -> None:
        self._captured = output

    def observe_pass(self, chunks: list[ScheduledChunk]) -> None:
        """The target pass just run over `chunks` (packed order): keep each row's final hidden state."""
        if self._captured is None:
            return
        with torch.inference_mode(), self.runner.driver.ops.active():  # the device's ops, as in a pass
            h = self.target.norm(self._captured)[0]  # [N, E]
        self._captured = None
        at = 0
        for c in chunks:
            rows = self.states.setdefault(c.request.request_id, {})
            for i in range(c.num_new_tokens):
                rows[c.start + i] = h[at + i]
            at += c.num_new_tokens

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.states.pop(request_id, None)
        self.written.pop(request_id, None)

    def prefill(self, requests: list[Request]) -> None:
        """Nothing yet: a prompt's positions are caught up with its first drafts (step 2 above)."""

    def _shadow(self, request: Request) -> Request | None:
        """The shadow holding the target's tokens shifted by one, truncated to what the target's states wrote;
        None when a state it needs was never seen (the request decodes plainly from now on)."""
        rid, computed = request.request_id, request.num_computed_tokens
        shadow = self.shadows.get(rid)
        if shadow is None:
            shadow = Request(rid, [], request.params, max_tokens=1 << 30)
            self.shadows[rid], self.written[rid] = shadow, 0
        written = min(self.written[rid], computed - 1)
        if shadow.num_computed_tokens > written:
            self.kv.truncate(shadow, written)
        states = self.states.get(rid, {})
        if any(p not in states for p in range(written, computed)):
            self.release(rid)
            return None
        shadow.all_token_ids = list(request.all_token_ids[1 : computed + 1])  # position p carries x_{p+1}
        return shadow

    def propose(self, requests: list[Request], ks: dict[str, int], states) -> tuple[dict[str, list[int]], dict]:
        self._ops = []
        active, drafts, probs, feed = [], {}, {}, {}
        for r in requests:
            shadow = self._shadow(r)
            if shadow is None:
                continue
            start, n = shadow.num_computed_tokens, r.num_computed_tokens - shadow.num_computed_tokens
            ops = self.kv.allocate_slots(shadow, n + ks[r.request_id] - 1)
            if ops is None:  # the module's pool is full: this request decodes plainly this round
                self.release(r.request_id)
                continue
            self._ops += ops
            feed[r.request_id] = {p: self.states[r.request_id][p] for p in range(start, start + n)}
            active.append((r, shadow))
            drafts[r.request_id], probs[r.request_id] = [], []
        while active:
            chunks = [ScheduledChunk(s, s.num_computed_tokens, s.num_tokens - s.num_computed_tokens,
                                     self.kv.block_tables[r.request_id]) for r, s in active]  # fmt: skip
            logits, hidden = self._run_fed(chunks, feed)
            still = []
            for r, shadow in active:
                rid = r.request_id
                if not drafts[rid]:  # the catch-up: every position up to the target's is written with its states
                    self.written[rid] = r.num_computed_tokens
                    self._drop_states(rid, r.num_computed_tokens - 1)  # the last one may be fed again
                shadow.num_computed_tokens = shadow.num_tokens
                token = self._draw(r, logits[rid], states(r), probs[rid])
                drafts[rid].append(token)
                if len(drafts[rid]) < ks[rid]:
                    feed[rid] = {shadow.num_tokens: hidden[rid]}  # the module's own state, at the next position
                    shadow.all_token_ids.append(token)
                    still.append((r, shadow))
            active = still
        return drafts, {rid: torch.stack(p) for rid, p in probs.items() if p}

    def _drop_states(self, rid: str, below: int) -> None:
        rows = self.states.get(rid, {})
        for p in [p for p in rows if p < below]:
            del rows[p]

    def _run_fed(self, chunks, feed) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """One pass of the module: each packed row fed its hidden state; (logits, output state) per request."""
        t0 = time.perf_counter()
        inputs = self.runner.prepare_inputs(SchedulerOutput(step=0, chunks=chunks, block_ops=self.kv.take_pending_ops()))
        inputs.block_ops += self._ops
        self._ops = []
        (p,) = inputs.passes
        rows = [feed[c.request.request_id][c.start + i] for c in p.chunks for i in range(c.num_new_tokens)]
        self.head.hidden_in = torch.stack(rows)[None]  # [1, N, E]
        logits = self.runner.forward(inputs)
        if all(c.num_new_tokens == 1 for c in chunks):  # a draft step (not a catch-up): timed for c
            self.num_passes += 1
            self.pass_s += time.perf_counter() - t0
        out = self.head.hidden_out[0]  # [S (+ prompt rows), E]
        ids = [r.request_id for r in inputs.sampling]
        return {rid: logits[i] for i, rid in enumerate(ids)}, {rid: out[i] for i, rid in enumerate(ids)}
