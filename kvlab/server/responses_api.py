"""OpenAI's Responses API, which OpenAI's newer agents speak.

    POST   /v1/responses        input (a string or items: messages, function calls and their outputs),
                                instructions, max_output_tokens, temperature / top_p, text.format,
                                function tools, reasoning, previous_response_id, store; streamed as the
                                Responses events (response.created, response.output_item.added,
                                response.output_text.delta, ..., response.completed)
    GET    /v1/responses/{id}   a stored response
    DELETE /v1/responses/{id}   forget it

The request becomes the OpenAI chat body the chat route checks (adapter.py). A response is stored
(unless `store: false`) with the conversation that led to it, in a bounded in-memory store (the oldest
go first); `previous_response_id` continues that conversation, and since the new prompt starts with
the old one, the prefix cache serves it. A stored response is visible only with the API key that made
it. Output items: `reasoning` (with --reasoning-parser), `message` (output_text), `function_call`.
Errors have OpenAI's shape.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvlab.server import responses
from kvlab.server.access_log import log_request
from kvlab.server.adapter import Answer, Call, Served, cached_tokens, check_model, final, frames, sse, start, whole
from kvlab.server.errors import APIError, invalid
from kvlab.server.response_store import ResponseStore, Stored

_FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "tools",
           "tool_choice", "parallel_tool_calls", "stream", "previous_response_id", "store", "metadata", "user",
           "reasoning", "truncation", "include", "service_tier", "prompt_cache_key", "background",
           "top_logprobs"}  # fmt: skip
_NEUTRAL = {"truncation": ("disabled",), "include": ([],), "background": (False,), "top_logprobs": (0,)}


def add_responses_routes(app: FastAPI, served: Served, authorized, store: ResponseStore | None = None) -> None:
    store = store if store is not None else ResponseStore()

    @app.post("/v1/responses")
    async def create(request: Request, key: str | None = Depends(authorized)):
        begun = await start(served, request, key, lambda body: _translate(served, store, body, key))
        call = begun.call
        if call.stream:
            encoder = _Stream(served, call, lambda response: _keep(store, call, response, key))
            return StreamingResponse(frames(begun, encoder, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        output = await final(begun, request)
        answer = whole(served, call, output.outputs[0].text)
        response = _response(served, call, "completed", _items(call, answer), output, answer.thinking)
        _keep(store, call, response, key)
        return JSONResponse(response)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(request: Request, response_id: str, key: str | None = Depends(authorized)):
        stored = store.get(response_id, key)
        if stored is None:
            raise _not_found(response_id)
        log_request(request, 200)
        return stored.response

    @app.delete("/v1/responses/{response_id}")
    async def delete(request: Request, response_id: str, key: str | None = Depends(authorized)):
        if not store.delete(response_id, key):
            raise _not_found(response_id)
        log_request(request, 200)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _not_found(rid: str) -> APIError:
    return APIError(404, f"Response with id {rid!r:.80} not found.", param="response_id", code="not_found")


def _keep(store: ResponseStore, call: Call, response: dict, key: str | None) -> None:
    if not call.wire["store"]:
        return
    said: list[dict] = []
    for item in response["output"]:
        if item["type"] == "message":
            said.append({"role": "assistant", "content": "".join(c["text"] for c in item["content"])})
        elif item["type"] == "function_call":
            if not said or said[-1].get("tool_calls") is None:
                said.append({"role": "assistant", "content": "", "tool_calls": []})
            said[-1]["tool_calls"].append({"id": item["call_id"], "type": "function",
                                           "function": {"name": item["name"], "arguments": item["arguments"]}})
    store.put(response["id"], Stored(response, call.wire["history"] + said, key))


# ---- requests ------------------------------------------------------------------------------------------------


def _translate(served: Served, store: ResponseStore, body: dict, key: str | None) -> Call:
    for name in body:
        if name not in _FIELDS:
            raise invalid(f"Unrecognized request argument supplied: {name!r:.80}", name, "unknown_parameter")
    for name, values in _NEUTRAL.items():
        if body.get(name) is not None and body[name] not in values:
            raise invalid(f"'{name}' = {body[name]!r:.80} is not supported by kvlab", name, "unsupported_value")
    check_model(body, served.model_name)
    stream, keep = body.get("stream", False), body.get("store", True)
    for name, value in (("stream", stream), ("store", keep)):
        if value is not None and not isinstance(value, bool):
            raise invalid(f"'{name}' must be true or false", name)
    history: list[dict] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        stored = store.get(previous, key) if isinstance(previous, str) else None
        if stored is None:
            raise APIError(404, f"Previous response with id {previous!r:.80} not found.",
                           param="previous_response_id", code="previous_response_not_found")  # fmt: skip
        history = list(stored.messages)
    history += _input(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("'instructions' must be a string", "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    out: dict[str, Any] = {"model": served.model_name, "messages": system + history}
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("parallel_tool_calls", "parallel_tool_calls"), ("user", "user")):  # fmt: skip
        if body.get(theirs) is not None:
            out[ours] = body[theirs]
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    out |= _text_format(body.get("text"))
    wire = {"id": f"resp_{uuid.uuid4().hex}", "store": keep is not False, "history": history, "previous": previous,
            "instructions": instructions, "body": body}  # fmt: skip
    return Call(out, "chat", _reasoning(body.get("reasoning")), bool(stream), wire)


def _reasoning(value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict) or set(value) - {"effort", "summary", "generate_summary"}:
        raise invalid("'reasoning' must be {'effort', 'summary'}", "reasoning")
    effort = value.get("effort")
    if effort is None:
        return {}
    if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise invalid(f"'reasoning.effort' {effort!r:.40} is not one of none, minimal, low, medium, high", "reasoning")
    return {"enable_thinking": effort != "none"}


def _input(value: Any) -> list[dict]:
    """`input` as OpenAI chat messages: a string is one user message; items are messages, function calls (an
    assistant's tool calls) and function-call outputs (tool messages)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise invalid("'input' must be a string or a list of items", "input")
    out: list[dict] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}.role must be user, system, developer or assistant", "input")
            out.append({"role": role, "content": _content(where, item.get("content"))})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise invalid(f"{where}: a function_call needs call_id, name and arguments (JSON text)", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise invalid(f"{where}: a function_call_output needs its call_id", "input")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _content(where + ".output", item.get("output"))})  # fmt: skip
        elif kind == "reasoning":
            continue  # an earlier turn's thinking: templates leave it out
        else:
            raise invalid(f"{where}: items of type {kind!r:.40} are not supported", "input")
    if not out:
        raise invalid("'input' holds no message", "input")
    return out


