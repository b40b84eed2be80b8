"""Logits → tokens for every request of a step at once.

    BatchSampler.sample(requests, logits [S, V]) → SampleOutput: tokens, log-probabilities, forks
    BatchSampler.probabilities(requests, logits) → [S, V]: what each row would draw from (speculation)
    Sampler(params)(logits [V], history)         one sequence, one row (the reference engine, tests)

Each sequence (a request, or one choice of an n > 1 request) has a SequenceState: its seeded
generator (seed + choice index), its output-token counts and prompt tokens (penalties), its
logit_bias and its grammar matcher (structured outputs). A step is then, over all its rows together:

    logit_bias → repetition / presence / frequency penalties → grammar mask     (penalties.py, structured.py)
    greedy rows: argmax;  the others: ÷ temperature → top-k / top-p / min-p → one uniform each   (draw.py)
    log-probabilities for the rows that asked (logprobs.py); then every state advances by its token

A request whose prompt is forking into n choices draws n tokens from its one row, each with its own
generator: the choices share the prompt's logits as they share its KV blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.backends.ops import current_ops
from kvlab.sampling.draw import draw, filtered_probabilities
from kvlab.sampling.logprobs import Logprob, token_logprobs
from kvlab.sampling.params import INT64_MIN, SamplingParams
from kvlab.sampling.penalties import apply_logit_bias, apply_penalties
from kvlab.sampling.structured import GrammarCompiler, GrammarMatcher, apply_bitmasks


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax: the first of its largest logits (a NaN counts as the largest), as
    `argmax(dim=-1)` gives it, computed by the device's ops in force (backends/ops.py)."""
    return current_ops().greedy_tokens(logits)


def choice_seed(seed: int, index: int) -> int:
    """seed + index, wrapped into int64 (the generator takes it mod 2**64 anyway)."""
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN


@dataclass
class SequenceState:
    """What sampling remembers about one sequence between steps."""

    params: SamplingParams
    generator: torch.Generator | None  # None: the process's random state (no seed)
    counts: torch.Tensor | None = None  # [V] float32, output tokens so far (penalties only)
    prompt_seen: torch.Tensor | None = None  # [V] bool, prompt tokens (repetition penalty only)
    bias_ids: torch.Tensor | None = None  # [B] token ids of logit_bias
    bias_values: torch.Tensor | None = None  # [B] float32
    matcher: GrammarMatcher | None = None
    cumulative_logprob: float = 0.0

    def uniform(self) -> torch.Tensor:
        return torch.rand((), generator=self.generator, dtype=torch.float64)

    def record(self, token: int, logprob: Logprob | None) -> None:
        if self.counts is not None:
            self.counts[token] += 1
        if self.matcher is not None:
            self.matcher.consume(token)
        if logprob is not None:
            self.cumulative_logprob += logprob.logprob


@dataclass
class SampleOutput:
    tokens: dict[str, int] = field(default_factory=dict)  # sequence id → its new token
    logprobs: dict[str, Logprob] = field(default_factory=dict)  # sequence id → the token's log-probabilities
    forks: dict[str, list[str]] = field(default_factory=dict)  # parent id → children that drew their first token


@dataclass
class _Draw:
    row: int  # logits row
    seq_id: str
    state: SequenceState


