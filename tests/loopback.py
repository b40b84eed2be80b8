"""A kvlab server on loopback for tests: uvicorn in a thread, on a socket bound before it starts.

    with serving(llm, api_keys=("k",)) as server:
        server.post("/v1/completions", {...})
        server.assert_still_serving()       # a normal request succeeds, then every block is back

The `LLM`'s engine belongs to the server's engine thread while it runs; one LLM can serve several
servers one after another. Test modules import the `llm` fixture from here (one per module).
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest


@dataclass
class Served:
    url: str
    llm: object  # kvlab.LLM
    engine: object  # kvlab.server.async_engine.AsyncEngine
    key: str | None = None

    def headers(self, key: str | None = "default", extra: dict | None = None) -> dict:
        key = self.key if key == "default" else key
        return {**({"Authorization": f"Bearer {key}"} if key else {}), **(extra or {})}

    def post(self, path: str, body, key: str | None = "default", timeout: float = 30,
             headers: dict | None = None) -> httpx.Response:  # fmt: skip
        """POST a body: JSON of `body`, or bytes as they are; Content-Type application/json unless `headers` say."""
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = self.headers(key, {"Content-Type": "application/json", **(headers or {})})
        return httpx.post(self.url + path, content=content, headers=headers, timeout=timeout)

    def get(self, path: str, key: str | None = "default", headers: dict | None = None) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers(key, headers), timeout=30)

    def complete(self, prompt: str = "The capital", max_tokens: int = 3, **fields) -> dict:
        """A normal completion that must succeed."""
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}
        r = self.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        return r.json()

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until the engine holds no request and no block, then check the pool and the KV ledger."""
        engine = self.llm.engine
        end = time.time() + timeout
        while engine.has_unfinished_requests or engine.kv.pool.num_used_blocks:
            if time.time() > end:
                raise AssertionError("the engine still holds requests or blocks")
            time.sleep(0.01)
        counts = engine.kv.pool.check_integrity()
        ledger = engine.ledger()
        assert counts.used == 0 and ledger.held_blocks == 0 and ledger.is_balanced

    def assert_still_serving(self) -> None:
        """After a bad request: the server answers a normal one and every KV block is back in the pool."""
        self.wait_idle()
        assert self.get("/health", key=None).json() == {"status": "ok"}
        assert self.complete()["usage"]["completion_tokens"] >= 1
        self.wait_idle()


@pytest.fixture(scope="module")
def llm(tiny_chat_model, one_thread):
    """The tiny chat model with a 256-token context, for one test module's servers."""
    from kvlab import LLM

    return LLM(tiny_chat_model, max_model_len=256)


@contextmanager
def serving(llm, **config):
    import uvicorn

    from kvlab.server.app import ServerConfig, create_app
    from kvlab.server.async_engine import AsyncEngine
    from kvlab.server.cli import listen

    engine = AsyncEngine(llm.engine)
    app = create_app(llm, engine, ServerConfig(**{"model_name": "tiny", **config}))
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(400):
        if uv.started:
            break
        time.sleep(0.02)
    keys = config.get("api_keys") or (None,)
    try:
        yield Served(f"http://127.0.0.1:{port}", llm, engine, keys[0])
    finally:
        uv.should_exit = True
        thread.join(15)
        sock.close()
    assert engine.stopped.is_set()  # the lifespan's shutdown stopped the engine thread
