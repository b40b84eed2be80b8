"""A bounded fuzz of the server (issue 9): a few hundred random requests from a seeded generator.

Bodies are mutations of a valid request — random values for every documented field, fields
dropped, unknown fields, odd headers — plus raw garbage. Whatever comes in, the server answers in
OpenAI's shape, never a 5xx (the only 5xx the server documents for a request is a failed engine
step, which nothing here causes), keeps serving, and every KV block comes back to the pool.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest

from loopback import llm, serving  # noqa: F401  (llm: the module's fixture)

NUM_REQUESTS = 300
OPENAI_FINISH = {"stop", "length"}

TRICKY = [None, True, False, 0, 1, -1, 2, 3, 0.5, 1e-300, -1e-300, 1e-40, 2.0000001, 2**31, 2**63 - 1, 2**63, 2**64,
          -(2**63) - 1, 10**30, 1e308, "", "x", "none", "auto", "text", "\x00", "😀", "\ud800", "a" * 300,
          "<|im_end|><|im_start|>system", [], [1, 2], [None], ["x"], [[1]], {}, {"type": "text"},
          {"include_usage": True}, {"a": {"b": [1]}}]  # fmt: skip
FIELDS = ["max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "ignore_eos",
          "repetition_penalty", "presence_penalty", "frequency_penalty", "stream", "stream_options", "cache_salt",
          "user", "n", "best_of", "echo", "logprobs", "top_logprobs", "suffix", "logit_bias", "tools", "tool_choice",
          "parallel_tool_calls", "response_format", "functions", "function_call", "modalities", "audio", "prediction",
          "reasoning_effort", "store", "metadata", "service_tier", "model", "prompt", "messages"]  # fmt: skip
PLAUSIBLE = {
    "max_tokens": lambda r: r.randint(1, 6), "max_completion_tokens": lambda r: r.randint(1, 6),
    "temperature": lambda r: r.choice([0, 0.7, 2, 1e-9]), "top_p": lambda r: r.choice([1, 0.9, 1e-9]),
    "top_k": lambda r: r.choice([-1, 0, 1, 40]), "min_p": lambda r: r.choice([0, 0.1, 1]),
    "seed": lambda r: r.randint(0, 2**32 - 1), "stop": lambda r: r.choice(["\n", ["a", "b"], "."]),
    "repetition_penalty": lambda r: r.choice([1, 1.3, 0.5, 2]), "cache_salt": lambda r: r.choice(["a", "b"]),
}  # fmt: skip
MESSAGES = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "t"}]}],
    [{"role": "assistant", "content": None}, {"role": "user", "content": "x"}],
    [{"role": "wizard", "content": "x"}], [{"role": "user"}], [{"role": "user", "content": {"a": 1}}], [], "hello",
]  # fmt: skip


def random_body(rng: random.Random, chat: bool):
    """A request body (a dict), or raw bytes."""
    if rng.random() < 0.08:
        return rng.choice([b"", b"{", b"null", b"[]", b'"x"', b'{"model": "tiny", "prompt": "x",}', bytes(range(256)),
                           b'{"a": ' * 200 + b"1" + b"}" * 200, b'{"model": "tiny", "prompt": NaN}'])  # fmt: skip
    body = {"model": "tiny", "max_tokens": rng.randint(1, 4)}
    body.update({"messages": rng.choice(MESSAGES[:3])} if chat else {"prompt": rng.choice(["x", "The capital", [5, 6]])})
    for field in rng.sample(FIELDS, rng.randint(0, 4)):
        roll = rng.random()
        if roll < 0.1:
            body.pop(field, None)
        elif field in PLAUSIBLE and roll < 0.6:
            body[field] = PLAUSIBLE[field](rng)
        elif field == "messages" and roll < 0.6:
            body[field] = rng.choice(MESSAGES)
        else:
            body[field] = rng.choice(TRICKY)
    if rng.random() < 0.05:
        body[rng.choice(["foo", "web_search_options", "verbosity", "ignore_eos "])] = rng.choice(TRICKY)
    return body


def random_headers(rng: random.Random) -> dict:
    roll = rng.random()
    if roll < 0.9:
        return {"Content-Type": "application/json"}
    return rng.choice([{}, {"Content-Type": "text/plain"}, {"Content-Type": "application/json; charset=utf-16"},
                       {"Content-Type": "application/json", "Origin": "http://evil.example"},
                       {"Content-Type": "application/json", "Host": "evil.example"}])  # fmt: skip


def check_answer(r: httpx.Response, stream: bool) -> None:
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
        return
    if not stream:
        out = r.json()
        assert out["choices"][0]["finish_reason"] in OPENAI_FINISH and out["usage"]["completion_tokens"] >= 1
        return
    lines = [line for line in r.text.splitlines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert not any("error" in e for e in events)
    reasons = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
    assert len(reasons) == 1 and reasons[0] in OPENAI_FINISH


def test_random_requests_never_get_a_5xx_nor_stop_the_server(llm):
    rng = random.Random(9)
    statuses: dict[int, int] = {}
    with serving(llm, max_body_bytes=64 * 1024) as s, httpx.Client(timeout=60) as client:  # kept-alive connections
        for i in range(NUM_REQUESTS):
            chat = rng.random() < 0.5
            body = random_body(rng, chat)
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            path = rng.choice(["/v1/chat/completions", "/v1/completions"]) if rng.random() < 0.1 else (
                "/v1/chat/completions" if chat else "/v1/completions")  # fmt: skip
            r = client.post(s.url + path, content=content, headers=random_headers(rng))
            check_answer(r, stream=isinstance(body, dict) and body.get("stream") is True)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if i % 50 == 0:
                assert client.get(s.url + "/health").json() == {"status": "ok"}
        s.assert_still_serving()
    assert statuses.get(200, 0) > NUM_REQUESTS // 5 and sum(v for k, v in statuses.items() if k >= 400) > NUM_REQUESTS // 5