class BatchSampler:
    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", grammars: GrammarCompiler | None = None):
        self.vocab_size, self.device, self.grammars = vocab_size, torch.device(device), grammars
        self.states: dict[str, SequenceState] = {}

    def state(self, seq_id: str, params: SamplingParams, prompt_ids, index: int = 0) -> SequenceState:
        state = self.states.get(seq_id)
        if state is None:
            state = self.states[seq_id] = self._new_state(params, prompt_ids, index)
        return state

    def _new_state(self, params: SamplingParams, prompt_ids, index: int) -> SequenceState:
        generator = None
        if not params.is_greedy and params.seed is not None:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(choice_seed(params.seed, index))
        s = SequenceState(params, generator)
        if params.has_penalties:
            s.counts = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
            if params.repetition_penalty != 1.0:
                s.prompt_seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
                s.prompt_seen[torch.tensor(list(prompt_ids), dtype=torch.long, device=self.device)] = True
        if params.logit_bias:
            s.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            s.bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise RuntimeError("structured outputs need an engine with a tokenizer")
            s.matcher = self.grammars.compile(params.structured_outputs).matcher()
        return s

    def release(self, seq_id: str) -> None:
        self.states.pop(seq_id, None)

    # ---- one step ------------------------------------------------------------------------------------

    def _draws(self, requests) -> tuple[list[_Draw], dict[str, list[str]]]:
        draws, forks = [], {}
        for i, r in enumerate(requests):
            draws.append(_Draw(i, r.request_id, self.state(r.request_id, r.params, r.prompt_token_ids, r.index)))
            if r.fork_ids and r.num_output_tokens == 0:  # the prompt's row gives every choice its first token
                forks[r.request_id] = list(r.fork_ids)
                for j, child in enumerate(r.fork_ids, start=1):
                    draws.append(_Draw(i, child, self.state(child, r.params, r.prompt_token_ids, r.index + j)))
        return draws, forks

    def _processed(self, logits: torch.Tensor, draws: list[_Draw]) -> tuple[torch.Tensor, torch.Tensor]:
        """(raw [D, V], processed [D, V]): the rows of each draw, before and after bias, penalties, mask."""
        rows = [d.row for d in draws]
        raw = logits if rows == list(range(logits.shape[0])) else logits[torch.tensor(rows, device=logits.device)]
        states = [d.state for d in draws]
        bias = [i for i, s in enumerate(states) if s.bias_ids is not None]
        penalised = [i for i, s in enumerate(states) if s.counts is not None]
        masked = [i for i, s in enumerate(states) if s.matcher is not None]
        if not (bias or penalised or masked):
            return raw, raw
        x = raw.float().clone()
        if bias:
            apply_logit_bias(x, bias, states)
        if penalised:
            apply_penalties(x, penalised, states)
        if masked:
            apply_bitmasks(x, masked, [states[i].matcher for i in masked])
        return raw, x

    def sample(self, requests, logits: torch.Tensor) -> SampleOutput:
        """requests[i]'s next token from logits[i] (and its forks' first tokens); states advance last."""
        out = SampleOutput()
        if not requests:
            return out
        draws, out.forks = self._draws(requests)
        params = [d.state.params for d in draws]
        if all(p.is_plain_greedy for p in params) and len(draws) == logits.shape[0]:  # the common fast path
            for d, token in zip(draws, greedy_tokens(logits).tolist()):
                out.tokens[d.seq_id] = token
                d.state.record(token, None)
            return out
        raw, x = self._processed(logits, draws)
        token_list, scaled, sampled = self._tokens(x, draws, params)
        logprobs = self._logprobs(draws, token_list, raw, x, scaled, sampled)
        for i, d in enumerate(draws):  # commit: every draw succeeded
            out.tokens[d.seq_id] = token_list[i]
            if logprobs[i] is not None:
                out.logprobs[d.seq_id] = logprobs[i]
            d.state.record(token_list[i], logprobs[i])
        return out

    def _tokens(self, x: torch.Tensor, draws: list[_Draw], params: list[SamplingParams]):
        """(token per draw, the sampled rows divided by their temperatures, which draws those are)."""
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        tokens = torch.empty(len(draws), dtype=torch.long, device=x.device)
        scaled = None
        if greedy:
            index = torch.tensor(greedy, device=x.device)
            tokens[index] = greedy_tokens(x[index])
        if sampled:
            every = len(sampled) == len(draws)  # every row sampled (usual): no gather, no scatter
            rows = x if every else x[torch.tensor(sampled, device=x.device)]
            temperatures = {params[i].temperature for i in sampled}
            if len(temperatures) == 1:
                scaled = rows.float() / temperatures.pop()
            else:
                scaled = rows.float() / torch.tensor([params[i].temperature for i in sampled], device=x.device)[:, None]
            uniforms = torch.stack([draws[i].state.uniform() for i in sampled])
            drawn = draw(scaled, *_filters([params[i] for i in sampled]), uniforms)
            if every:
                return drawn.tolist(), scaled, sampled
            tokens[torch.tensor(sampled, device=x.device)] = drawn
        return tokens.tolist(), scaled, sampled

    def _logprobs(self, draws, tokens, raw, x, scaled, sampled) -> list[Logprob | None]:
        want = [i for i, d in enumerate(draws) if d.state.params.needs_logprob]
        result: list[Logprob | None] = [None] * len(draws)
        if not want:
            return result
        position = {i: j for j, i in enumerate(sampled)}
        rows = []
        for i in want:
            if draws[i].state.params.logprobs_mode == "raw":
                rows.append(raw[i])
            else:  # processed: after temperature for sampled rows; greedy counts as temperature 1
                rows.append(scaled[position[i]] if i in position else x[i])
        ks = [draws[i].state.params.logprobs or 0 for i in want]
        for i, lp in zip(want, token_logprobs(torch.stack(rows), [tokens[i] for i in want], ks)):
            result[i] = lp
        return result

    def probabilities(self, requests, logits: torch.Tensor) -> torch.Tensor:
        """[S, V] float32: the distribution each request's row draws from now (greedy: one-hot at the
        argmax), after every processor and filter; nothing advances. For a verifier's rejection sampling."""
        draws = [_Draw(i, r.request_id, self.state(r.request_id, r.params, r.prompt_token_ids, r.index))
                 for i, r in enumerate(requests)]  # fmt: skip
        _, x = self._processed(logits, draws)
        params = [d.state.params for d in draws]
        temperature = torch.tensor([p.temperature if not p.is_greedy else 1.0 for p in params], device=x.device)
        probs = filtered_probabilities(x.float() / temperature[:, None], *_filters(params))
        for i, p in enumerate(params):
            if p.is_greedy:
                probs[i] = torch.nn.functional.one_hot(x[i].argmax(), x.shape[1]).float()
        return probs


