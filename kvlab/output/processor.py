"""From a request's new tokens to the text a user sees: one OutputState per request in the engine.

Each step, `OutputState.update(request)` takes the tokens the request gained, feeds them to the
incremental detokenizer (whole characters only) and the stop-string matcher (text that could start
a stop string is held back), and returns a `StepOutput`: the new text, and whether a stop string
ended the request. End-of-sequence tokens are kept in `token_ids` but never shown as text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.output.detokenizer import IncrementalDetokenizer
from kvlab.output.result import CompletionOutput, RequestOutput
from kvlab.output.stop import StopStringMatcher
from kvlab.request import Request


@dataclass
class StepOutput:
    """What one engine step added to one choice of a request."""

    request_id: str  # the caller's request id (every choice of it shares it)
    new_token_ids: list[int]
    new_text: str
    finished: bool  # the whole request has ended (every choice)
    output: RequestOutput  # the whole output so far (the same object every step)
    error: str | None = None  # set when the engine ended the request because its step failed
    index: int = 0  # the choice
    choice_finished: bool = False  # this choice has ended (its finish_reason is set)
    new_logprobs: list = field(default_factory=list)  # Logprob of each new token shown (SamplingParams.logprobs)


class OutputState:
    """One sequence's text so far: its choice's CompletionOutput, the detokenizer, the stop strings."""

    def __init__(self, request: Request, tokenizer, output: RequestOutput, choice: CompletionOutput | None = None):
        self.output = output
        self.choice = choice or output.outputs[0]
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True) if tokenizer else None
        self.stop = StopStringMatcher(list(request.params.stop))
        self.num_seen = 0  # request.output_token_ids already processed
        self.stop_hit = False
        if request.params.logprobs is not None:
            self.choice.logprobs = []
        if request.params.needs_logprob:
            self.choice.cumulative_logprob = 0.0

    def update(self, request: Request, logprobs: list | None = None) -> StepOutput:
        """Process the request's new tokens (and their Logprobs). `stop_hit` turns True at a stop string."""
        new = request.output_token_ids[self.num_seen :]
        self.num_seen = request.num_output_tokens
        out, text, shown = self.choice, [], []
        for i, token in enumerate(new):
            if self.stop_hit:  # a stop string ended it inside a step's accepted drafts: the rest is dropped
                break
            out.token_ids.append(token)
            lp = logprobs[i] if logprobs and i < len(logprobs) else None
            if lp is not None and out.cumulative_logprob is not None:
                out.cumulative_logprob += lp.logprob
            if token in request.eos_token_ids and not request.params.ignore_eos:
                continue  # the end-of-sequence token itself is never shown
            if lp is not None and out.logprobs is not None:
                shown.append(lp)
            if self.detokenizer is None:
                continue
            piece, self.stop_hit = self.stop.push(self.detokenizer.push(token))
            text.append(piece)
        if out.logprobs is not None:
            out.logprobs.extend(shown)
        if request.is_finished or self.stop_hit:
            text.append(self._flush())
        out.text += "".join(text)
        done = request.is_finished or self.stop_hit
        return StepOutput(request.group_id, new, "".join(text), done, self.output, index=self.choice.index,
                          choice_finished=done, new_logprobs=shown)  # fmt: skip

    def _flush(self) -> str:
        """At the end: what the detokenizer and the stop matcher still hold (nothing after a stop string)."""
        if self.detokenizer is None or self.stop_hit:
            return ""
        piece, self.stop_hit = self.stop.push(self.detokenizer.flush())
        return piece + ("" if self.stop_hit else self.stop.flush())

    def finish(self, request: Request) -> StepOutput:
        """Close the output of a request that ended without a new token (an abort)."""
        text = self._flush()
        self.choice.text += text
        return StepOutput(request.group_id, [], text, True, self.output, index=self.choice.index, choice_finished=True)
