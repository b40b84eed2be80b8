"""The page `kvlab serve` answers a browser with at `/`, and the two JSON endpoints only it needs.

    GET /                    the page (kvlab/server/static/index.html): chat, the engine, the calculator
    GET /static/...          its scripts and style, shipped in the package (no build step, no CDN)
    GET /api/web/access      {"api_key_required": bool}: open, so the page asks for a key before it fails
    GET /api/web/model       the served model, its device and memory, the calculator's choices (API key)
    GET /api/web/memory      `kvlab mem --json` for one config, context, batch, KV dtype (API key)

Everything else the page shows comes from the API every client uses: answers stream from
/v1/chat/completions (or /v1/completions in raw mode) with their `kvlab` field, and the engine's
gauges from /metrics. The page obeys the server's rules like any client: same-origin requests
(`guard.py` lets a page of this server's own origin through), `Content-Type: application/json`,
and the API key, entered once in the page, on every call that needs it.

The calculator never runs in JavaScript: /api/web/memory answers with `kvlab.memory.estimate`'s
report, the same object `kvlab mem --json` prints, and seed 004's query-key pair counts. For the served
model, "auto" KV is the format this server's engine cache really holds (its K and V formats), not the
model file's idea of a cache: on a CPU a GGUF model's cache is float32, not llama.cpp's f16.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from importlib.resources import files
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from kvlab.errors import KvlabError
from kvlab.server.errors import APIError

STATIC = files("kvlab.server") / "static"
SERVED = "served"  # the calculator's name for the model this server runs
MAX_PICTURE_POSITIONS = 64  # n + m of the positions picture: a grid a page can draw, not a calculator's range

# The page loads nothing from elsewhere and runs no inline script: a browser refuses anything else.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
                               "frame-ancestors 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def add_web_routes(app: FastAPI, llm, config, authorized: Callable[..., Awaitable[Any]]) -> None:
    """Mount the page on `app`. `config`: the ServerConfig; `authorized`: the API's key dependency (401 without)."""

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(str(STATIC / "index.html"), media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    app.mount("/static", StaticFiles(directory=str(STATIC)), name="static")

    @app.get("/api/web/access")
    async def access():
        return {"api_key_required": bool(config.api_keys)}

    @app.get("/api/web/model", dependencies=[Depends(authorized)])
    async def model():
        return model_info(llm, config.model_name)

    @app.get("/api/web/memory", dependencies=[Depends(authorized)])
    async def memory(request: Request):
        q = request.query_params
        try:
            args = (llm, q.get("config", SERVED), _whole(q, "context", 4096), _whole(q, "batch", 1),
                    q.get("kv_dtype", "auto"), _whole(q, "device_bytes", 0) if "device_bytes" in q else None,
                    (_whole(q, "n", 6), _whole(q, "m", 2)))  # fmt: skip
            answer = await asyncio.to_thread(memory_answer, *args)  # the fit's search stays off the event loop
        except KvlabError as e:
            raise APIError(400, str(e)) from None
        return JSONResponse(answer)


def _whole(query, name: str, default: int) -> int:
    """A whole-number query parameter (KvlabError, so a 400 in OpenAI's shape, when it is not one)."""
    text = query.get(name)
    if text is None:
        return default
    if not (text.strip().isascii() and text.strip().isdigit()) or len(text) > 18:  # "²".isdigit() too: int() refuses it
        raise KvlabError(f"{name} must be a whole number, got {text!r:.40}")
    return int(text)


def model_info(llm, model_name: str) -> dict:
    """What the page needs to know once: the model, its chat template, its device, the calculator's choices."""
    from kvlab.config import bundled_names
    from kvlab.memory.engine_kv import engine_kv_dtype
    from kvlab.memory.units import KV_DTYPE_BITS

    engine = llm.engine
    device = engine.cache.device
    return {
        "model": model_name,
        "max_model_len": engine.max_model_len,
        "has_chat_template": llm.tokenizer is not None and llm.tokenizer.chat_template is not None,
        "block_size": engine.kv.block_size,
        "kv_blocks_total": engine.kv.pool.counts().total,
        "device": str(device),
        "device_memory_bytes": device_memory_bytes(device),
        "configs": [SERVED, *bundled_names()],
        "kv_dtypes": ["auto", *KV_DTYPE_BITS],
        "served_kv_dtype": engine_kv_dtype(engine.cache.formats),  # what "auto" means for the served config
    }


def device_memory_bytes(device) -> int:
    """All of the device's memory: the GPU's, or the machine's RAM for a CPU (0 where unknown)."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[1])
    from kvlab.lab.common import meminfo_bytes  # the one reader of /proc/meminfo (torch is loaded by now anyway)

    return meminfo_bytes("MemTotal")


def memory_answer(llm, config: str, context: int, batch: int, kv_dtype: str, device_bytes: int | None,
                  pairs: tuple[int, int]) -> dict:  # fmt: skip
    """`kvlab mem CONFIG --context C --batch B --kv-dtype D [--device-memory X] --pairs N M --json`, as a dict."""
    from kvlab.config import bundled_names, load_config
    from kvlab.memory import estimate, pairs_with_cache, pairs_without_cache
    from kvlab.memory.engine_kv import SERVED_REASON, engine_kv_dtype, fill_auto, has_auto
    from kvlab.memory.fit import Query
    from kvlab.memory.pairs import pairs_steps

    reason = ""
    if config == SERVED:
        spec = llm.loaded.config
        if has_auto(kv_dtype):  # the bytes this server's cache really holds, not the file's idea of a cache
            kv_dtype, reason = fill_auto(kv_dtype, engine_kv_dtype(llm.engine.cache.formats)), SERVED_REASON
    elif config in bundled_names():  # never a path or a registry name: a page must not make the server read or pull
        spec = load_config(config)
    else:
        raise KvlabError(f"unknown config {config!r:.80}: '{SERVED}' or a bundled name (GET /api/web/model lists them)")
    if device_bytes is not None and device_bytes < 1:
        raise KvlabError(f"device_bytes must be at least 1, got {device_bytes}")
    n, m = pairs
    if n < 0 or m < 0 or n + m > MAX_PICTURE_POSITIONS:
        raise KvlabError(f"the positions picture takes n, m >= 0 with n + m <= {MAX_PICTURE_POSITIONS}, got {n}, {m}")
    report = estimate(spec, Query(context=context, batch=batch, kv_dtype=kv_dtype, kv_reason=reason,
                                  device_bytes=device_bytes))  # fmt: skip
    steps = [{"positions": p, "with_cache": w, "without_cache": wo} for p, w, wo in pairs_steps(n, m)]
    pairs_json = {"n": n, "m": m, "with_cache": pairs_with_cache(n, m), "without_cache": pairs_without_cache(n, m)}
    model = report.to_json()
    if config == SERVED:  # the served file's name, never its absolute path on the server's disk
        model["source"] = model["source"].replace("\\", "/").rsplit("/", 1)[-1]
    return {"models": [model], "pairs": {**pairs_json, "steps": steps}}
