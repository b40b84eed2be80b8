"""The server survives every request (issue 9): each case over loopback, then a normal request and the KV ledger.

Every case is followed by `assert_still_serving()`: /health is ok, a normal completion succeeds, and
every KV block is back in the pool (integrity and ledger checked).
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from loopback import llm, serving  # noqa: F401  (llm: the module's fixture)

KEY = "k1"


@pytest.fixture(scope="module")
def server(llm):
    with serving(llm, api_keys=(KEY,), max_body_bytes=256 * 1024) as s:
        yield s


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "The capital", "max_tokens": 3, **fields}


def chat(content="hello", **fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 3, **fields}


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


# ---- 1. no request stops the engine ------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**32}, "seed"),
        ({"top_p": 0}, "top_p"),
        ({"repetition_penalty": 1e-300, "temperature": 1}, "repetition_penalty"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": True}, "max_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
    ],
)
def test_sampling_values_outside_openais_ranges_are_400s(server, fields, param):
    assert_error(server.post("/v1/completions", completion(**fields)), 400, param=param)
    server.assert_still_serving()


def test_a_number_too_big_for_a_float_is_a_400_not_an_infinity(server):
    raw = b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": 1e400}'  # parsed as inf
    assert_error(server.post("/v1/completions", raw), 400, param="temperature")
    server.assert_still_serving()


@pytest.mark.parametrize(
    "fields",
    [
        {"seed": 2**32 - 1, "temperature": 1},
        {"seed": 0, "temperature": 1},
        {"temperature": 1e-40},  # sampled at the 0.01 floor, not divided into infinities
        {"top_p": 1e-300, "temperature": 1},  # floored at 1e-6: the most likely token stays
        {"repetition_penalty": 0.01, "temperature": 0.01, "seed": 3},
        {"top_k": 10**12, "temperature": 1, "seed": 1},
    ],
)
def test_extreme_but_valid_sampling_values_are_served(server, fields):
    out = server.complete(**fields)
    assert out["usage"]["completion_tokens"] == 3 or out["choices"][0]["finish_reason"] == "stop"
    server.assert_still_serving()


def test_a_failing_step_is_a_500_for_its_requests_only_and_the_engine_goes_on(server, monkeypatch):
    runner = server.llm.engine.runner
    forward, calls = runner.forward, []

    def fails_once(inputs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("simulated kernel fault")
        return forward(inputs)

    monkeypatch.setattr(runner, "forward", fails_once)
    error = assert_error(server.post("/v1/completions", completion()), 500, code="step_failed")
    assert error["type"] == "server_error" and "simulated kernel fault" in error["message"]
    calls.clear()
    with httpx.stream("POST", server.url + "/v1/completions", json=completion(stream=True),
                      headers=server.headers(), timeout=30) as r:  # fmt: skip
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "step_failed"
    assert server.get("/health", key=None).json() == {"status": "ok"}
    server.assert_still_serving()


def test_a_request_whose_final_output_is_lost_in_a_failed_step_still_gets_its_500(server, monkeypatch):
    """The step fails after the request was finalized: the engine no longer knows it, nor returned its output."""
    stats = server.llm.engine.stats
    record = stats.record_finished

    def fails_once(reason, metrics):
        monkeypatch.setattr(stats, "record_finished", record)
        raise RuntimeError("simulated bookkeeping fault")

    monkeypatch.setattr(stats, "record_finished", fails_once)
    assert_error(server.post("/v1/completions", completion(max_tokens=1)), 500, code="step_failed")
    server.assert_still_serving()


# ---- 2. local-server hygiene --------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/json; charset=latin-1"])  # fmt: skip
def test_posts_need_a_json_content_type(server, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    r = httpx.post(server.url + "/v1/completions", content=json.dumps(completion()).encode(),
                   headers=server.headers(extra=headers), timeout=30)  # fmt: skip
    if content_type is None:  # httpx sends none for raw bytes
        assert "content-type" not in r.request.headers
    assert_error(r, 415, "unsupported_media_type")
    assert server.post("/v1/completions", completion(), headers={"Content-Type": "application/json; charset=utf-8"}).status_code == 200
    server.assert_still_serving()


def test_a_web_page_can_neither_post_nor_read(server):
    evil = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
    r = server.post("/v1/completions", completion(), headers=evil)
    assert_error(r, 403, "origin_not_allowed")
    assert not any(h.startswith("access-control-") for h in r.headers)
    preflight = httpx.options(server.url + "/v1/completions", timeout=30, headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})  # fmt: skip
    assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers
    server.assert_still_serving()


@pytest.mark.parametrize("host, ok", [("evil.example", False), ("evil.example:8000", False), ("localhost:1234", True),
                                      ("127.0.0.1", True), ("[::1]:80", True), ("bad:port:x", False)])  # fmt: skip
def test_the_host_header_must_name_this_server(server, host, ok):
    r = server.get("/health", key=None, headers={"Host": host})
    if ok:
        assert r.status_code == 200
    else:
        assert_error(r, 400, "invalid_host")
    server.assert_still_serving()


def test_allowed_hosts_and_origins_open_the_door_with_cors_headers(llm):
    origin = "http://app.example"
    with serving(llm, allowed_hosts=("kvlab.internal",), allowed_origins=(origin,)) as s:
        assert s.get("/health", headers={"Host": "kvlab.internal:8000"}).status_code == 200
        assert_error(s.get("/health", headers={"Host": "other.internal"}), 400, "invalid_host")
        preflight = httpx.options(s.url + "/v1/completions", timeout=30, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, authorization"})  # fmt: skip
        assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == origin
        assert "authorization" in preflight.headers["access-control-allow-headers"]
        r = s.post("/v1/completions", completion(), headers={"Origin": origin})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert_error(s.post("/v1/completions", completion(), headers={"Origin": "http://evil.example"}), 403)
        s.assert_still_serving()


def test_metrics_need_the_key_unless_made_public(llm, server):
    assert_error(server.get("/metrics", key=None), 401, "invalid_api_key")
    assert server.get("/metrics").status_code == 200
    with serving(llm, api_keys=(KEY,), public_metrics=True) as s:
        assert "kvlab_kv_blocks_total" in s.get("/metrics", key=None).text
        assert_error(s.get("/v1/models", key=None), 401)  # /v1 still needs the key
        s.assert_still_serving()


# ---- 3. every error in OpenAI's shape ----------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, code, param",
    [
        (b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}', "invalid_unicode", "prompt"),
        (b'{"model": "tiny", "prompt": "ok", "stop": ["\\udfff"], "max_tokens": 2}', "invalid_unicode", "stop"),
        (b'{"model": "tiny", "prompt": "ok", "\\ud800": 1}', "invalid_unicode", None),
        (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "invalid_json", None),
        (b'{"model": "tiny", "prompt": "x", "temperature": Infinity}', "invalid_json", None),
        (b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "invalid_json", None),
        (b'{"model": "tiny", "prompt": "x", "metadata": ' + b"[" * 70 + b"]" * 70 + b"}", "invalid_json", None),
        (b"\xff\xfe not utf-8", "invalid_json", None),
        (b"[1, 2]", "invalid_json", None),
    ],
)
def test_invalid_unicode_and_pathological_json_are_400s(server, raw, code, param):
    error = assert_error(server.post("/v1/completions", raw), 400, code)
    if param:
        assert error["param"] == param
    server.assert_still_serving()


def test_a_lone_surrogate_in_chat_content_is_a_400(server):
    raw = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi \\ud83d"}]}'
    assert_error(server.post("/v1/chat/completions", raw), 400, "invalid_unicode", "messages")
    server.assert_still_serving()


def test_unknown_paths_and_methods_keep_the_shape(server):
    assert_error(server.get("/v1/nothing"), 404)
    assert_error(server.get("/v1/completions"), 405)
    server.assert_still_serving()


# ---- 6. tokenization off the event loop, within limits ---------------------------------------------


def test_health_answers_while_a_big_request_is_being_tokenized(llm, monkeypatch):
    """A 4 MB prompt: /health is answered while the request is still inside the tokenizer."""
    inside, release = threading.Event(), threading.Event()
    prefix_beyond = llm.tokenizer.prefix_beyond  # a prompt this long is refused after tokenizing a prefix

    def slow_prefix_beyond(text, num_tokens):
        inside.set()
        release.wait(30)
        return prefix_beyond(text, num_tokens)

    monkeypatch.setattr(llm.tokenizer, "prefix_beyond", slow_prefix_beyond)
    prompt = "word " * (4 * 2**20 // 5)
    with serving(llm, max_body_bytes=8 * 2**20, max_prompt_chars=2**23) as s:
        result = {}
        big = threading.Thread(target=lambda: result.update(r=s.post("/v1/completions", completion(prompt=prompt))))
        big.start()
        assert inside.wait(30)
        health = s.get("/health")  # the event loop is free: the tokenizer runs in a worker thread
        assert health.json() == {"status": "ok"} and big.is_alive()
        release.set()
        big.join(60)
        assert_error(result["r"], 400, "context_length_exceeded")  # 4 MB of words do not fit 256 tokens
        monkeypatch.setattr(llm.tokenizer, "prefix_beyond", prefix_beyond)
        s.assert_still_serving()


def test_prompts_beyond_the_limits_are_refused_before_tokenizing(llm, monkeypatch):
    monkeypatch.setattr(llm, "encode", lambda prompt: pytest.fail("tokenized a prompt over the limit"))
    with serving(llm, max_body_bytes=8 * 2**20, max_messages=8) as s:
        bound = 256 * max(map(len, llm.tokenizer.backend.get_vocab(with_added_tokens=True)))
        r = s.post("/v1/completions", completion(prompt="x" * (bound + 1)))
        assert_error(r, 400, "context_length_exceeded", "prompt")
        r = s.post("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}] * 9})
        assert "at most 8" in assert_error(r, 400, param="messages")["message"]
        r = s.post("/v1/chat/completions", chat(content="y" * (bound + 1)))
        assert_error(r, 400, "context_length_exceeded", "messages")
        monkeypatch.undo()
        s.assert_still_serving()


def test_too_many_requests_in_flight_get_429(llm, monkeypatch):
    inside, release = threading.Event(), threading.Event()
    encode = llm.encode
    monkeypatch.setattr(llm, "encode", lambda p: (inside.set(), release.wait(30), encode(p))[2])
    with serving(llm, max_concurrent_requests=1) as s:
        first = threading.Thread(target=lambda: s.post("/v1/completions", completion()))
        first.start()
        assert inside.wait(30)
        r = s.post("/v1/completions", completion())
        assert_error(r, 429, "server_overloaded")
        assert r.headers["retry-after"] == "1"
        release.set()
        first.join(30)
        monkeypatch.undo()
        s.assert_still_serving()
