"""Anthropic's Messages API on the same engine (issue 27, item 3), with the official `anthropic` client over
loopback in front of the tiny model: the same answer as the OpenAI route, Anthropic's stream events, stop
sequences, tools (a call forced by the grammar, a scripted one, a tool_result round trip), structured
output, count_tokens, `x-api-key`, and Anthropic's error shape.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from scripted import scripted
from test_serve_abuse import tools_model  # noqa: F401  (a fixture)

from loopback import llm, serving  # noqa: F401  (llm: the module's fixture)

anthropic = pytest.importorskip("anthropic")

KEY = "k-anthropic"
QUESTION = [{"role": "user", "content": "hello there"}]
TOOL = {"name": "weather", "description": "the weather in a city", "input_schema": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10}}, "required": ["city"], "additionalProperties": False}}  # fmt: skip


@pytest.fixture(scope="module")
def server(llm):
    with serving(llm, api_keys=(KEY,)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tools_server(tools_model, one_thread):
    from kvlab import LLM

    with serving(LLM(tools_model, max_model_len=512)) as s:
        yield s


def openai_text(server, max_tokens: int, messages=QUESTION, **fields) -> str:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **fields}
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_messages_create_answers_as_the_openai_route(client, server):
    m = client.messages.create(model="tiny", max_tokens=6, messages=QUESTION, extra_body={"temperature": 0})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    (block,) = m.content
    assert block.type == "text" and block.text == openai_text(server, 6)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6
    prompt = server.post("/v1/messages/count_tokens", {"model": "tiny", "messages": QUESTION}).json()["input_tokens"]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt > 0
    server.assert_still_serving()


def test_system_and_stop_sequences(client, server):
    system = "You are terse."
    full = openai_text(server, 12, [{"role": "system", "content": system}, *QUESTION])
    assert client.messages.create(model="tiny", max_tokens=12, system=system, messages=QUESTION,
                                  extra_body={"temperature": 0}).content[0].text == full  # fmt: skip
    stop = full[4:6]
    m = client.messages.create(model="tiny", max_tokens=12, system=[{"type": "text", "text": system}],
                               messages=QUESTION, extra_body={"temperature": 0}, stop_sequences=[stop])  # fmt: skip
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == full[: full.index(stop)]


def test_messages_stream_gives_anthropics_events(client):
    whole = client.messages.create(model="tiny", max_tokens=8, messages=QUESTION, extra_body={"temperature": 0})
    with client.messages.stream(model="tiny", max_tokens=8, messages=QUESTION, extra_body={"temperature": 0}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8


def test_a_forced_tool_call_validates_against_its_schema(tools_server):
    client = anthropic.Anthropic(base_url=tools_server.url, api_key="unused", max_retries=0)
    m = client.messages.create(model="tiny", max_tokens=120, messages=QUESTION, tools=[TOOL],
                               tool_choice={"type": "tool", "name": "weather"})  # fmt: skip
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "weather" and use.id.startswith("toolu_"), m
    jsonschema.validate(use.input, TOOL["input_schema"])
    answered = [*QUESTION, {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": "weather",
                "input": use.input}]}, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                "content": "18 C"}, {"type": "text", "text": "and tomorrow?"}]}]  # fmt: skip
    after = client.messages.create(model="tiny", max_tokens=3, messages=answered, tools=[TOOL])
    assert after.usage.output_tokens >= 1 and after.stop_reason in ("max_tokens", "end_turn", "tool_use")
    tools_server.assert_still_serving()


def test_a_scripted_tool_call_streams_as_a_tool_use_block(tools_server):
    client = anthropic.Anthropic(base_url=tools_server.url, api_key="unused", max_retries=0)
    said = 'Let me look.<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    ids = tools_server.llm.tokenizer.encode(said, add_special_tokens=False)
    with scripted(tools_server.llm, ids):
        m = client.messages.create(model="tiny", max_tokens=100, messages=QUESTION, tools=[TOOL])
        with client.messages.stream(model="tiny", max_tokens=100, messages=QUESTION, tools=[TOOL]) as stream:
            kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
            final = stream.get_final_message()
    for message in (m, final):
        assert [b.type for b in message.content] == ["text", "tool_use"] and message.stop_reason == "tool_use"
        assert message.content[0].text == "Let me look." and message.content[1].input == {"city": "Paris"}
    assert "input_json_delta" in kinds


def test_output_config_format_parses(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}}, "required": ["answer"],
              "additionalProperties": False}  # fmt: skip
    m = client.messages.create(model="tiny", max_tokens=60, messages=QUESTION,
                               extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    jsonschema.validate(json.loads(m.content[0].text), schema)


def test_the_key_comes_as_x_api_key_or_bearer(server):
    body = {"model": "tiny", "max_tokens": 2, "messages": QUESTION}
    assert server.post("/v1/messages", body, key=None, headers={"x-api-key": KEY}).status_code == 200
    assert server.post("/v1/messages", body).status_code == 200  # Authorization: Bearer
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model="tiny", max_tokens=2, messages=QUESTION)
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": e.value.body[
        "error"]["message"]}}  # fmt: skip


@pytest.mark.parametrize("fields, fragment", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),  # no tools
    ({"thinking": {"type": "sometimes"}}, "thinking"),
    ({"top_k": -5}, "top_k"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"max_tokens": 10**6}, "context"),
])  # fmt: skip
def test_bad_input_is_a_400_in_anthropics_shape(server, fields, fragment):
    body = {"model": "tiny", "max_tokens": 4, "messages": QUESTION, **fields}
    r = server.post("/v1/messages", {k: v for k, v in body.items() if v is not None})
    assert r.status_code == 400, r.text
    error = r.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error" and fragment in error["error"]["message"]
    server.assert_still_serving()


def test_unknown_model_bad_json_and_the_guard_keep_the_shape(server):
    for r, status in ((server.post("/v1/messages", {"model": "claude-x", "max_tokens": 2, "messages": QUESTION}), 404),
                      (server.post("/v1/messages", b'{"model": '), 400),
                      (server.post("/v1/messages", b"{}", headers={"Content-Type": "text/plain"}), 415),
                      (server.post("/v1/messages/count_tokens", {"model": "tiny", "messages": "x"}), 400)):  # fmt: skip
        assert r.status_code == status and r.json()["type"] == "error" and r.json()["error"]["message"], r.text
    server.assert_still_serving()
