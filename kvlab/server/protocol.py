"""The OpenAI wire format, inbound: request bodies checked field by field into engine requests.

No web framework here. Every problem with a request becomes an `APIError` with the status and the
error body OpenAI's API uses: {"error": {"message", "type", "param", "code"}}, naming the field.

Each field is one of:
- **used**: the prompt or messages, the sampling values (in OpenAI's documented ranges, which are
  narrower than kvlab's own API: temperature 0-2), `stream`, `stream_options`, `cache_salt`;
- **neutral only**: fields for features kvlab does not have, accepted at the value that changes
  nothing (`n: 1`, `tools: []`, `logit_bias: {}`, `tool_choice: "none"`, `response_format:
  {"type": "text"}`, ...) and refused otherwise (400, code `unsupported_value`);
- **ignored**: `user` (unless the server salts the prefix cache by it), `store`, `metadata`,
  `service_tier`, and a message's `name` (docs/serving.md lists them);
- anything else is refused (400, code `unknown_parameter`), so that a client never believes a
  setting took effect when it did not.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Any, Callable

from kvlab.errors import KvlabError
from kvlab.sampling import SamplingParams
from kvlab.sampling.params import INT64_MAX, INT64_MIN


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


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
    cache_salt: str | None = None  # the client's own `cache_salt` (the server may mix a tenant into it)
    user: str | None = None


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, before it is tokenized."""

    max_model_len: int
    max_prompt_chars: int | None = None  # None: no limit (a prompt of token ids)
    max_messages: int = 1024


# ---- the fields -----------------------------------------------------------------------------------

_NEUTRAL_ANY = {"n": (1,), "logit_bias": ({},), "stop_token_ids": ([],), "min_tokens": (0,),
                "skip_special_tokens": (True,), "include_stop_str_in_output": (False,)}  # fmt: skip
_NEUTRAL_COMPLETION = {"best_of": (1,), "echo": (False,), "logprobs": (), "suffix": ("",)}
_NEUTRAL_CHAT = {
    "logprobs": (False,), "top_logprobs": (0,), "tools": ([],), "tool_choice": ("none", "auto"),
    "parallel_tool_calls": (True, False), "response_format": ({"type": "text"},), "functions": ([],),
    "function_call": ("none", "auto"), "modalities": (["text"],), "audio": (), "prediction": (),
    "reasoning_effort": (), "add_generation_prompt": (True,), "echo": (False,),
}  # fmt: skip
IGNORED = ("user", "store", "metadata", "service_tier")
_USED = {"model", "stream", "stream_options", "cache_salt", "max_tokens", "max_completion_tokens", "temperature",
         "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos", "repetition_penalty", "presence_penalty",
         "frequency_penalty"}  # fmt: skip
_FIELDS = {
    "completion": _USED | {"prompt"} | set(IGNORED) | set(_NEUTRAL_ANY) | set(_NEUTRAL_COMPLETION),
    "chat": _USED | {"messages"} | set(IGNORED) | set(_NEUTRAL_ANY) | set(_NEUTRAL_CHAT),
}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}  # OpenAI → template
_MESSAGE_NEUTRAL = {"tool_calls": ([],), "refusal": (), "function_call": (), "audio": ()}
_MESSAGE_FIELDS = {"role", "content", "name", *_MESSAGE_NEUTRAL}
MAX_STOP_CHARS = 256  # the stop matcher looks back this far at every token
MAX_SALT_CHARS = 1024


def _show(value: Any) -> str:
    return f"{value!r:.80}"


def _same(value: Any, neutral: Any) -> bool:
    """Equal and of the same JSON type (Python says False == 0 and True == 1)."""
    return type(value) is type(neutral) and value == neutral


def _check_fields(body: dict, kind: str) -> None:
    for key in body:
        if key not in _FIELDS[kind]:
            raise invalid(f"Unrecognized request argument supplied: {_show(key)}", key, "unknown_parameter")
    neutral = {**_NEUTRAL_ANY, **(_NEUTRAL_COMPLETION if kind == "completion" else _NEUTRAL_CHAT)}
    for key, values in neutral.items():
        value = body.get(key)
        if value is not None and not any(_same(value, v) for v in values):
            accepted = " or ".join(["null", *map(repr, values)])
            message = f"'{key}' = {_show(value)} is not supported by kvlab (only {accepted})"
            raise invalid(message, key, "unsupported_value")


def _number(body: dict, key: str, default, lo, hi, integer: bool = False, open_low: bool = False):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise invalid(f"'{key}' must be {'an integer' if integer else 'a number'}, got {_show(value)}", key)
    if (value <= lo if open_low else value < lo) or value > hi:  # JSON has no NaN (refused on parsing); 1e400 is inf
        raise invalid(f"'{key}' must be in {'(' if open_low else '['}{lo}, {hi}], got {_show(value)}", key)
    return value


def _string(body: dict, key: str, max_chars: int) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > max_chars:
        raise invalid(f"'{key}' must be a non-empty string of at most {max_chars} characters", key)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise invalid(f"'stop' must be a string or a list of non-empty strings of at most {MAX_STOP_CHARS} characters",
                      "stop")  # fmt: skip
    if len(stop) > 4:
        raise invalid("at most 4 stop sequences", "stop")
    return tuple(stop)


