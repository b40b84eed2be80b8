"""The OpenAI-compatible HTTP API (FastAPI), in front of one AsyncEngine.

    POST /v1/completions, /v1/chat/completions   streaming (server-sent events, `data: [DONE]`) or not
    GET  /v1/models, /health, /metrics, /api/ps (what the server holds, for `kvlab ps`)

A generation request goes: its headers within a time limit (`wire.py`) → the guard (Host, Origin,
Content-Type: `guard.py`) → the API key → the body, read on the event loop within its size and time
limits (408 and the socket closed beyond) → admission (`admission.py`: at most
`max_concurrent_requests` in flight, 429 beyond) → a worker thread parses the JSON, checks every
field, renders the chat template and tokenizes (`prepare`), so that a 4 MB request never stalls
/health → admission by cost (its sequences and tokens, 429 beyond) → the engine thread, whose
scheduler shares seats and tokens fairly between HTTP requests (`scheduler/fair.py`). Every
response of a generation carries an extra `kvlab` field: the request's timing split and kvlab's
own finish reason. A client that goes away mid-request has its request aborted and its KV blocks
freed.

Prefix-cache isolation: each request reaches the engine with a cache salt made of its tenant (its
API key, its `user` field or a header, per `cache_salt_by`) and its own `cache_salt`; requests
share cached blocks — and learn `cached_prompt_tokens` — only within one salt.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvlab.errors import KvlabError
from kvlab.sampling import SamplingParams
from kvlab.sampling.params import StructuredOutputs
from kvlab.server import responses
from kvlab.server.access_log import log_request
from kvlab.server.admission import Admission, Cost
from kvlab.server.async_engine import Arrivals, AsyncEngine, EngineDead
from kvlab.server.body import parse_json, read_body
from kvlab.server.generation import Generation
from kvlab.server.guard import Guard, GuardConfig
from kvlab.server.logprobs import TokenText
from kvlab.server.metrics import CONTENT_TYPE, render
from kvlab.server.protocol import APIError, Limits, ParsedRequest, parse_chat, parse_completion, refuse_early
from kvlab.server.streaming import EventStream
from kvlab.server.tools import markers_are_tokens
from kvlab.server.ps import ps_payload
from kvlab.server.web import add_web_routes
from kvlab.server.errors import error_body
from kvlab.server.metrics import RouteCounts
from kvlab.server.adapter import Served
from kvlab.server.anthropic_api import add_anthropic_routes
from kvlab.server.ollama_api import add_ollama_routes
from kvlab.server.responses_api import add_responses_routes
from kvlab.server.reasoning import PROMPT_TAIL_TOKENS, opens_thinking, template_kwargs

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_HEADER_TIMEOUT_S, DEFAULT_BODY_TIMEOUT_S, DEFAULT_KEEP_ALIVE_TIMEOUT_S = 10.0, 30.0, 5.0
QUEUED_TOKENS_PER_POOL = 16  # default max_queued_tokens: this many KV pools' worth of tokens
CACHE_SALT_BY = ("none", "api-key", "user", "header")


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_keys: tuple[str, ...] = ()  # any of them opens /v1 (and /metrics unless public_metrics)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    host: str = "127.0.0.1"  # the address bound: a Host header may name it
    allowed_hosts: tuple[str, ...] = ()  # more names for the Host header ("*": any)
    allowed_origins: tuple[str, ...] = ()  # web origins allowed, with CORS headers ("*": any); none: no browser
    public_metrics: bool = False  # /metrics without the API key (a Prometheus scraper on loopback)
    cache_salt_by: str = "api-key"  # the tenant a request's cache salt is made of: see CACHE_SALT_BY
    tenant_header: str = "X-Tenant-Id"  # with cache_salt_by="header"
    max_concurrent_requests: int = 128  # in flight (tokenizing, waiting, running, streaming); 429 beyond
    max_queued_seqs: int = 512  # sequences in flight (prompts × max(n, best_of) per request); 429 beyond
    max_queued_tokens: int | None = None  # prompt + choices × max_tokens in flight; None: 16 × the KV pool's tokens
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # a request's headers must arrive within it (wire.py); 408
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # its body within this after its headers; 408
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S  # an idle kept-alive connection closes after it
    max_messages: int = 1024
    max_prompt_chars: int | None = None  # None: max_model_len × the vocabulary's longest token (cannot fit more)
    reasoning_parser: str | None = None  # --reasoning-parser: <think> text split out of the answer (reasoning.py)
    tokenizer_threads: int = 2

    def __post_init__(self) -> None:
        if self.cache_salt_by not in CACHE_SALT_BY:
            raise KvlabError(f"cache_salt_by must be one of {', '.join(CACHE_SALT_BY)}, got {self.cache_salt_by!r}")


def create_app(llm, engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """`llm` tokenizes (kvlab.llm.LLM; its engine is driven only by `engine`'s thread from now on)."""
    limits = Limits(llm.engine.max_model_len, config.max_prompt_chars or _prompt_chars_bound(llm), config.max_messages)
    workers = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="kvlab-tokenize")
    admission = Admission(config.max_concurrent_requests, config.max_queued_seqs,
                          config.max_queued_tokens or QUEUED_TOKENS_PER_POOL * llm.engine.kv.num_tokens_capacity)
    token_text = TokenText(llm.tokenizer)  # each token's text and bytes, for log-probabilities
    marker_tokens = markers_are_tokens(llm.tokenizer)  # how a forced tool call's grammar names <tool_call>

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.is_alive:
            engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)  # abort whatever is still running
        workers.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="kvlab", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    cors_headers = ("authorization", "content-type", "x-api-key", config.tenant_header.lower())  # x-api-key: Anthropic's
    guard = GuardConfig(config.host, config.allowed_hosts, config.allowed_origins, cors_headers)
    app.add_middleware(Guard, config=guard)
    routes = RouteCounts()  # requests by route and status, for /metrics
    app.add_middleware(RouteCounts.Middleware, counts=routes)
    app.add_middleware(Arrivals, engine=engine)  # requests being read: a burst starts in one step

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        log_request(request, e.status)
        return JSONResponse(error_body(request.url.path, e), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(error_body(request.url.path, APIError(e.status_code, str(e.detail), code=code)),
                            status_code=e.status_code)  # fmt: skip

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):  # a bug: still OpenAI's shape (logged with its traceback)
        error = APIError(500, "internal server error", type="server_error", code="internal_error")
        return JSONResponse(error_body(request.url.path, error), status_code=500)

    async def authorized(request: Request) -> str | None:
        """The API key the request presented (None when the server has none)."""
        if not config.api_keys:
            return None
        given = request.headers.get("authorization", "").encode()
        given_x = request.headers.get("x-api-key", "").encode()  # Anthropic's clients send the key so
        for key in config.api_keys:
            if hmac.compare_digest(given, f"Bearer {key}".encode()) or hmac.compare_digest(given_x, key.encode()):
                return key
        raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    async def metrics_authorized(request: Request) -> None:
        if not config.public_metrics:
            await authorized(request)

    @app.get("/health")
    async def health():
        if not engine.is_alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if not engine.is_serving:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", dependencies=[Depends(metrics_authorized)])
    async def metrics():
        return PlainTextResponse(render(llm.engine, config.model_name, routes), media_type=CONTENT_TYPE)

    started = time.time()

    @app.get("/api/ps", dependencies=[Depends(authorized)])
    async def ps():  # what this server holds, for `kvlab ps` (ollama's path and shape)
        return ps_payload(llm, config.model_name, started)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [responses.model_card(config.model_name, llm.engine.max_model_len)]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorized)])
    async def model(model_id: str):
        if model_id != config.model_name:
            raise APIError(404, f"the model {model_id!r:.80} does not exist: this server serves "
                           f"'{config.model_name}'", param="model", code="model_not_found")  # fmt: skip
        return responses.model_card(config.model_name, llm.engine.max_model_len)

    add_web_routes(app, llm, config, authorized)  # the page at / and its JSON endpoints (web.py)
    served = Served(llm, engine, config, admission, workers, lambda *args: _checked(*args),
                    lambda key, request, parsed: _cache_salt(config, key, request.headers.get(config.tenant_header),
                                                             parsed))  # fmt: skip
    add_ollama_routes(app, served, authorized, started)  # Ollama's /api/chat, /api/generate, ... (ollama_api.py)
    add_anthropic_routes(app, served, authorized)  # Anthropic's /v1/messages (anthropic_api.py)
    add_responses_routes(app, served, authorized)  # OpenAI's /v1/responses (responses_api.py)

    @app.post("/v1/completions")
    async def completions(request: Request, key: str | None = Depends(authorized)):
        return await _generate(request, "completion", key)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, key: str | None = Depends(authorized)):
        if llm.tokenizer is None or llm.tokenizer.chat_template is None:
            message = f"model {config.model_name} has no chat template: use /v1/completions"
            raise APIError(400, message, param="messages")
        return await _generate(request, "chat", key)

    async def _generate(request: Request, kind: str, key: str | None):
        started = time.perf_counter()
        if not engine.is_serving:  # draining (or dead): answer at once, whatever the body
            raise APIError(503, "the server is shutting down" if engine.is_alive else "the engine has stopped",
                           type="server_error", code="engine_stopped", headers={"Connection": "close"})  # fmt: skip
        raw = await read_body(request, config.max_body_bytes, config.body_timeout_s)  # 408 when too slow
        release = admission.enter()  # only requests whose body has arrived hold a slot
        try:
            parsed = await asyncio.get_running_loop().run_in_executor(workers, _prepare, kind, raw)
            release.charge(Cost.of(parsed))  # its sequences and tokens
            salt = _cache_salt(config, key, request.headers.get(config.tenant_header), parsed)
            run = Generation.submit(engine, parsed, salt)  # one engine request per prompt
        except EngineDead as e:
            release()
            raise APIError(503, str(e), type="server_error", code="engine_stopped") from None
        except BaseException:
            release()
            raise
        output = run.outputs[0]
        if parsed.stream:
            stream = EventStream(parsed, config.model_name, run.outputs, token_text)
            def log(status: int, note: str | None) -> None:  # the access line, once the stream has ended
                log_request(request, status, started, output if note is None else None, True, note)

            events = run.events(stream, release, log)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            outputs = await run.final_or_disconnect(request)
        finally:
            release()
        log_request(request, 200, started, output)
        return JSONResponse(responses.response(parsed, config.model_name, outputs, token_text))

    def _encode(text: str) -> list[int]:  # a prompt a prefix proves too long is refused before the rest is tokenized
        refuse_early(llm.tokenizer, text, limits, "prompt")
        return llm.encode(text)

    def _encode_chat(messages: list[dict], tools: list[dict] | None, template: dict | None = None) -> list[int]:
        extra = {"tools": tools} if tools else {}
        refuse_early(llm.tokenizer, llm.tokenizer.apply_chat_template(messages, **extra, **(template or {})), limits,
                     "messages")  # fmt: skip
        if template:  # enable_thinking, for the template
            return llm.tokenizer.encode_chat(messages, add_generation_prompt=True, **extra, **template)
        return llm.encode_chat(messages, tools=tools)

    def _prepare(kind: str, raw: bytes) -> ParsedRequest:
        """In a worker thread: JSON, every field, the chat template, tokenization, the context and
        structured-output checks."""
        body = parse_json(raw)
        _check_model(body, config.model_name)
        extra = template_kwargs(body) if kind == "chat" else {}  # chat_template_kwargs: enable_thinking
        return _checked(kind, {k: v for k, v in body.items() if k != "chat_template_kwargs"}, extra)

    def _checked(kind: str, body: dict, extra: dict | None = None) -> ParsedRequest:
        """A body's every field, the chat template (with `extra`), tokenization, the context and structured-output
        checks (the adapters of the other wire formats come here with the chat body they translated)."""
        param = "messages" if kind == "chat" else "prompt"
        try:
            if kind == "completion":
                parsed = parse_completion(body, _encode, limits)
            else:
                template = llm.tokenizer.chat_template if llm.tokenizer is not None else None
                encode = (lambda m, t: _encode_chat(m, t, extra)) if extra else _encode_chat
                parsed = parse_chat(body, encode, limits, template, config.model_name, marker_tokens)
        except KvlabError as e:  # tokenizer or template problems with the user's input
            raise APIError(400, str(e), param=param) from None
        for prompt in parsed.prompts:
            try:
                llm.engine.check_prompt(prompt.token_ids, parsed.params.max_tokens)
            except KvlabError as e:
                code = "context_length_exceeded" if "context" in str(e) else None
                raise APIError(400, str(e), param=param, code=code) from None
        try:
            llm.engine.check_params(parsed.params)  # logit_bias ids, and the structured output compiles
        except KvlabError as e:
            field = next((f for f in ("logit_bias", "num_speculative_tokens") if f in str(e)), parsed.constraint_param)
            raise APIError(400, str(e), param=field) from None
        for i, schema in enumerate(parsed.tool_schemas):  # under every tool_choice, not only a forced call's
            try:
                llm.engine.check_params(SamplingParams(structured_outputs=StructuredOutputs(json=schema)))
            except KvlabError as e:
                raise APIError(400, f"tools[{i}].function.parameters: {e}", param="tools") from None
        if kind == "chat" and config.reasoning_parser is not None:  # where the answer starts: in the thinking?
            parsed.reasoning = True
            parsed.thinks = opens_thinking(llm.tokenizer.decode(parsed.prompt_token_ids[-PROMPT_TAIL_TOKENS:]))
        return parsed

    return app


def _check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required: see GET /v1/models", param="model")
    if model != served:
        raise APIError(404, f"the model {model!r:.80} does not exist: this server serves '{served}'", param="model",
                       code="model_not_found")  # fmt: skip


def _cache_salt(config: ServerConfig, key: str | None, header: str | None, parsed: ParsedRequest) -> str | None:
    """The engine's cache salt: a digest of the tenant and the request's own cache_salt (None: neither)."""
    tenant = {"none": None, "api-key": key, "user": parsed.user, "header": header}[config.cache_salt_by]
    if tenant is None and parsed.cache_salt is None:
        return None
    return hashlib.sha256(json.dumps([config.cache_salt_by, tenant, parsed.cache_salt]).encode()).hexdigest()


def _prompt_chars_bound(llm) -> int | None:
    """No prompt longer than max_model_len × the longest token (in bytes, ≥ its characters) can fit."""
    if llm.tokenizer is None:
        return None
    longest = max(map(len, llm.tokenizer.backend.get_vocab(with_added_tokens=True)))
    return llm.engine.max_model_len * longest
