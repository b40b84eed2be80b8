"""Ollama's native API, for the editors and desktop apps that speak only it.

    POST /api/chat       messages (+ tools, format, options, think) → a message; NDJSON stream by default
    POST /api/generate   prompt (+ system; `raw` skips the template) → a response; NDJSON stream by default
    GET  /api/tags       the served model, as Ollama lists pulled ones
    POST /api/show       its details, template, context length and capabilities
    GET  /api/version    the Ollama API version these routes follow
    GET  /api/ps         (app.py: ps.py's payload, read by `kvlab ps` too)

Each request is translated into the OpenAI chat body the chat route checks (adapter.py), so the same
fields, limits, structured-output masks and tool-call parsing apply. `options` map to the sampler
(`num_predict` → max_tokens, `repeat_penalty` → repetition_penalty, ...); hardware options are
ignored, sampling methods kvlab does not have are accepted only at their neutral value. `format`
is "json" or a JSON schema. Counts and durations (nanoseconds) are Ollama's fields, from the engine's
own timing split, which rides along as `kvlab`. Errors are Ollama's `{"error": "..."}`.
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import datetime, timezone
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvlab.server import responses
from kvlab.server.access_log import log_request
from kvlab.server.adapter import Answer, Call, Served, check_model, final, frames, start, whole
from kvlab.server.errors import APIError, invalid
from kvlab.server.tools import template_has_tools

OLLAMA_VERSION = "0.12.0"  # the Ollama API release whose routes and fields these follow (clients gate on it)
NDJSON = "application/x-ndjson"

# options → the OpenAI field they set
_OPTIONS = {"num_predict": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
            "min_p": "min_p", "seed": "seed", "stop": "stop", "repeat_penalty": "repetition_penalty",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}  # fmt: skip
# how the model is run: nothing to do with one request's answer (kvlab's own flags set them)
_IGNORED_OPTIONS = {"numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all", "vocab_only",
                    "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep", "repeat_last_n",
                    "penalize_newline", "mirostat_tau", "mirostat_eta"}  # fmt: skip
_NEUTRAL_OPTIONS = {"mirostat": 0, "tfs_z": 1, "typical_p": 1}  # sampling methods kvlab does not have
_COMMON = {"model", "stream", "format", "options", "keep_alive", "think", "logprobs", "top_logprobs"}
_CHAT_FIELDS = _COMMON | {"messages", "tools"}
_GENERATE_FIELDS = _COMMON | {"prompt", "suffix", "system", "template", "context", "raw", "images"}
_MESSAGE_FIELDS = {"role", "content", "images", "thinking", "tool_calls", "tool_name", "tool_call_id"}


def add_ollama_routes(app: FastAPI, served: Served, authorized, started: float) -> None:
    """Mount Ollama's routes. `started`: time.time() when the server began (the model's modified_at)."""

    @app.post("/api/chat")
    async def chat(request: Request, key: str | None = Depends(authorized)):
        return await _answer(served, request, key, "chat")

    @app.post("/api/generate")
    async def generate(request: Request, key: str | None = Depends(authorized)):
        return await _answer(served, request, key, "generate")

    @app.get("/api/tags", dependencies=[Depends(authorized)])
    async def tags(request: Request):
        log_request(request, 200)
        return {"models": [_listing(served, started)]}

    @app.post("/api/show", dependencies=[Depends(authorized)])
    async def show(request: Request):
        from kvlab.server.body import parse_json, read_body

        body = parse_json(await read_body(request, served.config.max_body_bytes, served.config.body_timeout_s))
        name = body.get("model", body.get("name"))  # older clients send "name"
        check_model({"model": name}, served.model_name)
        log_request(request, 200)
        return _show(served, started)

    @app.get("/api/version")
    async def version(request: Request):
        log_request(request, 200)
        return {"version": OLLAMA_VERSION}


async def _answer(served: Served, request: Request, key: str | None, kind: str):
    arrived = time.perf_counter()
    try:
        begun = await start(served, request, key, lambda body: _translate(served, body, kind))
    except _Load as load:  # no prompt: Ollama's way to load a model, answered at once
        return JSONResponse(_head(served, load.kind) | {"done": True, "done_reason": "load"})
    call = begun.call
    if call.stream:
        encoder = _Stream(served, call, kind, arrived)
        return StreamingResponse(frames(begun, encoder, request), media_type=NDJSON)
    output = await final(begun, request)
    answer = whole(served, call, output.outputs[0].text)
    body = _head(served, kind)
    if kind == "chat":
        body["message"] = _message(answer.text, answer.thinking, answer.calls)
    else:
        body["response"] = answer.text
        body |= {"thinking": answer.thinking} if answer.thinking is not None else {}
    stats = _stats(output, arrived)
    if answer.unfinished_thinking:
        stats["kvlab"]["thinking_unfinished"] = True  # num_predict ended the answer inside its thinking
    return JSONResponse(body | {"done": True} | stats)


class _Load(Exception):
    def __init__(self, kind: str):
        self.kind = kind


# ---- requests ------------------------------------------------------------------------------------------------


def _translate(served: Served, body: dict, kind: str) -> Call:
    """An Ollama body as the OpenAI chat (or, `raw`, completions) body the server checks."""
    fields = _CHAT_FIELDS if kind == "chat" else _GENERATE_FIELDS
    for name in body:
        if name not in fields:
            raise invalid(f"unknown field {name!r:.80}", name)
    check_model(body, served.model_name)
    stream = body.get("stream", True)
    if stream is None:
        stream = True
    if not isinstance(stream, bool):
        raise invalid("'stream' must be true or false", "stream")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise invalid("'logprobs' is not supported by kvlab's Ollama API (use /v1/chat/completions)", "logprobs")
    out: dict[str, Any] = {"model": served.model_name}
    out |= _options(body.get("options"))
    out |= _format(body.get("format"))
    extra = _think(body.get("think"))
    completion = False
    if kind == "chat":
        messages = body.get("messages")
        if messages is None or messages == []:
            raise _Load(kind)
        out["messages"] = _messages(messages)
        if body.get("tools"):
            out["tools"] = body["tools"]
    else:
        prompt = body.get("prompt")
        if prompt is None or prompt == "":
            raise _Load(kind)
        if not isinstance(prompt, str):
            raise invalid("'prompt' must be a string", "prompt")
        for name, neutral in (("suffix", ""), ("template", ""), ("context", []), ("images", [])):
            if body.get(name) not in (None, neutral):
                raise invalid(f"'{name}' is not supported by kvlab", name)
        raw = body.get("raw", False)
        if not isinstance(raw, bool):
            raise invalid("'raw' must be true or false", "raw")
        system = body.get("system")
        if system is not None and not isinstance(system, str):
            raise invalid("'system' must be a string", "system")
        if raw:  # the prompt as it is: a completion
            completion = True
            out["prompt"] = prompt
        else:
            out["messages"] = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": prompt}]  # fmt: skip
    if completion and "max_tokens" not in out:
        out["max_tokens"] = None  # filled by _fit: Ollama's default is the rest of the context
    num_ctx = _num_ctx(body.get("options"))
    return Call(out, "completion" if completion else "chat", extra, stream, after=_fit(out, num_ctx, served))


def _options(options: Any) -> dict:
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise invalid("'options' must be an object", "options")
    out = {}
    for name, value in options.items():
        if value is None or name in _IGNORED_OPTIONS or name == "num_ctx":
            continue
        if name in _NEUTRAL_OPTIONS:
            if value != _NEUTRAL_OPTIONS[name] or isinstance(value, bool):
                raise invalid(f"options.{name} = {value!r:.40} is not supported by kvlab (only "
                              f"{_NEUTRAL_OPTIONS[name]}: kvlab has no such sampler)", "options")  # fmt: skip
            continue
        if name not in _OPTIONS:
            raise invalid(f"unknown option {name!r:.80}", "options")
        if name == "num_predict" and isinstance(value, int) and not isinstance(value, bool) and value < 0:
            continue  # -1: no limit, -2: fill the context; both the rest of the context
        if name == "stop" and value == []:
            continue
        out[_OPTIONS[name]] = value
    return out


def _num_ctx(options: Any) -> int | None:
    value = options.get("num_ctx") if isinstance(options, dict) else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(f"options.num_ctx must be a positive integer, got {value!r:.40}", "options")
    return value


def _fit(out: dict, num_ctx: int | None, served: Served):
    """Once tokenized: without num_predict the answer may fill the context (num_ctx's, when smaller)."""

    def after(parsed) -> None:
        from dataclasses import replace

        context = min(num_ctx or served.llm.engine.max_model_len, served.llm.engine.max_model_len)
        prompt_len = len(parsed.prompt_token_ids)
        if num_ctx is not None and prompt_len >= context:
            raise invalid(f"the prompt is {prompt_len:,} tokens, options.num_ctx {num_ctx:,}: raise num_ctx "
                          "(kvlab does not cut prompts)", "options")  # fmt: skip
        if out.get("max_tokens") is None:
            parsed.params = replace(parsed.params, max_tokens=max(context - prompt_len, 1))

    return after


def _format(value: Any) -> dict:
    if value is None or value == "":
        return {}
    if value == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(value, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": value}}}
    raise invalid("'format' must be \"json\" or a JSON schema object", "format")


def _think(value: Any) -> dict:
    """`think` reaches the chat template as enable_thinking (true, false, or an effort: "low", "medium", "high")."""
    if value is None:
        return {}
    if isinstance(value, bool):
        return {"enable_thinking": value}
    if value in ("low", "medium", "high"):
        return {"enable_thinking": True}
    raise invalid("'think' must be true, false, \"low\", \"medium\" or \"high\"", "think")


def _messages(messages: Any) -> list[dict]:
    """Ollama's messages as OpenAI's: tool calls get ids, and a tool result names the call it answers."""
    if not isinstance(messages, list):
        raise invalid("'messages' must be a list", "messages")
    out, pending = [], []  # pending: (id, name) of the calls not answered yet
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}] must be an object", "messages")
        unknown = set(m) - _MESSAGE_FIELDS
        if unknown:
            raise invalid(f"messages[{i}]: unknown field {sorted(unknown)[0]!r:.80}", "messages")
        if m.get("images"):
            raise invalid(f"messages[{i}].images: kvlab serves text models only", "messages")
        clean = {"role": m.get("role"), "content": "" if m.get("content") is None else m.get("content")}
        if m.get("tool_calls"):
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise invalid(f"messages[{i}].tool_calls must be a list", "messages")
            clean["tool_calls"] = [_call_in(i, j, c) for j, c in enumerate(calls)]
            pending = [(c["id"], c["function"]["name"]) for c in clean["tool_calls"]]
        if m.get("role") == "tool":
            name = m.get("tool_name")
            match = next((p for p in pending if name is None or p[1] == name), None)
            if match is not None:
                pending.remove(match)
            clean["tool_call_id"] = m.get("tool_call_id") or (match[0] if match else f"call_{i}")
        out.append(clean)
    return out


