"""OpenAI's Responses API on the same engine (issue 27, item 2), with the official `openai` client over loopback
in front of the tiny model: the same answer as the chat route, the Responses event sequence,
previous_response_id over the store (and the prefix cache it reuses), GET and DELETE, store: false, function
tools, text.format, and OpenAI's error shape.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from scripted import scripted
from test_serve_abuse import tools_model  # noqa: F401  (a fixture)

from loopback import llm, serving  # noqa: F401  (llm: the module's fixture)

openai = pytest.importorskip("openai")

KEYS = ("k1", "k2")
TOOL = {"type": "function", "name": "weather", "description": "the weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}}  # fmt: skip


@pytest.fixture(scope="module")
def server(llm):
    with serving(llm, api_keys=KEYS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[0], max_retries=0)


@pytest.fixture(scope="module")
def tools_server(tools_model, one_thread):
    from kvlab import LLM

    with serving(LLM(tools_model, max_model_len=512)) as s:
        yield s


def chat_text(client, max_tokens: int, messages) -> str:
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content


def test_create_answers_as_the_chat_route(client, server):
    r = client.responses.create(model="tiny", input="hello there", instructions="Be brief.", max_output_tokens=6,
                                temperature=0)  # fmt: skip
    same = chat_text(client, 6, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}])
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == same
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 6 and r.usage.total_tokens == r.usage.input_tokens + 6
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    server.assert_still_serving()


def test_streaming_gives_the_responses_events(client):
    whole = client.responses.create(model="tiny", input="hello there", max_output_tokens=7, temperature=0)
    events = list(client.responses.create(model="tiny", input="hello there", max_output_tokens=7, temperature=0,
                                          stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 7


def test_previous_response_id_continues_from_the_store_and_the_prefix_cache(client, server):
    first = client.responses.create(model="tiny", input="My name is Ada.", max_output_tokens=5, temperature=0)
    second = client.responses.create(model="tiny", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=5, temperature=0)  # fmt: skip
    history = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "What is my name?"}]  # fmt: skip
    assert second.output_text == chat_text(client, 5, history) and second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16  # the first turn's blocks
    assert client.responses.retrieve(first.id).output_text == first.output_text
    other = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[1], max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)  # another key's response is not there for it
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="again", previous_response_id=first.id, max_output_tokens=2)
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    server.assert_still_serving()


def test_function_tools_and_their_outputs(tools_server):
    client = openai.OpenAI(base_url=tools_server.url + "/v1", api_key="unused", max_retries=0)
    r = client.responses.create(model="tiny", input="weather in Paris?", tools=[TOOL], tool_choice="required",
                                max_output_tokens=120)  # fmt: skip
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "weather" and call.call_id and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])
    follow = client.responses.create(model="tiny", previous_response_id=r.id, tools=[TOOL], max_output_tokens=3,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "18 C"}])  # fmt: skip
    assert follow.usage.output_tokens >= 1
    said = 'ok<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    with scripted(tools_server.llm, tools_server.llm.tokenizer.encode(said, add_special_tokens=False)):
        events = list(client.responses.create(model="tiny", input="weather?", tools=[TOOL], stream=True,
                                              max_output_tokens=100))  # fmt: skip
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["message", "function_call"] and json.loads(done[1].arguments) == {"city": "Oslo"}
    assert events[-1].type == "response.completed" and [i.type for i in events[-1].response.output] == [
        "message", "function_call"]  # fmt: skip
    tools_server.assert_still_serving()


def test_text_format_json_schema_parses(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 10}}, "required": ["answer"],
              "additionalProperties": False}  # fmt: skip
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "a", "schema": schema}})  # fmt: skip
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize("fields, status, param", [
    ({"input": 5}, 400, "input"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, 400, "input"),
    ({"input": [{"role": "wizard", "content": "x"}]}, 400, "input"),
    ({"max_output_tokens": 0}, 400, "max_tokens"),
    ({"temperature": 3}, 400, "temperature"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"text": {"format": {"type": "json_schema"}}}, 400, "text"),
    ({"truncation": "auto"}, 400, "truncation"),
    ({"previous_response_id": "resp_nothing"}, 404, "previous_response_id"),
    ({"frobnicate": 1}, 400, "frobnicate"),
    ({"model": "gpt-5"}, 404, "model"),
])  # fmt: skip
def test_bad_input_is_a_4xx_in_openais_shape(server, fields, status, param):
    r = server.post("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2, **fields})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param
    server.assert_still_serving()


def test_the_store_is_bounded_in_responses_and_in_text():
    from kvlab.server.response_store import ResponseStore, Stored

    store = ResponseStore(capacity=3, max_chars=100)
    for i in range(5):
        store.put(f"r{i}", Stored({}, [{"role": "user", "content": "x" * 10}], None))
    assert len(store) == 3 and store.get("r1", None) is None and store.get("r4", None) is not None
    assert store.get("r4", "another key") is None  # another tenant's
    store.put("big", Stored({}, [{"role": "user", "content": "y" * 95}], None))
    assert len(store) == 1 and store.num_chars == 95  # the oldest went until the text fits
    assert store.delete("big", None) and store.num_chars == 0 and not store.delete("big", None)
