"""Anthropic's Messages API, for coding agents and SDKs built for Claude.

    POST /v1/messages                 system, messages of content blocks, max_tokens, stop_sequences,
                                      temperature / top_p / top_k, tools (tool_use / tool_result blocks),
                                      tool_choice, thinking, output_config.format; streamed as Anthropic's
                                      events (message_start, content_block_start / _delta / _stop,
                                      message_delta, message_stop)
    POST /v1/messages/count_tokens    the prompt's tokens, as the chat template renders it

The request becomes the OpenAI chat body the chat route checks (adapter.py): `system` a system
message, `tool_result` blocks tool messages, `tool_use` blocks the assistant's tool calls, Anthropic's
tools OpenAI's functions (`input_schema` → parameters), `tool_choice` any → required, `metadata.user_id`
the `user` (the tenant under --cache-salt-by user). The key may come as `x-api-key`. Answers are content
blocks — `thinking` (with --reasoning-parser), `text`, `tool_use` — with stop_reason end_turn,
max_tokens, stop_sequence or tool_use, and usage (input tokens served from the prefix cache as
cache_read_input_tokens). Errors are {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvlab.server import responses
from kvlab.server.access_log import log_request
from kvlab.server.adapter import Answer, Call, Served, cached_tokens, check_model, final, frames, sse, start
from kvlab.server.adapter import stop_string, whole
from kvlab.server.body import parse_json, read_body
from kvlab.server.errors import APIError, invalid

_FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "tools",
           "tool_choice", "stream", "metadata", "thinking", "output_config", "service_tier"}  # fmt: skip
_COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config"}
_TOOL_FIELDS = {"name", "description", "input_schema", "type", "cache_control", "strict"}


def add_anthropic_routes(app: FastAPI, served: Served, authorized) -> None:
    @app.post("/v1/messages")
    async def messages(request: Request, key: str | None = Depends(authorized)):
        begun = await start(served, request, key, lambda body: _translate(served, body, _FIELDS))
        call = begun.call
        if call.stream:
            return StreamingResponse(frames(begun, _Stream(served, call), request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        output = await final(begun, request)
        return JSONResponse(_message(served, call, output))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request, key: str | None = Depends(authorized)):
        raw = await read_body(request, served.config.max_body_bytes, served.config.body_timeout_s)

        def count() -> int:
            call = _translate(served, {**parse_json(raw), "max_tokens": 1}, _COUNT_FIELDS | {"max_tokens"})
            return len(served.check("chat", call.body, call.extra).prompt_token_ids)

        counted = await asyncio.get_running_loop().run_in_executor(served.workers, count)
        log_request(request, 200)
        return {"input_tokens": counted}


# ---- requests ------------------------------------------------------------------------------------------------


def _translate(served: Served, body: dict, fields: set[str]) -> Call:
    for name in body:
        if name not in fields:
            raise invalid(f"{name}: Extra inputs are not permitted", name)
    check_model(body, served.model_name)
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise invalid("max_tokens: a positive integer is required", "max_tokens")
    temperature = body.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                    or not 0 <= temperature <= 1):  # fmt: skip
        raise invalid("temperature: must be a number in [0, 1]", "temperature")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("stream: must be true or false", "stream")
    out: dict[str, Any] = {"model": served.model_name, "max_tokens": max_tokens, "messages": _messages(body)}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                         ("stop", "stop_sequences")):  # fmt: skip
        if body.get(theirs) is not None:
            out[ours] = body[theirs]
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
            raise invalid("metadata: only user_id is accepted", "metadata")
        if metadata.get("user_id") is not None:
            out["user"] = metadata["user_id"]
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
    out |= _tool_choice(body.get("tool_choice"))
    output_config = body.get("output_config")
    if output_config is not None:
        fmt = output_config.get("format") if isinstance(output_config, dict) else None
        if not isinstance(output_config, dict) or set(output_config) - {"format", "effort"} or \
                (fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "json_schema")):  # fmt: skip
            raise invalid("output_config: only format {'type': 'json_schema', 'schema': ...} is supported",
                          "output_config")  # fmt: skip
        if fmt is not None:
            out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                             "schema": fmt.get("schema", {})}}
    return Call(out, "chat", _thinking(body.get("thinking")), stream, wire={"id": f"msg_{uuid.uuid4().hex[:24]}"})


def _thinking(value: Any) -> dict:
    if value is None:
        return {}
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise invalid("thinking: {'type': 'enabled', 'budget_tokens': N} or {'type': 'disabled'}", "thinking")
    return {"enable_thinking": kind != "disabled"}


def _text(where: str, content: Any) -> str:
    """A string, or text blocks joined (the content of system prompts and tool results)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}: a string or a list of text blocks is required", "messages")
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise invalid(f"{where}.{j}: only text blocks are supported here, got {kind!r:.40}", "messages")
        parts.append(block["text"])
    return "".join(parts)


def _messages(body: dict) -> list[dict]:
    """Anthropic's system and messages as OpenAI's messages."""
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text("system", body["system"])})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages: a non-empty list is required", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or set(m) - {"role", "content"}:
            raise invalid(f"messages.{i}: {{'role': 'user' | 'assistant', 'content'}} is required", "messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise invalid(f"messages.{i}.content: a string or a list of content blocks is required", "messages")
        out += _assistant(i, content) if m["role"] == "assistant" else _user(i, content)
    return out


def _user(i: int, blocks: list) -> list[dict]:
    out, text = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_result" and isinstance(b.get("tool_use_id"), str):
            result = _text(f"messages.{i}.content.{j}.content", b.get("content", ""))
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                        "content": f"Error: {result}" if b.get("is_error") else result})  # fmt: skip
        else:
            raise invalid(f"messages.{i}.content.{j}: {kind!r:.40} blocks are not supported (text and tool_result "
                          "are)", "messages")  # fmt: skip
    return out + ([{"role": "user", "content": "".join(text)}] if text else [])


