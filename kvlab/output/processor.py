"""From a request's new tokens to the text a user sees: one OutputState per request in the engine.

Each step, `OutputState.update(request)` takes the tokens the request gained, feeds them to the
incremental detokenizer (whole characters only) and the stop-string matcher (text that could start
a stop string is held back), and returns a `StepOutput`: the new text, and whether a stop string
ended the request. End-of-sequence tokens are kept in `token_ids` but never shown as text.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.output.detokenizer import IncrementalDetokenizer
from kvlab.output.result import RequestOutput
from kvlab.output.stop import StopStringMatcher
from kvlab.request import Request


@dataclass
class StepOutput:
    """What one engine step added to one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    output: RequestOutput  # the whole output so far (the same object every step)
    error: str | None = None  # set when the engine ended the request because its step failed


class OutputState:
    def __init__(self, request: Request, tokenizer, output: RequestOutput):
        self.output = output
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True) if tokenizer else None
        self.stop = StopStringMatcher(list(request.params.stop))
        self.num_seen = 0  # request.output_token_ids already processed
        self.stop_hit = False

    def update(self, request: Request) -> StepOutput:
        """Process the request's new tokens. `stop_hit` turns True when a stop string appears."""
        new = request.output_token_ids[self.num_seen :]
        self.num_seen = request.num_output_tokens
        out, text = self.output, []
        for token in new:
            out.token_ids.append(token)
            if self.stop_hit or self.detokenizer is None:
                continue
            if token in request.eos_token_ids and not request.params.ignore_eos:
                continue  # the end-of-sequence token itself is never shown
            piece, self.stop_hit = self.stop.push(self.detokenizer.push(token))
            text.append(piece)
        if request.is_finished or self.stop_hit:
            text.append(self._flush())
        out.text += "".join(text)
        return StepOutput(request.request_id, new, "".join(text), request.is_finished or self.stop_hit, out)

    def _flush(self) -> str:
        """At the end: what the detokenizer and the stop matcher still hold (nothing after a stop string)."""
        if self.detokenizer is None or self.stop_hit:
            return ""
        piece, self.stop_hit = self.stop.push(self.detokenizer.flush())
        return piece + ("" if self.stop_hit else self.stop.flush())

    def finish(self, request: Request) -> StepOutput:
        """Close the output of a request that ended without a new token (an abort)."""
        return StepOutput(request.request_id, [], self._flush(), True, self.output)