def _call_in(i: int, j: int, call: Any) -> dict:
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise invalid(f"messages[{i}].tool_calls[{j}] must be {{'function': {{'name', 'arguments'}}}}", "messages")
    arguments = f.get("arguments", {})
    if isinstance(arguments, str):  # some clients send the JSON text, as OpenAI does
        text = arguments
    elif isinstance(arguments, dict):
        text = json.dumps(arguments, ensure_ascii=False)
    else:
        raise invalid(f"messages[{i}].tool_calls[{j}].function.arguments must be an object", "messages")
    return {"id": call.get("id") or f"call_{i}_{j}", "type": "function",
            "function": {"name": f["name"], "arguments": text}}  # fmt: skip


# ---- answers -------------------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _head(served: Served, kind: str) -> dict:
    head = {"model": served.model_name, "created_at": _now()}
    return head | ({"message": {"role": "assistant", "content": ""}} if kind == "chat" else {"response": ""})


def _message(text: str, thinking: str | None, calls: list[dict]) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking is not None:
        message["thinking"] = thinking
    if calls:
        message["tool_calls"] = [_call_out(c) for c in calls]
    return message


def _call_out(call: dict) -> dict:
    """A parsed call as Ollama writes one: arguments as an object."""
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        arguments = {}
    return {"function": {"name": call["function"]["name"], "arguments": arguments}}


