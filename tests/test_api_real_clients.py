"""Issue 27 with a real model and the clients people use: `kvlab serve qwen2.5-coder-0.5b` (its template has
tools) answering the official `ollama`, `anthropic` and `openai` (Responses) clients and LangChain's ChatOllama
and ChatAnthropic. Structured outputs always parse; tool calls carry JSON that validates against the tool's
schema. Few requests, few tokens each: CI time is short.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from loopback import serving

from kvlab import LLM

pytestmark = pytest.mark.real

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OLLAMA_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
               "parameters": WEATHER_SCHEMA}}  # fmt: skip
QUESTION = "What is the weather in Paris?"
CITY = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
        "required": ["name", "country"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def qwen(real_model):
    llm = LLM(real_model("qwen2.5-coder-0.5b"), max_model_len=4096)
    with serving(llm, model_name="qwen2.5-coder-0.5b") as s:
        yield s


def test_the_ollama_client(qwen):
    import ollama

    client = ollama.Client(host=qwen.url)
    options = {"temperature": 0, "num_predict": 12}
    r = client.chat(model="qwen2.5-coder-0.5b", messages=[{"role": "user", "content": "Say hello."}], options=options)
    assert r.message.content.strip() and r.eval_count <= 12 and r.prompt_eval_count > 0
    streamed = "".join(p.message.content for p in client.chat(model="qwen2.5-coder-0.5b", stream=True, options=options,
                       messages=[{"role": "user", "content": "Say hello."}]))  # fmt: skip
    assert streamed == r.message.content
    g = client.generate(model="qwen2.5-coder-0.5b", prompt="def add(a, b):", raw=True, options=options)
    assert g.response and g.done
    shaped = client.chat(model="qwen2.5-coder-0.5b", messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                         format=CITY, options={"temperature": 0, "num_predict": 150})  # fmt: skip
    assert shaped.done_reason == "stop"
    jsonschema.validate(json.loads(shaped.message.content), CITY)
    call = client.chat(model="qwen2.5-coder-0.5b", messages=[{"role": "user", "content": QUESTION}], tools=[OLLAMA_TOOL],
                       options={"temperature": 0, "num_predict": 60})  # fmt: skip
    (tool_call,) = call.message.tool_calls
    assert tool_call.function.name == "get_weather"
    jsonschema.validate(dict(tool_call.function.arguments), WEATHER_SCHEMA)
    assert "tools" in client.show("qwen2.5-coder-0.5b").capabilities
    assert [m.model for m in client.list().models] == ["qwen2.5-coder-0.5b"]
    qwen.wait_idle()  # every KV block back in the pool


def test_the_anthropic_client(qwen):
    import anthropic

    client = anthropic.Anthropic(base_url=qwen.url, api_key="unused", max_retries=0)
    greedy = {"temperature": 0}  # the SDK has no such argument any more; the API takes it
    m = client.messages.create(model="qwen2.5-coder-0.5b", max_tokens=12, system="Answer briefly.", extra_body=greedy,
                               messages=[{"role": "user", "content": "Say hello."}])  # fmt: skip
    assert m.content[0].type == "text" and m.content[0].text.strip() and m.usage.output_tokens <= 12
    with client.messages.stream(model="qwen2.5-coder-0.5b", max_tokens=12,
                                messages=[{"role": "user", "content": "Say hello."}]) as stream:  # fmt: skip
        text = "".join(stream.text_stream)
    assert text.strip()
    tool = {"name": "get_weather", "description": "Get the current weather in a city", "input_schema": WEATHER_SCHEMA}
    t = client.messages.create(model="qwen2.5-coder-0.5b", max_tokens=60, tools=[tool], extra_body=greedy,
                               messages=[{"role": "user", "content": QUESTION}])  # fmt: skip
    (use,) = [b for b in t.content if b.type == "tool_use"]
    assert t.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    assert "paris" in use.input["city"].lower()


def test_the_openai_responses_client(qwen):
    from openai import OpenAI

    client = OpenAI(base_url=qwen.url + "/v1", api_key="unused", max_retries=0)
    first = client.responses.create(model="qwen2.5-coder-0.5b", input="My name is Ada. Say hi.", max_output_tokens=12,
                                    temperature=0)  # fmt: skip
    assert first.output_text.strip()
    second = client.responses.create(model="qwen2.5-coder-0.5b", input="What is my name?", max_output_tokens=12,
                                     previous_response_id=first.id, temperature=0)  # fmt: skip
    assert "ada" in second.output_text.lower() and second.usage.input_tokens_details.cached_tokens > 0
    events = list(client.responses.create(model="qwen2.5-coder-0.5b", input="Say hello.", max_output_tokens=8,
                                          stream=True))  # fmt: skip
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    tool = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
            "parameters": WEATHER_SCHEMA}  # fmt: skip
    r = client.responses.create(model="qwen2.5-coder-0.5b", input=QUESTION, tools=[tool], max_output_tokens=60,
                                temperature=0)  # fmt: skip
    (call,) = [i for i in r.output if i.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)


def test_langchain_chat_ollama(qwen):
    from langchain_ollama import ChatOllama
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    chat = ChatOllama(base_url=qwen.url, model="qwen2.5-coder-0.5b", temperature=0, num_predict=40)
    assert chat.invoke("Say hello.").content.strip()
    assert "".join(c.content for c in chat.stream("Say hello.")).strip()
    ai = chat.bind_tools([OLLAMA_TOOL]).invoke(QUESTION)
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER_SCHEMA)
    city = chat.with_structured_output(City).invoke("Describe Paris.")
    assert isinstance(city, City) and city.name


def test_langchain_chat_anthropic(qwen):
    from langchain_anthropic import ChatAnthropic
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    chat = ChatAnthropic(base_url=qwen.url, api_key="unused", model="qwen2.5-coder-0.5b", max_tokens=40, temperature=0,
                         max_retries=0)  # fmt: skip
    assert chat.invoke("Say hello.").content
    assert "".join(c.text for c in chat.stream("Say hello.")).strip()
    ai = chat.bind_tools([OLLAMA_TOOL]).invoke(QUESTION)
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER_SCHEMA)
    city = chat.with_structured_output(City).invoke("Describe Paris.")
    assert isinstance(city, City) and city.name
