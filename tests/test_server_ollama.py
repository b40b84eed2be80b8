"""Ollama's native API on the same engine (issue 27, item 1), with the official `ollama` client, over loopback
in front of the tiny model: the same answer as the OpenAI route, NDJSON streams, raw generate, `format`
through the structured-output masks, tools (a scripted call), the model routes, Ollama's error shape.
"""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import pytest
from scripted import scripted
from test_serve_abuse import WEATHER, tools_model  # noqa: F401  (tools_model: a fixture)

from loopback import llm, serving  # noqa: F401  (llm: the module's fixture)

ollama = pytest.importorskip("ollama")

QUESTION = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def server(llm):
    with serving(llm) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url)


@pytest.fixture(scope="module")
def tools_server(tools_model, one_thread):
    from kvlab import LLM

    with serving(LLM(tools_model, max_model_len=512)) as s:
        yield s


def openai_chat(server, max_tokens: int, **fields) -> dict:
    body = {"model": "tiny", "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0, **fields}
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_answers_as_the_openai_route_with_ollamas_counts(client, server):
    r = client.chat(model="tiny", messages=QUESTION, stream=False, options={"temperature": 0, "num_predict": 6})
    same = openai_chat(server, 6)
    assert r.message.role == "assistant" and r.message.content == same["choices"][0]["message"]["content"]
    assert r.done and r.done_reason == "length" and r.eval_count == 6
    assert r.prompt_eval_count == same["usage"]["prompt_tokens"]
    assert r.total_duration >= r.eval_duration > 0 and r.prompt_eval_duration > 0 and r.load_duration == 0
    raw = server.post("/api/chat", {"model": "tiny", "messages": QUESTION, "stream": False,
                                    "options": {"temperature": 0, "num_predict": 6}}).json()  # fmt: skip
    assert raw["kvlab"]["generated_tokens"] == 6 and raw["message"]["content"] == r.message.content  # kvlab's split
    server.assert_still_serving()


def test_chat_streams_ndjson_by_default(client, server):
    parts = list(client.chat(model="tiny", messages=QUESTION, stream=True, options={"temperature": 0, "num_predict": 7}))
    whole = client.chat(model="tiny", messages=QUESTION, stream=False, options={"temperature": 0, "num_predict": 7})
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 7
    with httpx.stream("POST", server.url + "/api/chat", json={"model": "tiny", "messages": QUESTION,
                      "options": {"num_predict": 3}}, timeout=30) as r:  # fmt: skip  (no "stream": NDJSON)
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] == 3


def test_generate_templated_and_raw(client, server):
    r = client.generate(model="tiny", prompt="hello there", options={"temperature": 0, "num_predict": 5})
    assert r.response == openai_chat(server, 5)["choices"][0]["message"]["content"] and r.eval_count == 5
    raw = client.generate(model="tiny", prompt="The capital of France is", raw=True,
                          options={"temperature": 0, "num_predict": 5})  # fmt: skip
    same = server.complete("The capital of France is", max_tokens=5)
    assert raw.response == same["choices"][0]["text"]
    streamed = "".join(p.response for p in client.generate(model="tiny", prompt="The capital of France is", raw=True,
                                                            stream=True, options={"temperature": 0, "num_predict": 5}))
    assert streamed == raw.response


def test_options_reach_the_sampler(client):
    options = {"temperature": 0.9, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "seed": 7, "repeat_penalty": 1.1,
               "presence_penalty": 0.5, "frequency_penalty": 0.5, "num_predict": 8, "num_thread": 4, "mirostat": 0}
    first, second = (client.chat(model="tiny", messages=QUESTION, stream=False, options=options) for _ in range(2))
    assert first.message.content == second.message.content  # the seed reproduces
    other = client.chat(model="tiny", messages=QUESTION, stream=False, options={**options, "seed": 8})
    assert other.eval_count == 8
    stop = first.message.content[2:4]
    stopped = client.chat(model="tiny", messages=QUESTION, stream=False, options={**options, "stop": [stop]})
    assert stopped.done_reason == "stop" and stopped.message.content == first.message.content[: first.message.content.index(stop)]


def test_num_ctx_bounds_the_answer(client):
    r = client.chat(model="tiny", messages=QUESTION, stream=False, options={"temperature": 0, "num_ctx": 34})
    assert r.prompt_eval_count + r.eval_count == 34 or r.done_reason == "stop"  # the rest of num_ctx, not of 256


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
          "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": False}  # fmt: skip


@pytest.mark.parametrize("fmt", ["json", SCHEMA])
def test_format_goes_through_the_structured_output_mask(client, fmt):
    r = client.chat(model="tiny", messages=QUESTION, stream=False, format=fmt, options={"num_predict": 60, "seed": 1})
    data = json.loads(r.message.content)
    if fmt == "json":
        assert isinstance(data, dict)
    else:
        jsonschema.validate(data, SCHEMA)


def test_a_tool_call_and_its_result(tools_server):
    client = ollama.Client(host=tools_server.url)
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = tools_server.llm.tokenizer.encode(call, add_special_tokens=False)
    for stream in (False, True):
        with scripted(tools_server.llm, ids):
            r = client.chat(model="tiny", messages=QUESTION, tools=[WEATHER], stream=stream)
            if stream:
                parts = list(r)
                calls = [c for p in parts for c in (p.message.tool_calls or [])]
            else:
                calls = r.message.tool_calls
        assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("weather", {"city": "Paris"})]
        jsonschema.validate(dict(calls[0].function.arguments), WEATHER["function"]["parameters"])
    history = [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "weather",
               "arguments": {"city": "Paris"}}}]}, {"role": "tool", "content": "18 C", "tool_name": "weather"}]  # fmt: skip
    after = client.chat(model="tiny", messages=history, tools=[WEATHER], stream=False, options={"num_predict": 3})
    assert after.done and after.eval_count == 3
    tools_server.assert_still_serving()


