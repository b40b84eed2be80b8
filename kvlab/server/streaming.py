"""A streamed answer: the engine's StepOutputs (of every prompt and choice) as server-sent event payloads.

Each choice streams on its own: chat sends its role first, then content (and, with tools, each tool
call once its markup closes: tools.ToolStream), completions their text (after the prompt, with
`echo`); log-probabilities ride with the tokens they belong to. A choice ends with a chunk carrying
its finish_reason; the request's last such chunk also carries the `kvlab` field, and a usage chunk
follows when `stream_options.include_usage` asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.output.processor import StepOutput
from kvlab.output.result import RequestOutput
from kvlab.server import responses
from kvlab.server.logprobs import CompletionLogprobs, TokenText, chat_content
from kvlab.server.protocol import ParsedRequest
from kvlab.server.reasoning import ThinkSplitter
from kvlab.server.tools import ToolStream


@dataclass
class _Choice:
    started: bool = False
    tools: ToolStream | None = None
    logprobs: CompletionLogprobs | None = None
    done: bool = False
    think: ThinkSplitter | None = None  # --reasoning-parser: thinking streams as reasoning_content


@dataclass
class EventStream:
    req: ParsedRequest
    model: str
    outputs: list[RequestOutput]  # one per prompt
    text: TokenText
    choices: dict[int, _Choice] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i in range(self.req.num_choices):
            names = {f["name"] for f in self.req.tools.functions} if self.req.tools is not None else set()
            self.choices[i] = _Choice(tools=ToolStream(names) if self.req.tools is not None else None,
                                      logprobs=CompletionLogprobs(self.text))  # fmt: skip
            if self.req.reasoning:
                self.choices[i].think = ThinkSplitter(inside=self.req.thinks)

    def start(self) -> list[dict]:
        if self.req.kind != "chat":
            return []
        return [responses.chunk(self.req, self.model, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}])
                for i in range(self.req.num_choices)]  # fmt: skip

    def item(self, prompt: int, out: StepOutput) -> list[dict]:
        """The payloads one StepOutput of prompt `prompt` gives."""
        index = prompt * self.req.params.n + out.index
        state = self.choices[index]
        body = self._chat(index, state, out) if self.req.kind == "chat" else self._completion(index, state, out, prompt)
        payloads = [responses.chunk(self.req, self.model, [body])] if body else []
        if out.choice_finished and not state.done:
            state.done = True
            payloads += self._end(index, state, out)
        if out.finished:  # an aborted request reports only its last choice: close the others too
            for c in range(self.req.params.n):
                other = prompt * self.req.params.n + c
                if not self.choices[other].done:
                    self.choices[other].done = True
                    payloads += self._end(
                        other, self.choices[other], StepOutput(out.request_id, [], "", True, out.output, index=c)
                    )
        return payloads

    def _completion(self, index: int, state: _Choice, out: StepOutput, prompt: int) -> dict | None:
        text, logprobs = out.new_text, None
        wants = self.req.params.logprobs is not None
        if not state.started and self.req.echo:
            output = self.outputs[prompt]
            text = responses.echo_text(output, self.text) + text
            if wants:
                logprobs = state.logprobs.block(output.prompt_logprobs or [], output.prompt_token_ids)
        state.started = True
        if wants and out.new_logprobs:
            block = state.logprobs.block(out.new_logprobs)
            logprobs = block if logprobs is None else {k: logprobs[k] + block[k] for k in block}
        if not text and logprobs is None:
            return None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}

    def _chat(self, index: int, state: _Choice, out: StepOutput) -> dict | None:
        content, calls, thinking = out.new_text, [], ""
        if state.think is not None:
            thinking, content = state.think.push(content)
            if out.choice_finished:
                more_thinking, more = state.think.flush()
                thinking, content = thinking + more_thinking, content + more
        if state.tools is not None:
            content, calls = state.tools.push(content)
            if out.choice_finished:
                rest, last = state.tools.flush()
                content, calls = content + rest, calls + last
        delta = ({"reasoning_content": thinking} if thinking else {}) | ({"content": content} if content else {}) | \
            ({"tool_calls": calls} if calls else {})  # fmt: skip
        logprobs = None
        if self.req.params.logprobs is not None and out.new_logprobs:
            logprobs = {"content": chat_content(out.new_logprobs, self.text), "refusal": None}
        if not delta and logprobs is None:
            return None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}

    def _end(self, index: int, state: _Choice, out: StepOutput) -> list[dict]:
        reason = out.output.outputs[out.index].finish_reason
        wire = responses.finish_reason(reason)
        if state.tools is not None and state.tools.calls and reason == "stop":
            wire = "tool_calls"
        body = {"index": index, "finish_reason": wire, "logprobs": None}
        body |= {"delta": {}} if self.req.kind == "chat" else {"text": ""}
        last = responses.chunk(self.req, self.model, [body])
        if all(c.done for c in self.choices.values()):
            last["kvlab"] = responses.kvlab_field(self.outputs, self.req)
            if any(c.think is not None and c.think.unfinished for c in self.choices.values()):
                last["kvlab"]["thinking_unfinished"] = True  # max_tokens ended an answer inside its thinking
            tail = [responses.usage_chunk(self.req, self.model, self.outputs)] if self.req.include_usage else []
            return [last, *tail]
        return [last]

    @property
    def finished(self) -> bool:
        return all(c.done for c in self.choices.values())
