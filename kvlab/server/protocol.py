"""The OpenAI wire format, inbound: request bodies checked field by field into engine requests.

No web framework here. Every problem with a request becomes an `APIError` with the status and the
error body OpenAI's API uses: {"error": {"message", "type", "param", "code"}}, naming the field.

Each field is one of:
- **used**: the prompt(s) or messages, the sampling values (in OpenAI's documented ranges, which are
  narrower than kvlab's own API: temperature 0-2), `n`, `best_of`, log-probabilities (`logprobs`,
  `top_logprobs`, `echo`), penalties and `logit_bias`, structured outputs (`response_format`, vLLM's
  `guided_*` and `structured_outputs`: constraints.py), tools (tools.py), `stream`,
  `stream_options`, `cache_salt`;
- **neutral only**: fields for features kvlab does not have, accepted at the value that changes
  nothing (`stop_token_ids: []`, `suffix: ""`, `modalities: ["text"]`, ...) and refused otherwise
  (400, code `unsupported_value`);
- **ignored**: `user` (unless the server salts the prefix cache by it), `store`, `metadata`,
  `service_tier`, and a message's `name` (docs/serving.md lists them);
- anything else is refused (400, code `unknown_parameter`), so that a client never believes a
  setting took effect when it did not.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvlab.errors import KvlabError
from kvlab.sampling import SamplingParams
from kvlab.sampling.params import INT64_MAX, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N, MAX_SEED, StructuredOutputs
from kvlab.server import constraints
from kvlab.server.errors import APIError, invalid
from kvlab.server.tools import ToolSpec, assistant_tool_calls, parameter_schemas, template_has_tools, tool_spec

__all__ = ["APIError", "Limits", "ParsedRequest", "Prompt", "invalid", "parse_chat", "parse_completion", "refuse_early"]


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None = None


@dataclass
class ParsedRequest:
    """A completion or chat request, ready for the engine: one engine request per prompt, each with n choices."""

    kind: str  # "completion" or "chat"
    request_id: str
    prompts: list[Prompt]
    params: SamplingParams
    stream: bool
    include_usage: bool
    cache_salt: str | None = None  # the client's own `cache_salt` (the server may mix a tenant into it)
    user: str | None = None
    echo: bool = False  # completions: the prompt's text (and log-probabilities) before each choice's
    tools: ToolSpec | None = None  # chat: the answer's tool calls are parsed (tools.py)
    tool_schemas: list[dict] = field(default_factory=list)  # every tool's parameters, compiled under any tool_choice
    constraint_param: str | None = None  # the field a structured output came from (its compile error names it)
    reasoning: bool = False  # chat under --reasoning-parser: <think> text is split out of the answer (reasoning.py)
    thinks: bool = False  # the rendered prompt left <think> open: the answer starts inside the thinking

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.prompts[0].token_ids

    @property
    def prompt_text(self) -> str | None:
        return self.prompts[0].text

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, before it is tokenized."""

    max_model_len: int
    max_prompt_chars: int | None = None  # None: no limit (a prompt of token ids)
    max_messages: int = 1024


# ---- the fields -----------------------------------------------------------------------------------

_NEUTRAL_ANY = {"stop_token_ids": ([],), "min_tokens": (0,), "skip_special_tokens": (True,),
                "include_stop_str_in_output": (False,)}  # fmt: skip
_NEUTRAL_COMPLETION = {"suffix": ("",)}
_NEUTRAL_CHAT = {
    "functions": ([],), "function_call": ("none", "auto"), "modalities": (["text"],), "audio": (), "prediction": (),
    "reasoning_effort": (), "add_generation_prompt": (True,), "echo": (False,),
}  # fmt: skip
IGNORED = ("user", "store", "metadata", "service_tier")
_USED = {"model", "stream", "stream_options", "cache_salt", "max_tokens", "max_completion_tokens", "temperature",
         "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos", "repetition_penalty", "presence_penalty",
         "frequency_penalty", "n", "logit_bias", "num_speculative_tokens", *constraints.FIELDS}  # fmt: skip
