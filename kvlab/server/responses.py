"""The OpenAI wire format, outbound: results shaped into responses and server-sent events.

A request has one engine request per prompt (RequestOutput), each with n choices; choice `index` is
prompt × n + choice. `finish_reason` is always one of OpenAI's values: an aborted request (the server
shutting down) reports "length" — its answer was cut short — and says "abort" only in kvlab's own
field; a chat answer whose text held tool calls reports "tool_calls". Every response carries that
`kvlab` field: the timing split of the first choice (with `choices`: every choice's, when there are
several), and kvlab's finish reason.
"""

from __future__ import annotations

import time
from typing import Any

from kvlab.output.result import CompletionOutput, RequestOutput
from kvlab.server.logprobs import CompletionLogprobs, TokenText, chat_logprobs, merge
from kvlab.server.protocol import ParsedRequest
from kvlab.server.reasoning import split as split_thinking
from kvlab.server.tools import parse_tool_calls

_OPENAI_FINISH = {"stop": "stop", "length": "length", "abort": "length"}


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else _OPENAI_FINISH.get(reason, "stop")


def choices_of(req: ParsedRequest, outputs: list[RequestOutput]) -> list[tuple[int, RequestOutput, CompletionOutput]]:
    """(wire index, its request's output, the choice) for every choice, in index order."""
    n = req.params.n
    return [(p * n + c.index, out, c) for p, out in enumerate(outputs) for c in out.outputs]


def kvlab_field(outputs: RequestOutput | list[RequestOutput], req: ParsedRequest | None = None) -> dict:
    outputs = [outputs] if isinstance(outputs, RequestOutput) else outputs
    first = outputs[0]
    field = {**first.metrics.timing_split(), "finish_reason": first.finish_reason}
    if len(outputs) > 1 or len(first.outputs) > 1:
        n = req.params.n if req is not None else len(first.outputs)
        field["choices"] = [{"index": p * n + c.index, **c.metrics.timing_split(), "finish_reason": c.finish_reason}
                            for p, out in enumerate(outputs) for c in out.outputs]  # fmt: skip
    return field


def usage(outputs: RequestOutput | list[RequestOutput]) -> dict:
    """Prompt tokens once per prompt (its choices share it), completion tokens of every choice."""
    outputs = [outputs] if isinstance(outputs, RequestOutput) else outputs
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(_cached(o) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


def _cached(output: RequestOutput) -> int:
    """The prompt's prefix-cache hit (a forked choice's own figure is the whole prompt, shared from it)."""
    return output.metrics.cached_prompt_tokens if output.cached_prompt_tokens is None else output.cached_prompt_tokens


def _head(req: ParsedRequest, model: str, obj: str) -> dict:
    return {"id": req.request_id, "object": obj, "created": int(time.time()), "model": model}


def response(req: ParsedRequest, model: str, outputs: list[RequestOutput], text: TokenText) -> dict:
    """The whole answer (no streaming), with kvlab's timing split as an extra field."""
    if req.kind == "completion":
        choices = [completion_choice(req, i, out, c, text) for i, out, c in choices_of(req, outputs)]
        obj = "text_completion"
    else:
        choices = [chat_choice(req, i, c, text) for i, _, c in choices_of(req, outputs)]
        obj = "chat.completion"
    field = kvlab_field(outputs, req)
    if req.reasoning and any(split_thinking(c.text, req.thinks)[2] for _, _, c in choices_of(req, outputs)):
        field["thinking_unfinished"] = True  # max_tokens ended an answer inside its thinking
    return {**_head(req, model, obj), "choices": choices, "usage": usage(outputs), "kvlab": field}


def completion_choice(req: ParsedRequest, index: int, out: RequestOutput, c: CompletionOutput, text: TokenText) -> dict:
    body, logprobs = c.text, None
    if req.echo:
        body = echo_text(out, text) + body
    if c.logprobs is not None:
        lp = CompletionLogprobs(text)
        logprobs = lp.block(out.prompt_logprobs or [], out.prompt_token_ids) if req.echo else lp.block([])
        logprobs = merge(logprobs, lp.block(c.logprobs))
    return {"index": index, "text": body, "logprobs": logprobs, "finish_reason": finish_reason(c.finish_reason)}


def echo_text(out: RequestOutput, text: TokenText) -> str:
    if out.prompt is not None:
        return out.prompt
    return text.tokenizer.decode(out.prompt_token_ids) if text.tokenizer is not None else ""


def chat_choice(req: ParsedRequest, index: int, c: CompletionOutput, text: TokenText) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    reason = finish_reason(c.finish_reason)
    answer = c.text
    if req.reasoning:  # --reasoning-parser: the thinking apart, as vLLM's reasoning_content
        thinking, answer, _ = split_thinking(c.text, req.thinks)
        message = {"role": "assistant", "content": answer if answer or thinking is None else None,
                   "reasoning_content": thinking}  # fmt: skip
    if req.tools is not None:
        content, calls = parse_tool_calls(answer, {f["name"] for f in req.tools.functions})
        if calls:
            message = {**message, "content": content, "tool_calls": calls}
            reason = "tool_calls" if c.finish_reason == "stop" else reason
    return {"index": index, "message": message, "logprobs": chat_logprobs(c.logprobs, text), "finish_reason": reason}


def chunk(req: ParsedRequest, model: str, choices: list[dict]) -> dict:
    """One server-sent event's payload."""
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {**_head(req, model, obj), "choices": choices}


def usage_chunk(req: ParsedRequest, model: str, outputs: list[RequestOutput]) -> dict:
    return {**chunk(req, model, []), "usage": usage(outputs)}


def model_card(name: str, max_model_len: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvlab", "max_model_len": max_model_len}