def _filters(params: list[SamplingParams]) -> tuple[list[int], list[float], list[float]]:
    return [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params]


class _Row:
    """The request-shaped view of one sequence that Sampler hands to a BatchSampler."""

    def __init__(self, params: SamplingParams):
        self.request_id, self.params, self.prompt_token_ids = "row", params, []
        self.index, self.fork_ids, self.num_output_tokens = 0, (), 0


class Sampler:
    """One sequence sampled row by row (the reference engine; tests). `history` (prompt and output ids)
    is what the repetition penalty sees; presence and frequency count this sampler's own draws."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu", vocab_size: int | None = None):
        self.params, self.device, self._vocab = params, device, vocab_size
        self._batch: BatchSampler | None = None
        self._row = _Row(params)

    def _sampler(self, vocab: int) -> BatchSampler:
        if self._batch is None:
            self._batch = BatchSampler(self._vocab or vocab, self.device)
        return self._batch

    def __call__(self, logits: torch.Tensor, history: torch.Tensor | None = None) -> int:
        batch = self._sampler(logits.shape[-1])
        state = batch.state("row", self.params, [])
        if state.prompt_seen is not None and history is not None and history.numel():
            state.prompt_seen[history.to(state.prompt_seen.device)] = True
        return batch.sample([self._row], logits[None]).tokens["row"]

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution a non-greedy draw uses, after temperature and the filters. logits [V]."""
        return self._sampler(logits.shape[-1]).probabilities([self._row], logits[None])[0]


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """Make every token already seen less likely: positive logits divided, negative multiplied (one row)."""
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[history] = True
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