def _stats(output, arrived: float) -> dict:
    """Ollama's counts and durations (nanoseconds), and kvlab's timing split."""
    m, choice = output.metrics, output.outputs[0]
    reason = {"stop": "stop", "length": "length", "abort": "length"}.get(choice.finish_reason, "stop")
    return {
        "done_reason": reason,
        "total_duration": int((time.perf_counter() - arrived) * 1e9),
        "load_duration": 0,  # the model was loaded when the server started
        "prompt_eval_count": len(output.prompt_token_ids),
        "prompt_eval_duration": int(m.prefill_s * 1e9),
        "eval_count": len(choice.token_ids),
        "eval_duration": int(m.decode_s * 1e9),
        "kvlab": responses.kvlab_field(output),
    }


class _Stream:
    """NDJSON lines: the answer's pieces as they come, then the last line with done: true and the counts."""

    def __init__(self, served: Served, call: Call, kind: str, arrived: float):
        self.served, self.kind, self.arrived = served, kind, arrived
        self.answer = Answer(served, call)

    def start(self) -> list[str]:
        return []

    def item(self, out) -> list[str]:
        pieces = self.answer.push(out.new_text)
        if out.finished:
            pieces += self.answer.finish()
        lines = []
        for p in pieces:
            head = _head(self.served, self.kind)
            if self.kind == "chat":
                text = p.text if p.kind == "text" else ""
                head["message"] = _message(text, p.text if p.kind == "thinking" else None,
                                           [p.call] if p.call else [])  # fmt: skip
            elif p.kind == "text":
                head["response"] = p.text
            elif p.kind == "thinking":
                head["thinking"] = p.text
            else:
                continue  # /api/generate has no tools
            lines.append(_line(head | {"done": False}))
        if out.finished:
            stats = _stats(out.output, self.arrived)
            if self.answer.unfinished_thinking:
                stats["kvlab"]["thinking_unfinished"] = True
            lines.append(_line(_head(self.served, self.kind) | {"done": True} | stats))
        return lines

    def error(self, error: APIError) -> list[str]:
        return [_line({"error": error.message})]


