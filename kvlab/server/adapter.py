"""What every wire format shares: one request's way to the engine and back, whatever API it came in.

Ollama's API (ollama_api.py), Anthropic's Messages (anthropic_api.py) and OpenAI's Responses
(responses_api.py) are thin adapters over the path the OpenAI chat route takes (app.py):

    body read within its limits ─► admission ─► worker thread: the adapter's `translate(body)` gives an
    OpenAI chat body (+ chat-template extras), checked by the same `parse_chat` and engine checks
    ─► admission by cost ─► the request's cache salt ─► Generation.submit ─► the engine thread

and back: `Answer` cuts the generated text into thinking (reasoning.py), text and tool calls
(tools.py), streamed or whole; `frames` drives a stream whose frames the adapter's encoder writes
(NDJSON, or server-sent events with event names), with the same release, abort and access line as
the OpenAI streams. Errors are `APIError`s; the app writes them in the shape of the API the path
belongs to (errors.error_body).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request

from kvlab.output.result import RequestOutput
from kvlab.server.access_log import log_request
from kvlab.server.admission import Cost
from kvlab.server.async_engine import EngineDead
from kvlab.server.body import parse_json, read_body
from kvlab.server.errors import APIError
from kvlab.server.generation import Generation, item_error
from kvlab.server.protocol import ParsedRequest
from kvlab.server.reasoning import ThinkSplitter
from kvlab.server.tools import ToolStream

@dataclass
class Served:
    """The server's pieces an adapter's routes use (create_app builds one)."""

    llm: Any  # kvlab.LLM: its tokenizer (the engine is the engine thread's)
    engine: Any  # AsyncEngine
    config: Any  # ServerConfig
    admission: Any  # Admission
    workers: Any  # ThreadPoolExecutor
    check: Callable[[str, dict, dict], ParsedRequest]  # kind, an OpenAI body, template extras → checked (app.py)
    salt_of: Callable[[str | None, Request, ParsedRequest], str | None]

    @property
    def model_name(self) -> str:
        return self.config.model_name


@dataclass
class Call:
    """What an adapter's `translate` makes of its body: the chat request, and what it needs to answer."""

    body: dict  # an OpenAI chat-completions body (or a completions body, kind "completion")
    kind: str = "chat"
    extra: dict = field(default_factory=dict)  # for the chat template (enable_thinking)
    stream: bool = False
    wire: dict = field(default_factory=dict)  # the adapter's own (its format's fields, ids, names)
    parsed: ParsedRequest | None = None
    thinks: bool = False  # the prompt left <think> open: the answer starts in the thinking
    after: Callable[[ParsedRequest], None] | None = None  # the adapter's last word once the prompt is tokenized


@dataclass
class Started:
    call: Call
    run: Generation
    release: Any  # admission.Ticket
    arrived: float  # time.perf_counter() when the request arrived

    @property
    def parsed(self) -> ParsedRequest:
        return self.call.parsed


async def start(served: Served, request: Request, key: str | None, translate: Callable[[dict], Call]) -> Started:
    """Read, translate, check, admit and submit one request (the first half of app._generate)."""
    arrived = time.perf_counter()
    if not served.engine.is_serving:
        raise APIError(503, "the server is shutting down" if served.engine.is_alive else "the engine has stopped",
                       type="server_error", code="engine_stopped", headers={"Connection": "close"})  # fmt: skip
    raw = await read_body(request, served.config.max_body_bytes, served.config.body_timeout_s)
    release = served.admission.enter()
    try:
        call = await asyncio.get_running_loop().run_in_executor(served.workers, _prepare, served, translate, raw)
        release.charge(Cost.of(call.parsed))
        run = Generation.submit(served.engine, call.parsed, served.salt_of(key, request, call.parsed))
    except EngineDead as e:
        release()
        raise APIError(503, str(e), type="server_error", code="engine_stopped") from None
    except BaseException:
        release()
        raise
    return Started(call, run, release, arrived)


def _prepare(served: Served, translate: Callable[[dict], Call], raw: bytes) -> Call:
    """In a worker thread: JSON, the adapter's translation, every check the chat route makes."""
    call = translate(parse_json(raw))
    tokenizer = served.llm.tokenizer
    if call.kind == "chat" and (tokenizer is None or tokenizer.chat_template is None):
        raise APIError(400, f"model {served.model_name} has no chat template: it cannot chat", param="messages")
    call.parsed = served.check(call.kind, call.body, call.extra)
    call.thinks = call.parsed.thinks
    if call.after is not None:
        call.after(call.parsed)
    return call


async def final(started: Started, request: Request) -> RequestOutput:
    """The answer, once finished (a client gone: aborted, 499); the access line written."""
    try:
        outputs = await started.run.final_or_disconnect(request)
    finally:
        started.release()
    log_request(request, 200, started.arrived, outputs[0])
    return outputs[0]


def check_model(body: dict, served_name: str) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required", param="model")
    if model != served_name:
        raise APIError(404, f"model {model!r:.80} not found: this server serves '{served_name}'", param="model",
                       code="model_not_found")  # fmt: skip
    return model


# ---- the answer: thinking, text, tool calls ----------------------------------------------------------------


