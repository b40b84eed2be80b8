"""A request's choices: n (or best_of) sequences in the engine, one RequestOutput for the caller.

The first sequence carries the caller's request id and prefills the prompt; the others are forked
from it when its prompt is done (Scheduler.fork) and are known as `Request.choice_id(id, i)`. The
request has ended when every choice has; with best_of > n the n choices of highest cumulative
log-probability are kept, renumbered 0..n-1, in that order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.output.result import CompletionOutput, RequestOutput
from kvlab.sampling.params import SamplingParams


@dataclass
class RequestGroup:
    output: RequestOutput
    params: SamplingParams
    live: set[str] = field(default_factory=set)  # sequence ids still in the engine

    @classmethod
    def new(cls, output: RequestOutput, params: SamplingParams, first_id: str) -> RequestGroup:
        output.outputs = [output.outputs[0] if output.outputs else CompletionOutput()]
        output.outputs += [CompletionOutput(index=i) for i in range(1, params.num_sequences)]
        if params.prompt_logprobs is not None:
            output.prompt_logprobs = [None]  # the first prompt token has no log-probability
        return cls(output, params, {first_id})

    def choice(self, index: int) -> CompletionOutput:
        return self.output.outputs[index]

    def finish(self, seq_id: str) -> bool:
        """Sequence `seq_id` has ended; True when it was the last."""
        self.live.discard(seq_id)
        if self.live:
            return False
        for c in self.output.outputs:  # choices never forked: the request was aborted before its first token
            c.finish_reason = c.finish_reason or "abort"
        self.output.cached_prompt_tokens = self.output.outputs[0].metrics.cached_prompt_tokens  # the prompt's own
        if self.params.num_sequences > self.params.n:
            self._keep_best()
        return True

    def _keep_best(self) -> None:
        ranked = sorted(self.output.outputs, key=lambda c: -(c.cumulative_logprob or 0.0))[: self.params.n]
        for i, c in enumerate(ranked):
            c.index = i
        self.output.outputs = ranked
