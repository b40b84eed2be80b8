"""The OpenAI wire format, outbound: results shaped into responses and server-sent events.

`finish_reason` is always one of OpenAI's values: an aborted request (the server shutting down)
reports "length" — its answer was cut short — and says "abort" only in kvlab's own field. Every
response carries that `kvlab` field: the request's timing split, and kvlab's finish reason.
"""

from __future__ import annotations

import time
from typing import Any

from kvlab.output.result import RequestOutput
from kvlab.server.protocol import ParsedRequest

_OPENAI_FINISH = {"stop": "stop", "length": "length", "abort": "length"}


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else _OPENAI_FINISH.get(reason, "stop")


def kvlab_field(output: RequestOutput) -> dict:
    return {**output.metrics.timing_split(), "finish_reason": output.finish_reason}


def usage(output: RequestOutput) -> dict:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": output.metrics.cached_prompt_tokens}}  # fmt: skip


def response(req: ParsedRequest, model: str, output: RequestOutput) -> dict:
    """The whole answer (no streaming), with kvlab's timing split as an extra field."""
    reason = finish_reason(output.finish_reason)
    if req.kind == "completion":
        choice = {"index": 0, "text": output.text, "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": output.text}, "logprobs": None,
                  "finish_reason": reason}  # fmt: skip
        obj = "chat.completion"
    return {"id": req.request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(output), "kvlab": kvlab_field(output)}  # fmt: skip


def chunk(req: ParsedRequest, model: str, text: str | None, finish: str | None = None, first: bool = False) -> dict:
    """One server-sent event's payload. `text` None with a kvlab finish reason: the closing chunk."""
    reason = finish_reason(finish)
    if req.kind == "completion":
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    else:
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        obj = "chat.completion.chunk"
    return {"id": req.request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(req: ParsedRequest, model: str, output: RequestOutput) -> dict:
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {"id": req.request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(output)}  # fmt: skip


def model_card(name: str, max_model_len: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvlab", "max_model_len": max_model_len}