def _assistant(i: int, blocks: list) -> list[dict]:
    text, calls = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_use" and isinstance(b.get("name"), str) and isinstance(b.get("input", {}), dict):
            calls.append({"id": b.get("id") or f"toolu_{i}_{j}", "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})  # fmt: skip
        elif kind in ("thinking", "redacted_thinking"):
            continue  # an earlier turn's thinking: templates leave it out
        else:
            raise invalid(f"messages.{i}.content.{j}: {kind!r:.40} blocks are not supported in an assistant turn",
                          "messages")  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    return [message | ({"tool_calls": calls} if calls else {})]


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise invalid("tools: a list is required", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or set(t) - _TOOL_FIELDS or t.get("type") not in (None, "custom"):
            raise invalid(f"tools.{i}: only custom tools {{'name', 'description', 'input_schema'}} are supported",
                          "tools")  # fmt: skip
        function = {"name": t.get("name"), "parameters": t.get("input_schema")}
        out.append({"type": "function", "function": function | ({"description": t["description"]}
                                                                  if "description" in t else {})})  # fmt: skip
    return out


def _tool_choice(choice: Any) -> dict:
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none") or (kind == "tool" and not isinstance(choice.get("name"), str)):
        raise invalid("tool_choice: {'type': 'auto' | 'any' | 'tool' (with 'name') | 'none'}", "tool_choice")
    out: dict[str, Any] = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}.get(kind) or
                           {"type": "function", "function": {"name": choice["name"]}}}  # fmt: skip
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


# ---- answers -------------------------------------------------------------------------------------------------


def _stop_reason(served: Served, call: Call, choice, has_calls: bool) -> tuple[str, str | None]:
    if choice.finish_reason in ("length", "abort"):
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    stop = stop_string(served, call.parsed, choice)
    return ("stop_sequence", stop) if stop is not None else ("end_turn", None)


def _usage(output, output_tokens: int) -> dict:
    cached = cached_tokens(output)
    return {"input_tokens": len(output.prompt_token_ids) - cached, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}  # fmt: skip


def _head(served: Served, call: Call) -> dict:
    return {"id": call.wire["id"], "type": "message", "role": "assistant", "model": served.model_name}


def _tool_use(call: dict) -> dict:
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": arguments if isinstance(arguments, dict) else {}}  # fmt: skip


def _message(served: Served, call: Call, output) -> dict:
    choice = output.outputs[0]
    answer = whole(served, call, choice.text)
    content = []
    if answer.thinking is not None:
        content.append({"type": "thinking", "thinking": answer.thinking, "signature": ""})
    if answer.text or not answer.calls:
        content.append({"type": "text", "text": answer.text})
    content += [_tool_use(c) for c in answer.calls]
    reason, sequence = _stop_reason(served, call, choice, bool(answer.calls))
    field = responses.kvlab_field(output) | ({"thinking_unfinished": True} if answer.unfinished_thinking else {})
    return _head(served, call) | {"content": content, "stop_reason": reason, "stop_sequence": sequence,
                                  "usage": _usage(output, len(choice.token_ids)), "kvlab": field}


class _Stream:
    """Anthropic's events: message_start, then each block opened, filled by deltas and closed in turn
    (thinking, text, each tool_use), then message_delta (stop_reason, usage) and message_stop."""

    def __init__(self, served: Served, call: Call):
        self.served, self.call = served, call
        self.answer = Answer(served, call)
        self.index = -1
        self.open: str | None = None  # the kind of the block open now
        self.calls = 0

    def start(self) -> list[str]:
        message = _head(self.served, self.call) | {"content": [], "stop_reason": None, "stop_sequence": None,
                                                   "usage": {"input_tokens": len(self.call.parsed.prompt_token_ids),
                                                             "output_tokens": 0}}  # fmt: skip
        return [sse("message_start", {"type": "message_start", "message": message})]

    def _block(self, kind: str, block: dict) -> list[str]:
        frames = self._close()
        self.index += 1
        self.open = kind
        return frames + [sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                                     "content_block": block})]  # fmt: skip

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict) -> str:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def item(self, out) -> list[str]:
        pieces = self.answer.push(out.new_text) + (self.answer.finish() if out.finished else [])
        frames = []
        for p in pieces:
            if p.kind == "thinking":
                if self.open != "thinking":
                    frames += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                frames.append(self._delta({"type": "thinking_delta", "thinking": p.text}))
            elif p.kind == "text":
                if self.open != "text":
                    frames += self._block("text", {"type": "text", "text": ""})
                frames.append(self._delta({"type": "text_delta", "text": p.text}))
            else:
                use = _tool_use(p.call)
                self.calls += 1
                frames += self._block("tool_use", {**use, "input": {}})
                frames.append(self._delta({"type": "input_json_delta", "partial_json": json.dumps(use["input"])}))
        if not out.finished:
            return frames
        if self.index < 0:  # nothing was said: one empty text block, as a whole answer has
            frames += self._block("text", {"type": "text", "text": ""})
        frames += self._close()
        choice = out.output.outputs[0]
        reason, sequence = _stop_reason(self.served, self.call, choice, self.calls > 0)
        usage = _usage(out.output, len(choice.token_ids))
        frames.append(sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                          "stop_sequence": sequence}, "usage": usage}))  # fmt: skip
        return frames + [sse("message_stop", {"type": "message_stop"})]

    def error(self, error: APIError) -> list[str]:
        kind = "api_error" if error.status >= 500 else "invalid_request_error"
        return [sse("error", {"type": "error", "error": {"type": kind, "message": error.message}})]