def _line(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False) + "\n"


# ---- the model ------------------------------------------------------------------------------------------------


def _listing(served: Served, started: float) -> dict:
    from kvlab.server.ps import ps_payload

    held = ps_payload(served.llm, served.model_name, started)["models"][0]
    modified = datetime.fromtimestamp(started, timezone.utc).isoformat().replace("+00:00", "Z")
    digest = hashlib.sha256(served.model_name.encode()).hexdigest()  # a stable id for the name (no manifest here)
    return {"name": served.model_name, "model": served.model_name, "modified_at": modified,
            "size": held["kvlab"]["weight_bytes"], "digest": digest, "details": _details(held)}  # fmt: skip


def _details(held: dict) -> dict:
    d = held["details"]
    return {"parent_model": "", "format": d["format"], "family": d["family"], "families": [d["family"]],
            "parameter_size": d["parameter_size"], "quantization_level": d["quantization_level"]}  # fmt: skip


def _show(served: Served, started: float) -> dict:
    from kvlab.server.ps import ps_payload

    held = ps_payload(served.llm, served.model_name, started)["models"][0]
    tokenizer = served.llm.tokenizer
    template = tokenizer.chat_template if tokenizer is not None else None
    family = held["details"]["family"]
    capabilities = ["completion"] + (["tools"] if template_has_tools(template) else []) + \
        (["thinking"] if served.config.reasoning_parser is not None else [])  # fmt: skip
    info = {"general.architecture": family, f"{family}.context_length": held["context_length"],
            "general.parameter_count": _parameter_count(served)}  # fmt: skip
    return {"modelfile": f"FROM {served.model_name}\n", "parameters": "", "template": template or "",
            "details": _details(held), "model_info": info, "capabilities": capabilities,
            "modified_at": _listing(served, started)["modified_at"]}  # fmt: skip


def _parameter_count(served: Served) -> int | None:
    from kvlab.memory.weights import count_params

    params = count_params(served.llm.loaded.config)
    return params.total if params else None


