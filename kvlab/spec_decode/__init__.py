"""Speculative decoding: guess a request's next k tokens cheaply, check them all in one target pass.

    SpecDecoder.create(config, engine)   a proposer (NgramProposer, DraftModelProposer) + the verifier
    .propose(running)                    before a step: request.spec_token_ids for each decode that drafts
    .verify(groups, logits)              in the runner's sample: the tokens each verified request keeps
    .record_step(...)                    after a step: its time, for c and the measured speedup

The scheduler runs a request's last token and its drafts as one chunk of k + 1 decode rows; the
verifier (rejection_sampler.py) keeps the longest agreeing prefix plus one target token, and the
scheduler truncates the rejected drafts' K/V. The counts are vLLM's (metrics.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvlab.config.speculative import SpeculativeConfig
from kvlab.errors import KvlabError
from kvlab.spec_decode.metrics import SpecDecodingStats, expected_tokens_per_round, predicted_speedup
from kvlab.spec_decode.ngram_proposer import NgramProposer
from kvlab.spec_decode.rejection_sampler import RejectionSampler, eligible

# the models whose MTP module kvlab.model.mtp runs (config.json model_type or GGUF architecture)
MTP_ARCHITECTURES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "qwen35", "qwen35moe", "qwen3next")
PROBE_EVERY = 16  # a request's every 16th decode step runs plainly: the plain step the speedup is measured against
ADAPTIVE_MIN_ROUNDS = 8  # rounds of a request before adaptive speculation judges it


@dataclass
class StepTimes:
    """Pure decode steps (no prompt chunk in them) of one kind: count, seconds, tokens gained."""

    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    rows: int = 0  # decode rows through the target

    def add(self, seconds: float, tokens: int, rows: int) -> None:
        self.steps, self.seconds, self.tokens, self.rows = self.steps + 1, self.seconds + seconds, self.tokens + tokens, self.rows + rows

    @property
    def step_s(self) -> float:
        return self.seconds / self.steps if self.steps else 0.0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class RowCosts:
    """A target step's measured time by the decode rows it carried (an average that follows drift), and an
    estimate between and beyond the measured counts: linear between neighbours, the last slope past them."""

    def __init__(self):
        self.seconds: dict[int, float] = {}
        self.count: dict[int, int] = {}

    def observe(self, rows: int, seconds: float) -> None:
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else 0.7 * old + 0.3 * seconds
        self.count[rows] = self.count.get(rows, 0) + 1

    def estimate(self, rows: int) -> float | None:
        if rows in self.seconds:
            return self.seconds[rows]
        known = sorted(self.seconds)
        if not known:
            return None
        below = [n for n in known if n < rows]
        above = [n for n in known if n > rows]
        if below and above:
            a, b = below[-1], above[0]
            return self.seconds[a] + (self.seconds[b] - self.seconds[a]) * (rows - a) / (b - a)
        if len(known) == 1:
            return self.seconds[known[0]]
        a, b = (known[-2], known[-1]) if below else (known[0], known[1])
        slope = max((self.seconds[b] - self.seconds[a]) / (b - a), 0.0)
        if below:  # more rows than any measured: never cheaper than the most measured
            return self.seconds[b] + slope * (rows - b)
        return max(self.seconds[a] - slope * (a - rows), self.seconds[a] * rows / a)  # fewer: never below proportional


@dataclass
class SpecReport:
    """The engine's speculation so far, measured against its own prediction."""

    method: str
    k: int
    stats: SpecDecodingStats
    c: float  # one draft step's cost over one target step, measured here
    c_source: str  # what the target step was: "plain decode steps" or "verification steps"
    verify_ratio: float  # a verification step's target pass over a plain decode step (0: not measured)
    predicted_speedup: float
    predicted_speedup_with_r: float  # the same tokens over k·c + r: the verification's own measured cost (0: no r)
    measured_speedup: float  # speculative decode tok/s over plain decode tok/s, this run's steps (0: unmeasured)
    spec_tok_s: float
    plain_tok_s: float

    def line(self) -> str:
        s = self.stats
        per_pos = " ".join(f"{x:.2f}" for x in s.per_position_acceptance_rate)
        text = (f"speculative {self.method} k={self.k}: α {s.acceptance_rate:.2f} ({s.num_accepted_tokens}/"
                f"{s.num_draft_tokens} drafts accepted, per position {per_pos or '-'}), mean acceptance length "
                f"{s.mean_acceptance_length:.2f}, c {self.c:.3f}; speedup predicted {self.predicted_speedup:.2f}×")  # fmt: skip
        if self.verify_ratio:
            text += f" ({self.predicted_speedup_with_r:.2f}× with a verification costing r {self.verify_ratio:.2f} steps)"
        if self.measured_speedup:
            # the footer's decode line is the one decode rate: beside it, only the plain steps' rate, labelled
            text += (f", measured {self.measured_speedup:.2f}× against this run's plain-decode comparison "
                     f"steps ({self.plain_tok_s:.1f} tok/s without drafts)")  # fmt: skip
            if self.measured_speedup < 1:
                text += ": speculation was slower than plain decoding here"
        else:
            text += ", measured: no plain decode step to compare with"
        return text

    def to_dict(self) -> dict:
        return dict(method=self.method, num_speculative_tokens=self.k, **self.stats.to_dict(), c=round(self.c, 6),
                    c_source=self.c_source, verify_ratio=round(self.verify_ratio, 6),
                    predicted_speedup=round(self.predicted_speedup, 6),
                    predicted_speedup_with_r=round(self.predicted_speedup_with_r, 6),
                    measured_speedup=round(self.measured_speedup, 6),
                    spec_decode_tok_s=round(self.spec_tok_s, 3), plain_decode_tok_s=round(self.plain_tok_s, 3))  # fmt: skip