def _content(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of text parts", "input")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") or \
                not isinstance(part.get("text"), str):  # fmt: skip
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid(f"{where}.content[{j}]: only text parts are supported, got {kind!r:.40}", "input")
        parts.append(part["text"])
    return "".join(parts)


def _tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise invalid("'tools' must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or \
                set(t) - {"type", "name", "description", "parameters", "strict"}:  # fmt: skip
            raise invalid(f"tools[{i}]: only function tools {{'type': 'function', 'name', 'parameters'}} are "
                          "supported", "tools")  # fmt: skip
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type" and v is not None}})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid("'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'name'}", "tool_choice")


def _text_format(text: Any) -> dict:
    if text is None:
        return {}
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or not isinstance(fmt, (dict, type(None))):
        raise invalid("'text' must be {'format': {...}}", "text")
    if fmt is None or fmt.get("type") == "text":
        return {}
    if fmt.get("type") == "json_object":
        return {"response_format": {"type": "json_object"}}
    if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", **spec}}}
    raise invalid("'text.format' must be text, json_object, or json_schema with a 'schema'", "text")


# ---- answers -------------------------------------------------------------------------------------------------


def _ids() -> str:
    return uuid.uuid4().hex[:24]


def _reasoning_item(rid: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": rid, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}  # fmt: skip


def _message_item(mid: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": content if status == "completed" else []}  # fmt: skip


def _call_item(call: dict, arguments: str | None = None, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": call["function"]["name"], "status": status,
            "arguments": call["function"]["arguments"] if arguments is None else arguments}  # fmt: skip


def _items(call: Call, answer) -> list[dict]:
    status = "incomplete" if answer.unfinished_thinking else "completed"  # max_output_tokens ended the thinking
    items = [_reasoning_item(f"rs_{_ids()}", answer.thinking, status)] if answer.thinking is not None else []
    if answer.text or not answer.calls:
        items.append(_message_item(f"msg_{_ids()}", answer.text))
    return items + [_call_item(c) for c in answer.calls]


def _response(served: Served, call: Call, status: str, output: list[dict], result=None,
              thinking: str | None = None) -> dict:  # fmt: skip
    body = call.wire["body"]
    text = body.get("text") or {}
    response = {
        "id": call.wire["id"], "object": "response", "created_at": int(time.time()), "status": status,
        "error": None, "incomplete_details": None, "instructions": call.wire["instructions"],
        "max_output_tokens": body.get("max_output_tokens"), "model": served.model_name, "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "previous_response_id": call.wire["previous"],
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": call.wire["store"], "temperature": body.get("temperature", 1.0), "text": {"format": {"type": "text"},
        **text}, "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0), "truncation": "disabled", "usage": None, "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }  # fmt: skip
    if result is None:
        return response
    choice = result.outputs[0]
    if choice.finish_reason in ("length", "abort"):
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    prompt, generated = len(result.prompt_token_ids), len(choice.token_ids)
    reasoning_tokens = len(served.llm.tokenizer.encode(thinking, add_special_tokens=False)) if thinking else 0
    response["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached_tokens(result)},
                         "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                         "total_tokens": prompt + generated}  # fmt: skip
    response["kvlab"] = responses.kvlab_field(result)
    return response


class _Stream:
    """The Responses events: created, in_progress; each output item added, filled by deltas, done in turn
    (reasoning, message, each function call); then completed (or incomplete, at max_output_tokens)."""

    def __init__(self, served: Served, call: Call, keep):
        self.served, self.call, self.keep = served, call, keep
        self.answer = Answer(served, call)
        self.seq = 0
        self.items: list[dict] = []  # done
        self.open: dict | None = None  # the item being streamed: its kind, id, text so far
        self.thinking: str | None = None

    def _event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(kind, payload)

    def start(self) -> list[str]:
        response = _response(self.served, self.call, "in_progress", [])
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]  # fmt: skip

    def _begin(self, kind: str) -> list[str]:
        frames = self._finish()
        index = len(self.items)
        if kind == "reasoning":
            self.open = {"kind": kind, "id": f"rs_{_ids()}", "text": ""}
            item = {"type": "reasoning", "id": self.open["id"], "summary": [], "content": [], "status": "in_progress"}
            return frames + [self._event("response.output_item.added", output_index=index, item=item)]
        self.open = {"kind": kind, "id": f"msg_{_ids()}", "text": ""}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return frames + [
            self._event("response.output_item.added", output_index=index,
                        item=_message_item(self.open["id"], "", "in_progress")),
            self._event("response.content_part.added", item_id=self.open["id"], output_index=index, content_index=0,
                        part=part),
        ]  # fmt: skip

    def _finish(self) -> list[str]:
        if self.open is None:
            return []
        o, index, self.open = self.open, len(self.items), None
        where = {"item_id": o["id"], "output_index": index, "content_index": 0}
        if o["kind"] == "reasoning":
            item = _reasoning_item(o["id"], o["text"], "incomplete" if self.answer.unfinished_thinking else "completed")
            self.thinking = (self.thinking or "") + o["text"]
            frames = [self._event("response.reasoning_text.done", **where, text=o["text"])]
        else:
            item = _message_item(o["id"], o["text"])
            frames = [self._event("response.output_text.done", **where, text=o["text"], logprobs=[]),
                      self._event("response.content_part.done", **where, part=item["content"][0])]  # fmt: skip
        self.items.append(item)
        return frames + [self._event("response.output_item.done", output_index=index, item=item)]

    def item(self, out) -> list[str]:
        pieces = self.answer.push(out.new_text) + (self.answer.finish() if out.finished else [])
        frames = []
        for p in pieces:
            if p.kind in ("thinking", "text"):
                kind = "reasoning" if p.kind == "thinking" else "message"
                if self.open is None or self.open["kind"] != kind:
                    frames += self._begin(kind)
                self.open["text"] += p.text
                delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                extra = {} if kind == "reasoning" else {"logprobs": []}
                frames.append(self._event(delta, item_id=self.open["id"], output_index=len(self.items),
                                          content_index=0, delta=p.text, **extra))  # fmt: skip
            else:
                frames += self._finish()
                index, done = len(self.items), _call_item(p.call)
                frames += [
                    self._event("response.output_item.added", output_index=index,
                                item=_call_item(p.call, "", "in_progress")),
                    self._event("response.function_call_arguments.delta", item_id=done["id"], output_index=index,
                                delta=done["arguments"]),
                    self._event("response.function_call_arguments.done", item_id=done["id"], output_index=index,
                                arguments=done["arguments"]),
                    self._event("response.output_item.done", output_index=index, item=done),
                ]  # fmt: skip
                self.items.append(done)
        if not out.finished:
            return frames
        if not self.items and self.open is None:  # nothing said: an empty message, as a whole answer has
            frames += self._begin("message")
        frames += self._finish()
        response = _response(self.served, self.call, "completed", self.items, out.output, self.thinking)
        self.keep(response)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return frames + [self._event(kind, response=response)]

    def error(self, error: APIError) -> list[str]:
        response = _response(self.served, self.call, "failed", self.items)
        response["error"] = {"code": error.code or "server_error", "message": error.message}
        return [self._event("response.failed", response=response)]