@dataclass
class Piece:
    kind: str  # "thinking", "text" or "tool_call"
    text: str = ""
    call: dict | None = None  # {"id", "type": "function", "function": {"name", "arguments": JSON text}}


class Answer:
    """One choice's text, streamed in, cut into pieces: thinking (with a reasoning parser), text, tool calls
    (when the request has tools, each once its markup closes)."""

    def __init__(self, served: Served, call: Call):
        self.think = ThinkSplitter(inside=call.thinks) if call.parsed.reasoning else None
        tools = call.parsed.tools
        self.tools = ToolStream({f["name"] for f in tools.functions}) if tools is not None else None
        self.unfinished_thinking = False

    def push(self, text: str) -> list[Piece]:
        thinking, answer = self.think.push(text) if self.think is not None else ("", text)
        return self._pieces(thinking, answer)

    def finish(self) -> list[Piece]:
        pieces = []
        if self.think is not None:
            self.unfinished_thinking = self.think.unfinished
            pieces = self._pieces(*self.think.flush())
            self.unfinished_thinking = self.unfinished_thinking or self.think.unfinished
        if self.tools is not None:
            rest, calls = self.tools.flush()
            pieces += [Piece("text", rest)] if rest else []
            pieces += [Piece("tool_call", call=_plain(c)) for c in calls]
        return pieces

    def _pieces(self, thinking: str, answer: str) -> list[Piece]:
        pieces = [Piece("thinking", thinking)] if thinking else []
        if self.tools is not None:
            answer, calls = self.tools.push(answer)
            pieces += [Piece("text", answer)] if answer else []
            return pieces + [Piece("tool_call", call=_plain(c)) for c in calls]
        return pieces + ([Piece("text", answer)] if answer else [])


def _plain(call: dict) -> dict:
    return {k: v for k, v in call.items() if k != "index"}


@dataclass
class Whole:
    """A finished answer, gathered: thinking (None without any), text, tool calls."""

    thinking: str | None
    text: str
    calls: list[dict]
    unfinished_thinking: bool


def whole(served: Served, call: Call, text: str) -> Whole:
    answer = Answer(served, call)
    pieces = answer.push(text) + answer.finish()
    thinking = [p.text for p in pieces if p.kind == "thinking"]
    content = "".join(p.text for p in pieces if p.kind == "text")
    calls = [p.call for p in pieces if p.kind == "tool_call"]
    has_thinking = bool(thinking) or call.thinks or answer.unfinished_thinking or \
        (answer.think is not None and answer.think.done)  # fmt: skip
    return Whole("".join(thinking) if has_thinking else None, content.strip() if calls else content, calls,
                 answer.unfinished_thinking)  # fmt: skip


# ---- streams -----------------------------------------------------------------------------------------------


class Encoder(Protocol):
    """An adapter's stream writer: wire frames (strings) for the start, each engine item, an error."""

    def start(self) -> list[str]: ...

    def item(self, out) -> list[str]: ...  # a StepOutput; the last one has `finished` set

    def error(self, error: APIError) -> list[str]: ...


async def frames(started: Started, encoder: Encoder, request: Request) -> AsyncIterator[str]:
    """The stream of one request (one prompt, one choice): a client gone cancels this generator, and the
    request is aborted; the access line is written once, as for the OpenAI streams."""
    queue = started.run.queues[0]
    finished = failed = False
    num_tokens = 0
    try:
        for frame in encoder.start():
            yield frame
        while True:
            item = await queue.get()
            error = item_error(item)
            if error is not None:
                failed = True
                log_request(request, error.status, started.arrived, None, True,
                            f"ended with an error event ({error.code}) after {num_tokens} tokens")  # fmt: skip
                for frame in encoder.error(error):
                    yield frame
                break
            num_tokens += len(item.new_token_ids)
            for frame in encoder.item(item):
                yield frame
            if item.finished:
                finished = True
                log_request(request, 200, started.arrived, item.output, True)
                break
    finally:
        started.release()
        if not finished:
            started.run.abort()
        if not (finished or failed):
            log_request(request, 499, started.arrived, None, True,
                        f"the client disconnected after {num_tokens} tokens")  # fmt: skip


def prompt_tokens(output: RequestOutput) -> int:
    return len(output.prompt_token_ids)


def cached_tokens(output: RequestOutput) -> int:
    m = output.metrics
    return m.cached_prompt_tokens if output.cached_prompt_tokens is None else output.cached_prompt_tokens


def stop_string(served: Served, parsed: ParsedRequest, choice) -> str | None:
    """The stop string that ended a choice (None: end-of-sequence, or its length): the one its tokens' whole
    text holds where the shown text stops."""
    if choice.finish_reason != "stop" or not parsed.params.stop or served.llm.tokenizer is None:
        return None
    rest = served.llm.tokenizer.decode(choice.token_ids)[len(choice.text) :]
    return next((s for s in parsed.params.stop if rest.startswith(s)), None)


def sse(event: str, payload: dict) -> str:
    """One server-sent event with its name (Anthropic's and the Responses API's streams name each event)."""
    import json

    return f"event: {event}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"
