"""The OpenAI-compatible HTTP API (FastAPI), in front of one AsyncEngine.

    POST /v1/completions, /v1/chat/completions   streaming (server-sent events, `data: [DONE]`) or not
    GET  /v1/models, /health, /metrics

Every response of a generation carries an extra `kvlab` field: the request's timing split (queue,
prefill compute and the steps it shared, decode, tokens from the prefix cache). A client that goes
away mid-request has its request aborted and its KV blocks freed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvlab.errors import KvlabError
from kvlab.output.result import RequestOutput
from kvlab.server import protocol
from kvlab.server.async_engine import AsyncEngine, EngineDead
from kvlab.server.metrics import CONTENT_TYPE, render
from kvlab.server.protocol import APIError, ParsedRequest

DEFAULT_MAX_BODY_BYTES = 4 * 2**20


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


def create_app(llm, engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """`llm` tokenizes (kvlab.llm.LLM; its engine is driven only by `engine`'s thread from now on)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.is_alive:
            engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)  # abort whatever is still running

    app = FastAPI(title="kvlab", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return JSONResponse(APIError(e.status_code, str(e.detail), code=code).body(), status_code=e.status_code)

    async def authorized(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    @app.get("/health")
    async def health():
        if not engine.is_alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render(llm.engine, config.model_name), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [protocol.model_card(config.model_name, llm.engine.max_model_len)]}

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(request: Request):
        body = await _read_json(request, config)
        parsed = _parse(lambda: protocol.parse_completion(body, llm.encode))
        return await _serve(parsed, request)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(request: Request):
        body = await _read_json(request, config)
        if llm.tokenizer is None or llm.tokenizer.chat_template is None:
            raise APIError(400, f"model {config.model_name} has no chat template: use /v1/completions", param="messages")
        parsed = _parse(lambda: protocol.parse_chat(body, llm.encode_chat, llm.engine.max_model_len))
        return await _serve(parsed, request)

    async def _serve(parsed: ParsedRequest, request: Request):
        try:
            llm.engine.check_prompt(parsed.prompt_token_ids, parsed.params.max_tokens)
        except KvlabError as e:
            code = "context_length_exceeded" if "context" in str(e) else None
            raise APIError(400, str(e), param="messages" if parsed.kind == "chat" else "prompt", code=code) from None
        output = RequestOutput(prompt=parsed.prompt_text, prompt_token_ids=parsed.prompt_token_ids)
        try:
            queue = engine.submit(parsed.request_id, parsed.prompt_token_ids, parsed.params, output)
        except EngineDead:
            raise APIError(503, "the engine has stopped", type="server_error") from None
        if parsed.stream:
            events = _events(parsed, queue, output)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        final = await _final_or_disconnect(parsed.request_id, queue, request)
        return JSONResponse(protocol.response(parsed, config.model_name, final))

    async def _final_or_disconnect(request_id: str, queue: asyncio.Queue, request: Request) -> RequestOutput:
        result = asyncio.ensure_future(_until_finished(queue))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not result.done():  # the client went away, or the server is stopping
                engine.abort(request_id)
            gone.cancel()
        if not result.done():
            result.cancel()
            raise APIError(499, "client closed the request")
        return result.result()

    async def _events(parsed: ParsedRequest, queue: asyncio.Queue, output: RequestOutput):
        """Server-sent events; if the client disconnects Starlette cancels this generator: abort."""
        finished = False
        model = config.model_name
        try:
            if parsed.kind == "chat":
                yield _sse(protocol.chunk(parsed, model, None, first=True))
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    yield _sse(APIError(500, f"engine error: {item}", type="server_error").body())
                    break
                if item.new_text:
                    yield _sse(protocol.chunk(parsed, model, item.new_text))
                if item.finished:
                    finished = True
                    last = protocol.chunk(parsed, model, None, finish_reason=output.finish_reason)
                    last["kvlab"] = output.metrics.timing_split()
                    yield _sse(last)
                    if parsed.include_usage:
                        yield _sse(protocol.usage_chunk(parsed, model, output))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                engine.abort(parsed.request_id)

    return app


async def _until_finished(queue: asyncio.Queue) -> RequestOutput:
    while True:
        item = await queue.get()
        if isinstance(item, BaseException):
            raise APIError(500, f"engine error: {item}", type="server_error")
        if item.finished:
            return item.output


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _read_json(request: Request, config: ServerConfig) -> dict:
    limit = config.max_body_bytes
    declared = request.headers.get("content-length")
    too_large = APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required: see GET /v1/models", param="model")
    served = config.model_name
    if model != served:
        raise APIError(404, f"the model '{model}' does not exist: this server serves '{served}'", param="model",
                       code="model_not_found")  # fmt: skip
    return body


def _parse(fn) -> ParsedRequest:
    try:
        return fn()
    except KvlabError as e:  # tokenizer or template problems with the user's input
        raise APIError(400, str(e)) from None


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
