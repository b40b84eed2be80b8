"""The hostile-input fuzz (issue 9's, test_server_fuzz.py) over the other wire formats (issue 27, item 5): a few
hundred seeded mutations of valid Ollama, Anthropic and Responses bodies. Whatever comes in, each route answers
200 or a 4xx in its own API's error shape, never a 5xx, and the engine keeps serving with every KV block back.
"""

from __future__ import annotations

import json
import random

import httpx

from loopback import llm, serving  # noqa: F401  (llm: the module's fixture)

NUM_REQUESTS = 240
TRICKY = [None, True, False, 0, 1, -1, 2, 0.5, 1e-300, 2**31, 2**64, 1e308, "", "x", "json", "auto", "none", "\x00",
          "😀", "a" * 300, "<|im_end|><|im_start|>system", "<think>", [], [1, 2], [None], ["x"], {}, {"type": "text"},
          {"type": "enabled"}, {"a": {"b": [1]}}, [{"role": "user"}], [{"type": "tool_result"}]]  # fmt: skip

VALID = {
    "/api/chat": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False,
                  "options": {"num_predict": 3}},
    "/api/generate": {"model": "tiny", "prompt": "The capital", "stream": False, "options": {"num_predict": 3}},
    "/v1/messages": {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 3},
}  # fmt: skip
FIELDS = {
    "/api/chat": ["messages", "options", "format", "tools", "think", "stream", "keep_alive", "model", "logprobs"],
    "/api/generate": ["prompt", "system", "raw", "options", "format", "think", "suffix", "context", "stream", "images"],
    "/v1/messages": ["messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "tools",
                     "tool_choice", "thinking", "metadata", "stream", "output_config"],
    "/v1/messages/count_tokens": ["messages", "system", "tools", "model"],
    "/v1/responses": ["input", "instructions", "max_output_tokens", "temperature", "text", "tools", "tool_choice",
                      "previous_response_id", "store", "reasoning", "stream", "include"],
}  # fmt: skip
OPTIONS = ["num_predict", "temperature", "top_k", "top_p", "seed", "stop", "num_ctx", "mirostat", "repeat_penalty"]


def random_body(rng: random.Random, path: str):
    if rng.random() < 0.08:
        return rng.choice([b"", b"{", b"null", b"[]", b'{"model": "tiny",}', bytes(range(256)),
                           b'{"a": ' * 100 + b"1" + b"}" * 100, b'{"model": "tiny", "max_tokens": NaN}'])  # fmt: skip
    body = json.loads(json.dumps(VALID[path]))
    for field in rng.sample(FIELDS[path], rng.randint(0, 3)):
        if rng.random() < 0.15:
            body.pop(field, None)
        else:
            body[field] = rng.choice(TRICKY)
    if "options" in body and isinstance(body["options"], dict) and rng.random() < 0.5:
        body["options"][rng.choice(OPTIONS)] = rng.choice(TRICKY)
    if rng.random() < 0.05:
        body[rng.choice(["frobnicate", "n", "best_of"])] = 1
    return body


def check(r: httpx.Response, path: str) -> None:
    assert r.status_code < 500, (path, r.text)
    if r.headers.get("content-type", "").startswith(("application/x-ndjson", "text/event-stream")):
        assert r.status_code == 200
        return
    body = r.json()
    if r.status_code == 200:
        return
    if path.startswith("/api/"):
        assert set(body) == {"error"} and isinstance(body["error"], str)
    elif path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}


def test_random_bodies_on_every_new_route_never_get_a_5xx(llm):
    rng = random.Random(27)
    statuses: dict[int, int] = {}
    with serving(llm, max_body_bytes=64 * 1024) as s, httpx.Client(timeout=60) as client:
        for _ in range(NUM_REQUESTS):
            path = rng.choice(list(VALID))
            body = random_body(rng, path)
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = client.post(s.url + path, content=content, headers={"Content-Type": "application/json"})
            check(r, path)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        s.assert_still_serving()
    assert statuses.get(200, 0) > NUM_REQUESTS // 5 and sum(n for k, n in statuses.items() if k >= 400) > NUM_REQUESTS // 5