_FIELDS = {
    "completion": _USED | {"prompt", "best_of", "echo", "logprobs"} | set(IGNORED) | set(_NEUTRAL_ANY)
    | set(_NEUTRAL_COMPLETION),
    "chat": _USED | {"messages", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"}
    | set(IGNORED) | set(_NEUTRAL_ANY) | set(_NEUTRAL_CHAT),
}
# OpenAI's roles → the template's ("developer" is OpenAI's new name for "system")
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_MESSAGE_NEUTRAL = {"refusal": (), "function_call": (), "audio": ()}
_MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", *_MESSAGE_NEUTRAL}
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_PROMPTS = MAX_N  # prompts of one completions request (each prompt × n choices: at most MAX_N in all)
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


def sampling_params(body: dict, default_max_tokens: int, kind: str = "completion") -> SamplingParams:
    """The sampling fields, in the ranges OpenAI documents (kvlab's extras: vLLM's ranges)."""
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise invalid("'ignore_eos' must be true or false", "ignore_eos")
    n = _number(body, "n", 1, 1, MAX_N, integer=True)
    best_of = _number(body, "best_of", None, 1, MAX_N, integer=True)
    if best_of is not None and best_of < n:
        raise invalid(f"'best_of' ({best_of}) must be at least 'n' ({n})", "best_of")
    structured, param = constraints.structured_outputs(body)
    try:
        return SamplingParams(
            max_tokens=_number(body, key, default_max_tokens, 1, INT64_MAX, integer=True),
            temperature=_number(body, "temperature", 1.0, 0, 2),
            top_p=_number(body, "top_p", 1.0, 0, 1, open_low=True),
            top_k=_number(body, "top_k", 0, -1, INT64_MAX, integer=True),
            min_p=_number(body, "min_p", 0.0, 0, 1),
            repetition_penalty=_number(body, "repetition_penalty", 1.0, 0, 2, open_low=True),
            presence_penalty=_number(body, "presence_penalty", 0.0, -2, 2),
            frequency_penalty=_number(body, "frequency_penalty", 0.0, -2, 2),
            logit_bias=_logit_bias(body),
            seed=_number(body, "seed", None, 0, MAX_SEED, integer=True),  # the generator keeps 32 bits
            stop=_stop(body),
            ignore_eos=ignore_eos,
            n=n,
            best_of=best_of if best_of != n else None,
            logprobs=_logprobs(body, kind),
            prompt_logprobs=_logprobs(body, kind) if kind == "completion" and body.get("echo") is True else None,
            structured_outputs=structured,
            num_speculative_tokens=_number(body, "num_speculative_tokens", None, 0, 16, integer=True),
        )
    except KvlabError as e:  # kvlab's own rules (repetition_penalty below 0.01, ignore_eos with a grammar)
        word = str(e).split(" ")[0]
        raise invalid(str(e), word if word in body else param) from None


def _logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's {"token id": bias}: ids as strings (JSON keys), biases in [-100, 100]."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid(f"'logit_bias' must map at most {MAX_LOGIT_BIAS_ENTRIES} token ids to biases", "logit_bias")
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12):  # "²".isdigit() too
            raise invalid(f"'logit_bias' keys must be token ids, got {_show(key)}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise invalid(f"'logit_bias' values must be numbers in [-100, 100], got {_show(value)}", "logit_bias")
        out[int(key)] = float(value)
    return out


def _logprobs(body: dict, kind: str) -> int | None:
    """Completions: `logprobs` k (0..20). Chat: `logprobs: true` and `top_logprobs` k (0..20)."""
    if kind == "completion":
        return _number(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True)
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise invalid("'logprobs' must be true or false", "logprobs")
    top = _number(body, "top_logprobs", None, 0, MAX_LOGPROBS, integer=True)
    if top and not wanted:  # 0 without logprobs changes nothing (a neutral value)
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


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


def _new(kind: str, body: dict, default_max_tokens: int) -> ParsedRequest:
    stream, usage = _stream_flags(body)
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("'user' must be a string", "user")
    params = sampling_params(body, default_max_tokens, kind)
    if stream and params.num_sequences > params.n:
        raise invalid("'best_of' larger than 'n' cannot be streamed (the best choices are known only at the end)",
                      "best_of")  # fmt: skip
    echo = body.get("echo", False) if kind == "completion" else False
    if not isinstance(echo, bool):
        raise invalid("'echo' must be true or false", "echo")
    return ParsedRequest(kind, f"{prefix}-{uuid.uuid4().hex}", [], params, stream, usage,
                         _string(body, "cache_salt", MAX_SALT_CHARS), user, echo=echo,
                         constraint_param=constraints.structured_outputs(body)[1])  # fmt: skip


def refuse_early(tokenizer, text: str, limits: Limits, param: str) -> None:
    """A 400 for a text whose prefix already holds more tokens than the context, before the rest is
    tokenized (Tokenizer.prefix_beyond): a prompt that cannot fit costs a prefix's tokenization, not its own."""
    proof = tokenizer.prefix_beyond(text, limits.max_model_len) if tokenizer is not None else None
    if proof is not None:
        tokens, chars = proof
        raise invalid(f"the prompt's first {chars:,} characters are already {tokens:,} tokens, more than the context "
                      f"of {limits.max_model_len:,} tokens: shorten it", param, "context_length_exceeded")  # fmt: skip


def _check_chars(n: int, limits: Limits, param: str) -> None:
    if limits.max_prompt_chars is not None and n > limits.max_prompt_chars:
        raise invalid(f"the prompt has {n:,} characters, more than the {limits.max_prompt_chars:,} that could fit the "
                      f"context of {limits.max_model_len:,} tokens: shorten it", param, "context_length_exceeded")  # fmt: skip


# ---- the two endpoints ------------------------------------------------------------------------------


def parse_completion(body: dict, encode: Callable[[str], list[int]], limits: Limits) -> ParsedRequest:
    """POST /v1/completions: `prompt` is a string, a list of token ids, or a list of either (several prompts:
    each gets n choices, numbered prompt by prompt)."""
    _check_fields(body, "completion")
    prompt = body.get("prompt")
    single = isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and all(_is_id(t) for t in prompt))
    prompts = [prompt] if single else prompt
    if not isinstance(prompts, list) or not prompts or not all(_is_prompt(p) for p in prompts):
        raise invalid("'prompt' must be a non-empty string, a list of token ids, or a list of those", "prompt")
    parsed = _new("completion", body, 16)  # every field checked before the tokenizer runs
    if len(prompts) * parsed.params.num_sequences > MAX_N:
        raise invalid(f"{len(prompts)} prompts × {parsed.params.num_sequences} choices: at most {MAX_N} in one request",
                      "prompt")  # fmt: skip
    _check_chars(sum(len(p) for p in prompts if isinstance(p, str)), limits, "prompt")
    parsed.prompts = [Prompt(encode(p), p) if isinstance(p, str) else Prompt(list(p)) for p in prompts]
    return parsed


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _is_prompt(p: Any) -> bool:
    return (isinstance(p, str) and bool(p)) or (isinstance(p, list) and bool(p) and all(_is_id(t) for t in p))


