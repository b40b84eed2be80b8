"""The OpenAI wire format: request bodies checked into engine requests, results shaped into responses.

No web framework here. Every problem with a request becomes an `APIError` with the status and the
error body OpenAI's API uses: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from kvlab.errors import KvlabError
from kvlab.output.result import RequestOutput
from kvlab.sampling import SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


@dataclass
class ParsedRequest:
    """A completion or chat request, ready for the engine."""

    kind: str  # "completion" or "chat"
    request_id: str
    prompt_token_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    stream: bool
    include_usage: bool


# fields OpenAI clients send that kvlab accepts only at their neutral value
_NEUTRAL = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "suffix": None,
            "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "tools": None, "tool_choice": None,
            "response_format": None, "parallel_tool_calls": None}  # fmt: skip
_IGNORED = {"user", "store", "metadata", "service_tier", "stream_options", "model", "messages", "prompt", "stream",
            "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
            "ignore_eos", "repetition_penalty"}  # fmt: skip


def _number(body: dict, key: str, default, kind=float):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise invalid(f"'{key}' must be {'an integer' if kind is int else 'a number'}, got {value!r}", key)
    return kind(value)


def _check_neutral(body: dict) -> None:
    for key, neutral in _NEUTRAL.items():
        value = body.get(key, neutral)
        if value is not None and value != neutral and not (key == "logprobs" and value is False):
            raise invalid(f"'{key}' = {value!r} is not supported by kvlab (only {neutral!r})", key)


def sampling_params(body: dict, default_max_tokens: int) -> SamplingParams:
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > 4:
            raise invalid("at most 4 stop sequences", "stop")
        stop = tuple(stop)
    else:
        raise invalid("'stop' must be a string or a list of strings", "stop")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = default_max_tokens if max_tokens is None else _number({"max_tokens": max_tokens}, "max_tokens", 0, int)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise invalid("'ignore_eos' must be true or false", "ignore_eos")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0),
            top_p=_number(body, "top_p", 1.0),
            top_k=_number(body, "top_k", 0, int),
            min_p=_number(body, "min_p", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0),
            seed=_number(body, "seed", None, int) if body.get("seed") is not None else None,
            stop=stop,
            ignore_eos=ignore_eos,
        )
    except KvlabError as e:
        raise invalid(str(e), str(e).split(" ")[0]) from None


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise invalid("'stream_options' must be an object", "stream_options")
    return stream, bool(options.get("include_usage", False)) and stream


def parse_completion(body: dict, encode) -> ParsedRequest:
    """POST /v1/completions: `prompt` is a string, a list of token ids, or a list of one of either."""
    _check_neutral(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        text, ids = prompt, encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        text, ids = None, list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise invalid("kvlab takes one prompt per request (send several requests: they are batched)", "prompt")
    else:
        raise invalid("'prompt' must be a non-empty string or a list of token ids", "prompt")
    stream, usage = _stream_flags(body)
    return ParsedRequest("completion", f"cmpl-{uuid.uuid4().hex}", ids, text, sampling_params(body, 16), stream, usage)


def parse_chat(body: dict, encode_chat, max_model_len: int) -> ParsedRequest:
    """POST /v1/chat/completions: `messages` with roles and text content (a string or text parts).

    Without max_tokens the answer may fill the rest of the context (OpenAI's default for chat).
    """
    _check_neutral(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(f"messages[{i}] must be an object with a 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise invalid(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise invalid(f"messages[{i}].content must be a string", "messages")
        clean.append({"role": m["role"], "content": content})
    stream, usage = _stream_flags(body)
    ids = encode_chat(clean)
    params = sampling_params(body, max(max_model_len - len(ids), 1))
    return ParsedRequest("chat", f"chatcmpl-{uuid.uuid4().hex}", ids, None, params, stream, usage)


# ---- responses ------------------------------------------------------------------------------------


def usage(output: RequestOutput) -> dict:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def response(req: ParsedRequest, model: str, output: RequestOutput) -> dict:
    """The whole answer (no streaming), with kvlab's timing split as an extra field."""
    if req.kind == "completion":
        choice = {"index": 0, "text": output.text, "logprobs": None, "finish_reason": output.finish_reason}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": output.text}, "logprobs": None,
                  "finish_reason": output.finish_reason}  # fmt: skip
        obj = "chat.completion"
    return {"id": req.request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(output), "kvlab": output.metrics.timing_split()}  # fmt: skip


def chunk(req: ParsedRequest, model: str, text: str | None, finish_reason: str | None = None,
          first: bool = False) -> dict:  # fmt: skip
    """One server-sent event's payload. `text` None with a finish reason: the closing chunk."""
    if req.kind == "completion":
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    return {"id": req.request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(req: ParsedRequest, model: str, output: RequestOutput) -> dict:
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {"id": req.request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(output)}  # fmt: skip


def model_card(name: str, max_model_len: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvlab", "max_model_len": max_model_len}