def test_model_routes(client, server):
    (listed,) = client.list().models
    assert listed.model == "tiny" and listed.size > 0 and listed.details.family == "llama"
    shown = client.show("tiny")
    assert shown.modelinfo["llama.context_length"] == 256 and "completion" in shown.capabilities
    assert "tools" not in shown.capabilities  # the tiny template has no tools section
    assert shown.template == server.llm.tokenizer.chat_template
    (running,) = client.ps().models
    assert running.model == "tiny" and running.context_length == 256
    assert server.get("/api/version").json()["version"]
    with pytest.raises(ollama.ResponseError) as e:
        client.show("llama3")
    assert e.value.status_code == 404


def test_an_empty_request_loads_the_model(server):
    for path, body in (("/api/chat", {"model": "tiny", "messages": []}), ("/api/generate", {"model": "tiny"})):
        r = server.post(path, body)
        assert r.status_code == 200 and r.json()["done"] is True and r.json()["done_reason"] == "load"


@pytest.mark.parametrize("body, status, fragment", [
    ({"model": "tiny", "messages": QUESTION, "options": {"num_predict": "many"}}, 400, "max_tokens"),
    ({"model": "tiny", "messages": QUESTION, "options": {"mirostat": 2}}, 400, "mirostat"),
    ({"model": "tiny", "messages": QUESTION, "options": {"warp": 1}}, 400, "warp"),
    ({"model": "tiny", "messages": QUESTION, "options": {"num_ctx": 8}}, 400, "num_ctx"),
    ({"model": "tiny", "messages": QUESTION, "format": "yaml"}, 400, "format"),
    ({"model": "tiny", "messages": QUESTION, "think": "maybe"}, 400, "think"),
    ({"model": "tiny", "messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, 400, "images"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "wizard"),
    ({"model": "tiny", "messages": QUESTION, "frobnicate": True}, 400, "frobnicate"),
    ({"model": "llama3", "messages": QUESTION}, 404, "llama3"),
    ({"messages": QUESTION}, 400, "model"),
    (b'{"model": "tiny", "messages": [', 400, "JSON"),
    (b"[]", 400, "object"),
])  # fmt: skip
def test_bad_input_is_a_4xx_in_ollamas_shape(server, body, status, fragment):
    r = server.post("/api/chat", body)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and fragment in r.json()["error"]
    server.assert_still_serving()


def test_the_guard_and_the_key_answer_in_ollamas_shape(llm):
    with serving(llm, api_keys=("k",)) as s:
        body = json.dumps({"model": "tiny", "messages": QUESTION}).encode()
        for r, status in ((s.post("/api/chat", body, key=None), 401),
                          (s.post("/api/chat", body, headers={"Content-Type": "text/plain"}), 415),
                          (s.post("/api/chat", body, headers={"Origin": "http://evil.example"}), 403),
                          (s.post("/api/chat", body, headers={"Host": "evil.example"}), 400),
                          (s.post("/api/nothing", body), 404)):  # fmt: skip
            assert r.status_code == status and set(r.json()) == {"error"}, r.text
        authorized = ollama.Client(host=s.url, headers={"Authorization": "Bearer k"})
        assert authorized.chat(model="tiny", messages=QUESTION, stream=False, options={"num_predict": 2}).done
        metrics = s.get("/metrics").text
        assert 'route="/api/chat",status="200"' in metrics and 'route="/api/chat",status="401"' in metrics
        s.assert_still_serving()


@pytest.mark.parametrize("path, body", [
    ("/api/chat", {"model": "tiny", "messages": QUESTION, "options": {"num_predict": 200}}),
    ("/v1/messages", {"model": "tiny", "messages": QUESTION, "max_tokens": 200, "stream": True}),
    ("/v1/responses", {"model": "tiny", "input": "hello", "max_output_tokens": 200, "stream": True}),
])  # fmt: skip
def test_a_client_leaving_any_stream_aborts_its_request(server, caplog, path, body):
    import logging

    with caplog.at_level(logging.INFO, logger="kvlab.access"):
        with httpx.stream("POST", server.url + path, json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(line for line in lines if line)  # the first frame, then the client goes
        server.wait_idle()  # aborted: every block back
        deadline = time.monotonic() + 10  # the access line is written as the stream's task ends: a moment later
        while not any(f'"POST {path}" 499' in m for m in caplog.messages) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert any(f'"POST {path}" 499' in m for m in caplog.messages), caplog.messages
    server.assert_still_serving()


def test_every_new_route_has_its_access_line_and_its_count(server, caplog):
    import logging

    calls = [("GET", "/api/tags", None), ("POST", "/api/show", {"model": "tiny"}), ("GET", "/api/version", None),
             ("POST", "/v1/messages/count_tokens", {"model": "tiny", "messages": QUESTION}),
             ("POST", "/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": QUESTION}),
             ("POST", "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2}),
             ("GET", "/v1/responses/resp_missing", None)]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="kvlab.access"):
        for method, path, body in calls:
            r = server.post(path, body) if method == "POST" else server.get(path)
            assert r.status_code == (404 if "missing" in path else 200), r.text
    for method, path, _ in calls:
        assert any(f'"{method} {path}" ' in m for m in caplog.messages), path
    metrics = server.get("/metrics").text
    for route in ("/api/tags", "/api/show", "/v1/messages", "/v1/responses", "/v1/responses/{response_id}"):
        assert f'route="{route}",status=' in metrics, route