class SpecDecoder:
    """Speculation for one engine, from the parts it needs (never the engine): a proposer (prompt lookup,
    or a draft model with its own pipeline), the target runner's sampler to verify with, the rows a
    step may carry and stay decode-sized (`row_cap`, None: no cap), and the context length."""

    def __init__(self, config: SpeculativeConfig, proposer, draft, sampler, row_cap: int | None, max_model_len: int):
        self.config, self.k = config, config.num_speculative_tokens
        self.ngram = proposer
        self.draft = draft
        self.row_cap, self.max_model_len = row_cap, max_model_len
        self.verifier = RejectionSampler(sampler)
        self.stats = SpecDecodingStats()
        self.spec_steps, self.plain_steps = StepTimes(), StepTimes()
        self.propose_s = 0.0  # proposing time of the rounds in spec_steps
        self._last_propose_s = 0.0
        self._off: set[str] = set()  # requests adaptive speculation stopped
        self.row_costs = RowCosts()  # adaptive: a step's time by its rows, to choose each step's k
        self._choices = 0

    def reset(self) -> None:
        """Forget the counts and timings so far (a benchmark's warm-up)."""
        self.stats = SpecDecodingStats()
        self.spec_steps, self.plain_steps = StepTimes(), StepTimes()
        self.propose_s = 0.0
        if self.draft is not None:
            self.draft.num_passes, self.draft.pass_s = 0, 0.0

    @classmethod
    def create(cls, value, loaded, tokenizer, engine_config, target) -> SpecDecoder | None:
        """The engine's speculation from `value` (a SpeculativeConfig, its dict or JSON; None: off), for the
        target model `loaded` with its `tokenizer`, EngineConfig and pipeline (runner/pipeline.py)."""
        config = SpeculativeConfig.parse(value)
        if config is None:
            return None
        model_config = loaded.config
        if config.method == "mtp" and not model_config.mtp_layers:
            raise KvlabError(f"{loaded.path.name} has no MTP heads (nextn_predict_layers): use ngram or draft_model")
        if not engine_config.use_cache:
            raise KvlabError("speculative decoding needs the KV cache: drop --no-cache")
        runner, max_len = target.runner, target.pool_plan.max_model_len
        policy = runner.driver.policy  # drafts stay decode-sized: the CPU's kernels and decode backend take them
        row_cap = policy.max_kernel_rows if runner.driver.ops.kernel_rows and policy.use_kernels else None
        if config.method == "mtp":  # the model's own module (kvlab.model.mtp), loaded only now
            from kvlab.model.mtp import load_mtp_head
            from kvlab.spec_decode.mtp_proposer import MTPProposer

            if model_config.architecture not in MTP_ARCHITECTURES:
                raise KvlabError(f"{loaded.path.name} has {len(model_config.mtp_layers)} MTP layer(s), but kvlab runs "
                                 f"the MTP modules of {', '.join(MTP_ARCHITECTURES)} only: use ngram or draft_model")  # fmt: skip
            mtp = MTPProposer(load_mtp_head(loaded), loaded, engine_config, target.pool_plan, policy)
            return cls(config, None, mtp, runner.sampler, row_cap, max_len)
        if config.method == "ngram":
            ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
            return cls(config, ngram, None, runner.sampler, row_cap, max_len)
        from kvlab.model.loader import load_model
        from kvlab.spec_decode.draft_model import DraftModelProposer, check_same_tokenizer
        from kvlab.tokenizer import load_tokenizer

        draft_loaded = load_model(config.model, dtype=loaded.model.dtype, device=loaded.model.device, max_positions=max_len)
        check_same_tokenizer(tokenizer, load_tokenizer(draft_loaded), model_config, draft_loaded.config, str(config.model))
        draft = DraftModelProposer(draft_loaded, model_config.vocab_size, engine_config, target.pool_plan, policy,
                                   str(config.model))  # fmt: skip
        return cls(config, None, draft, runner.sampler, row_cap, max_len)

    # ---- before a step -----------------------------------------------------------------------

    def propose(self, running) -> None:
        """Draft tokens for the running requests whose next step is a decode."""
        t0 = time.perf_counter()
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        self._last_propose_s = 0.0
        if not decodes:
            return
        max_len = self.max_model_len
        # every PROBE_EVERY-th decode step of a request is plain (its own count: the same seed, the same text)
        ready = [r for r in decodes if eligible(r.params) and r.request_id not in self._off
                 and r.timings.decode_steps % PROBE_EVERY != PROBE_EVERY - 1
                 and r.max_tokens - r.num_output_tokens >= 2 and r.num_tokens < max_len - 1]  # fmt: skip
        if not ready:
            return
        ks = self._ks(decodes, ready)
        if self.draft is not None:
            ready = [r for r in ready if ks[r.request_id] > 0]
            states = self.verifier._state
            drafts, probs = self.draft.propose(ready, ks, states)
            for r in ready:
                r.spec_token_ids = drafts.get(r.request_id, [])
                r.spec_draft_probs = probs.get(r.request_id)
        else:
            for r in ready:
                r.spec_token_ids = self.ngram.propose(r.all_token_ids, ks[r.request_id]) if ks[r.request_id] else []
        self._last_propose_s = time.perf_counter() - t0

    def observe_pass(self, chunks) -> None:
        """A target pass just ran over `chunks`: the MTP proposer keeps their hidden states (others: nothing)."""
        if self.draft is not None and hasattr(self.draft, "observe_pass"):
            self.draft.observe_pass(chunks)

    def prefill(self, plan) -> None:
        """A draft model prefills the prompts the target finishes in this step (part of their prefill)."""
        if self.draft is None:
            return
        done = [c.request for c in plan.chunks if c.samples and c.start < c.request.num_prompt_tokens
                and not c.spec_token_ids and eligible(c.request.params) and c.request.max_tokens > 1]  # fmt: skip
        if done:
            self.draft.prefill(done)

    def _ks(self, decodes, ready) -> dict[str, int]:
        """Drafts per request: k, within the row cap for requests whose text does not depend on k (greedy
        ones, and every request under prompt lookup); a sampled request's draft-model k is always k."""
        cap = self.row_cap
        own = {r.request_id: self.k if r.params.num_speculative_tokens is None else r.params.num_speculative_tokens
               for r in ready}  # fmt: skip
        ks = dict(own)
        if cap is None:
            return ks
        fixed = [r for r in ready if self.draft is not None and not r.params.is_greedy]
        flexible = [r for r in ready if r not in fixed]
        spare = cap - len(decodes) - sum(own[r.request_id] for r in fixed)
        if flexible:
            per, extra = divmod(max(spare, 0), len(flexible))
            for i, r in enumerate(flexible):
                ks[r.request_id] = min(own[r.request_id], per + (i < extra))
        if self.config.adaptive and flexible:  # the k of this step that the measured costs say yields most
            limit = max(ks[r.request_id] for r in flexible)
            best = self._step_k(len(decodes) + sum(own[r.request_id] for r in fixed), len(flexible), limit)
            for r in flexible:
                ks[r.request_id] = min(ks[r.request_id], best)
        return ks

    def _step_k(self, base_rows: int, n: int, limit: int) -> int:
        """Drafts per flexible request this step (0..limit): the one with the most expected tokens per second
        by the measured step times (drafting included; row counts not measured yet interpolated, the
        extremes tried first), the least measured one every 16th step."""
        self._choices += 1
        rows = {k: base_rows + k * n for k in range(limit + 1)}
        if len(self.row_costs.seconds) < 2:  # nothing to draw a cost curve from yet: the extremes first
            untried = [k for k in (limit, 0) if rows[k] not in self.row_costs.seconds]
            if untried:
                return untried[0]
        if self._choices % 16 == 0:  # look again at the option measured least often: costs drift
            return min(rows, key=lambda k: (self.row_costs.count.get(rows[k], 0), -k))
        rates = self.stats.per_position_acceptance_rate
        draft_s = self.draft.pass_s / self.draft.num_passes if self.draft is not None and self.draft.num_passes else 0.0

        def gain(k: int) -> float:
            expected = 1.0 + sum(rates[i] if i < len(rates) else 0.0 for i in range(k))
            cost = (self.row_costs.estimate(rows[k]) or 0.0) + k * draft_s
            return (base_rows + n * (expected - 1)) / cost if cost > 0 else 0.0

        return max(sorted(rows), key=gain)

    # ---- in the step -------------------------------------------------------------------------

    def verify(self, request, logits):
        """(tokens, accepted) of one request from its k + 1 rows."""
        return self.verifier.verify(request, logits, getattr(request, "spec_draft_probs", None) if self.draft else None)

    def verify_greedy_many(self, requests, logits, spans):
        return self.verifier.verify_greedy_many(requests, logits, spans)

    # ---- after a step ------------------------------------------------------------------------

    def observe(self, request, num_drafted: int, num_accepted: int) -> None:
        if request.spec_stats is None:
            request.spec_stats = SpecDecodingStats()
        request.spec_stats.observe(num_drafted, num_accepted)
        self.stats.observe(num_drafted, num_accepted)
        if self.config.adaptive and request.spec_stats.num_drafts >= ADAPTIVE_MIN_ROUNDS:
            report = self.report()
            s = request.spec_stats
            if report.plain_tok_s and self._request_gain(s) < 1.0:
                self._off.add(request.request_id)

    def _request_gain(self, s: SpecDecodingStats) -> float:
        """A request's measured-cost gain: its tokens per round over the round's cost in plain steps."""
        plain = self.plain_steps.step_s
        if not plain or not self.spec_steps.steps:
            return 1.0
        round_s = self.spec_steps.step_s + (self.propose_s / self.spec_steps.steps)
        return s.mean_acceptance_length * plain / round_s

    def record_step(self, step_s: float, pure_decode: bool, num_spec_chunks: int, tokens: int, rows: int) -> None:
        """A step's time (without proposing): pure decode steps feed the plain and speculative figures."""
        if not pure_decode:
            return
        self.row_costs.observe(rows, step_s)
        if num_spec_chunks:
            self.spec_steps.add(step_s + self._last_propose_s, tokens, rows)
            self.propose_s += self._last_propose_s
        else:
            self.plain_steps.add(step_s, tokens, rows)

    def release(self, request_id: str) -> None:
        self._off.discard(request_id)
        if self.draft is not None:
            self.draft.release(request_id)

    # ---- the report --------------------------------------------------------------------------

    def report(self, stats: SpecDecodingStats | None = None) -> SpecReport:
        """The engine's figures (or, with `stats`, one request's α with the engine's costs)."""
        s = stats or self.stats
        k = s.mean_draft_length or self.k
        spec, plain = self.spec_steps, self.plain_steps
        verify_s = (spec.seconds - self.propose_s) / spec.steps if spec.steps else 0.0
        target_s, source = (plain.step_s, "plain decode steps") if plain.steps else (verify_s, "verification steps")
        if self.draft is not None:
            per_pass = self.draft.pass_s / self.draft.num_passes if self.draft.num_passes else 0.0
        else:  # prompt lookup: the proposing time of a round, over its drafts
            per_pass = (self.propose_s / spec.steps / k) if spec.steps else 0.0
        c = per_pass / target_s if target_s else 0.0
        measured = spec.tok_s / plain.tok_s if spec.steps and plain.steps and plain.tok_s else 0.0
        r = verify_s / plain.step_s if plain.steps and spec.steps else 0.0
        tokens = expected_tokens_per_round(s.acceptance_rate, k)
        return SpecReport(self.config.method + (f" {self.config.model}" if self.config.model else ""), self.k, s, c,
                          source, r, predicted_speedup(s.acceptance_rate, k, c) if s.num_drafts else 0.0,
                          tokens / (k * c + r) if s.num_drafts and r else 0.0, measured, spec.tok_s, plain.tok_s)  # fmt: skip


__all__ = ["SpecDecoder", "SpecReport", "SpeculativeConfig", "SpecDecodingStats", "expected_tokens_per_round",
           "predicted_speedup"]
