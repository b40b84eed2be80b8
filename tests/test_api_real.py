"""Issue 16 with real models and real clients: a tool call round trip with qwen2.5-coder-0.5b through the
openai client and LangChain's bind_tools, LangChain's with_structured_output, and SmolLM2's template
refusing tools with a 400."""

from __future__ import annotations

import json

import pytest
from loopback import serving

from kvlab import LLM

pytestmark = pytest.mark.real

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = json.dumps({"temperature_c": 18, "sky": "sunny"})


@pytest.fixture(scope="module")
def qwen(real_model):
    llm = LLM(real_model("qwen2.5-coder-0.5b"), max_model_len=4096)
    with serving(llm) as s:
        yield s


@pytest.fixture(scope="module")
def client(qwen):
    from openai import OpenAI

    return OpenAI(base_url=qwen.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_tool_call_round_trip_with_the_openai_client(client, qwen, tool_choice):
    r = client.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER], tool_choice=tool_choice,
                                       temperature=0, max_tokens=100)  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and "paris" in json.loads(call.function.arguments)["city"].lower()
    messages = [*QUESTION, choice.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": ANSWER}]  # fmt: skip
    final = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=60)  # fmt: skip
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    assert "18" in final.choices[0].message.content or "sunny" in final.choices[0].message.content.lower()
    qwen.assert_still_serving()


def test_tool_calls_stream_as_deltas(client):
    stream = client.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER], tool_choice="required",
                                            temperature=0, max_tokens=100, stream=True)  # fmt: skip
    calls, reasons = [], []
    for chunk in stream:
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            reasons += [c.finish_reason] if c.finish_reason else []
    assert reasons == ["tool_calls"] and [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments)["city"]


def test_langchain_bind_tools_round_trip(qwen):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return ANSWER

    chat = ChatOpenAI(base_url=qwen.url + "/v1", api_key="unused", model="tiny", temperature=0, max_tokens=100)
    ai = chat.bind_tools([get_weather], tool_choice="get_weather").invoke(
        [HumanMessage("What is the weather in Paris?")]
    )
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and "paris" in call["args"]["city"].lower()
    final = chat.invoke([HumanMessage("What is the weather in Paris?"), ai,
                         ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])])  # fmt: skip
    assert final.content and not final.tool_calls


def test_langchain_with_structured_output(qwen):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str
        population_millions: float

    chat = ChatOpenAI(base_url=qwen.url + "/v1", api_key="unused", model="tiny", temperature=0, max_tokens=100)
    city = chat.with_structured_output(City).invoke("Describe Paris as JSON.")
    assert isinstance(city, City) and city.name


def test_smollm2s_template_has_no_tools_section(real_model):
    from openai import BadRequestError, OpenAI

    llm = LLM(real_model("smollm2-135m"), max_model_len=1024)
    with serving(llm) as s:
        client = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(BadRequestError, match="no tools section"):
            client.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER], max_tokens=5)
        s.assert_still_serving()