def parse_chat(body: dict, encode_chat: Callable[..., list[int]], limits: Limits, template: str | None = None,
               model: str = "", marker_tokens: bool = False) -> ParsedRequest:  # fmt: skip
    """POST /v1/chat/completions: `messages` with roles and text content (a string, text parts, or null
    for an assistant), tool results and tool calls. Without max_tokens the answer may fill the rest of
    the context (OpenAI's default). `encode_chat(messages, tools)`; `template` is the model's chat template;
    `marker_tokens`: its tool-call markers are tokens of their own (tools.markers_are_tokens)."""
    _check_fields(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    if len(messages) > limits.max_messages:
        raise invalid(f"{len(messages):,} messages: at most {limits.max_messages:,} in one request", "messages")
    clean = [_message(i, m) for i, m in enumerate(messages)]
    tools = tool_spec(body, template, model)
    if any(m["role"] == "tool" or m.get("tool_calls") for m in clean) and not template_has_tools(template):
        raise invalid(f"the chat template of {model} has no tools section: it cannot show tool calls or results",
                      "messages")  # fmt: skip
    _check_chars(sum(len(m["content"]) for m in clean), limits, "messages")
    parsed = _new("chat", body, 1)
    parsed.tools, parsed.tool_schemas = tools, parameter_schemas(body)
    if tools is not None:
        tools.marker_tokens = marker_tokens
    if tools is not None and tools.grammar() is not None:
        if parsed.params.structured_outputs is not None:
            raise invalid("a forced tool call ('tool_choice') cannot be combined with a structured output", "tool_choice")
        parsed.params = replace(parsed.params, structured_outputs=StructuredOutputs(grammar=tools.grammar()))
        parsed.constraint_param = "tools"
    ids = encode_chat(clean, tools.tools if tools is not None else None)
    parsed.prompts = [Prompt(ids)]
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        parsed.params = replace(parsed.params, max_tokens=max(limits.max_model_len - len(ids), 1))
    return parsed


def _message(i: int, m: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise invalid(f"{where} must be an object with a 'role'", "messages")
    role = m["role"]
    if role not in ROLES:
        raise invalid(f"{where}.role {_show(role)} is not supported: use one of {', '.join(ROLES)}", "messages")
    for key in m:
        if key not in _MESSAGE_FIELDS:
            raise invalid(f"{where}: unrecognized field {_show(key)}", "messages", "unknown_parameter")
    for key, values in _MESSAGE_NEUTRAL.items():
        if m.get(key) is not None and not any(_same(m[key], v) for v in values):
            raise invalid(f"{where}.{key} is not supported by kvlab", "messages", "unsupported_value")
    if m.get("tool_call_id") is not None and (role != "tool" or not isinstance(m["tool_call_id"], str)):
        raise invalid(f"{where}.tool_call_id belongs to a 'tool' message, as a string", "messages")
    if role == "tool" and not m.get("tool_call_id"):
        raise invalid(f"{where} is a tool result without 'tool_call_id': name the call it answers", "messages")
    calls = m.get("tool_calls")
    if calls is not None and calls != [] and role != "assistant":
        raise invalid(f"{where}.tool_calls belongs to an 'assistant' message", "messages")
    content = m.get("content")
    if content is None and role == "assistant":  # OpenAI allows it (an answer that was only tool calls)
        content = ""
    elif isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        content = "".join(_text_part(f"{where}.content[{j}]", p) for j, p in enumerate(content))
    elif not isinstance(content, str):
        raise invalid(f"{where}.content must be a string or a list of text parts", "messages")
    out = {"role": ROLES[role], "content": content}
    if calls:
        out["tool_calls"] = assistant_tool_calls(where, calls)
    if role == "tool" and m.get("tool_call_id") is not None:
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _text_part(where: str, part: Any) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise invalid(f"{where}: only text parts are supported, got {_show(kind)}", "messages", "unsupported_value")
    if set(part) != {"type", "text"} or not isinstance(part["text"], str):
        raise invalid(f"{where} must be {{'type': 'text', 'text': <string>}}", "messages")
    return part["text"]