def sampling_params(body: dict, default_max_tokens: int) -> SamplingParams:
    """The sampling fields, in the ranges OpenAI documents (kvlab's extras: vLLM's ranges)."""
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(body, key, 0, -2, 2) != 0:
            message = f"'{key}' is not supported by kvlab (only 0); see 'repetition_penalty'"
            raise invalid(message, key, "unsupported_value")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise invalid("'ignore_eos' must be true or false", "ignore_eos")
    try:
        return SamplingParams(
            max_tokens=_number(body, key, default_max_tokens, 1, INT64_MAX, integer=True),
            temperature=_number(body, "temperature", 1.0, 0, 2),
            top_p=_number(body, "top_p", 1.0, 0, 1, open_low=True),
            top_k=_number(body, "top_k", 0, -1, INT64_MAX, integer=True),
            min_p=_number(body, "min_p", 0.0, 0, 1),
            repetition_penalty=_number(body, "repetition_penalty", 1.0, 0, 2, open_low=True),
            seed=_number(body, "seed", None, INT64_MIN, INT64_MAX, integer=True),
            stop=_stop(body),
            ignore_eos=ignore_eos,
        )
    except KvlabError as e:  # kvlab's own floor (repetition_penalty below 0.01)
        raise invalid(str(e), str(e).split(" ")[0]) from None


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid("'stream' must be true or false", "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise invalid("'stream_options' is only allowed with 'stream': true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise invalid("'stream_options' must be an object with at most 'include_usage'", "stream_options")
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise invalid("'stream_options.include_usage' must be true or false", "stream_options")
    return stream, usage


def _new(kind: str, body: dict, ids: list[int], text: str | None, default_max_tokens: int) -> ParsedRequest:
    stream, usage = _stream_flags(body)
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("'user' must be a string", "user")
    return ParsedRequest(kind, f"{prefix}-{uuid.uuid4().hex}", ids, text, sampling_params(body, default_max_tokens),
                         stream, usage, _string(body, "cache_salt", MAX_SALT_CHARS), user)  # fmt: skip


def _check_chars(n: int, limits: Limits, param: str) -> None:
    if limits.max_prompt_chars is not None and n > limits.max_prompt_chars:
        raise invalid(f"the prompt has {n:,} characters, more than the {limits.max_prompt_chars:,} that could fit the "
                      f"context of {limits.max_model_len:,} tokens: shorten it", param, "context_length_exceeded")  # fmt: skip


# ---- the two endpoints ------------------------------------------------------------------------------


def parse_completion(body: dict, encode: Callable[[str], list[int]], limits: Limits) -> ParsedRequest:
    """POST /v1/completions: `prompt` is a string, a list of token ids, or a list of one of either."""
    _check_fields(body, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        _check_chars(len(prompt), limits, "prompt")
        text, ids = prompt, None
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        text, ids = None, list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise invalid("kvlab takes one prompt per request (send several requests: they are batched)", "prompt")
    else:
        raise invalid("'prompt' must be a non-empty string or a list of token ids", "prompt")
    parsed = _new("completion", body, [], text, 16)  # every field checked before the tokenizer runs
    parsed.prompt_token_ids = encode(text) if ids is None else ids
    return parsed


def parse_chat(body: dict, encode_chat: Callable[[list[dict]], list[int]], limits: Limits) -> ParsedRequest:
    """POST /v1/chat/completions: `messages` with roles and text content (a string, text parts, or null
    for an assistant). Without max_tokens the answer may fill the rest of the context (OpenAI's default)."""
    _check_fields(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    if len(messages) > limits.max_messages:
        raise invalid(f"{len(messages):,} messages: at most {limits.max_messages:,} in one request", "messages")
    clean = [_message(i, m) for i, m in enumerate(messages)]
    _check_chars(sum(len(m["content"]) for m in clean), limits, "messages")
    parsed = _new("chat", body, [], None, 1)
    parsed.prompt_token_ids = ids = encode_chat(clean)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        parsed.params = replace(parsed.params, max_tokens=max(limits.max_model_len - len(ids), 1))
    return parsed


def _message(i: int, m: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise invalid(f"{where} must be an object with a 'role'", "messages")
    role = m["role"]
    if role not in ROLES:
        hint = " (kvlab has no tool calls)" if role in ("tool", "function") else ""
        raise invalid(f"{where}.role {_show(role)} is not supported{hint}: use one of {', '.join(ROLES)}", "messages")
    for key in m:
        if key not in _MESSAGE_FIELDS:
            raise invalid(f"{where}: unrecognized field {_show(key)}", "messages", "unknown_parameter")
    for key, values in _MESSAGE_NEUTRAL.items():
        if m.get(key) is not None and not any(_same(m[key], v) for v in values):
            raise invalid(f"{where}.{key} is not supported by kvlab", "messages", "unsupported_value")
    content = m.get("content")
    if content is None and role == "assistant":  # OpenAI allows it (an answer that was only tool calls)
        content = ""
    elif isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        content = "".join(_text_part(f"{where}.content[{j}]", p) for j, p in enumerate(content))
    elif not isinstance(content, str):
        raise invalid(f"{where}.content must be a string or a list of text parts", "messages")
    return {"role": ROLES[role], "content": content}


def _text_part(where: str, part: Any) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise invalid(f"{where}: only text parts are supported, got {_show(kind)}", "messages", "unsupported_value")
    if set(part) != {"type", "text"} or not isinstance(part["text"], str):
        raise invalid(f"{where} must be {{'type': 'text', 'text': <string>}}", "messages")
    return part["text"]
