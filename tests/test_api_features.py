"""Issue 16 on the tiny model: n choices from one prefill, log-probabilities (against the engine's own pass
and transformers), echo's prompt log-probabilities, structured outputs that always validate, several
prompts in one request, GET /v1/models/{id}, and what the Python API returns — over loopback with the
official openai client where a client would see it."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch
from loopback import llm, serving  # noqa: F401  (llm: the module's fixture)

from kvlab import SamplingParams
from kvlab.sampling.params import StructuredOutputs

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "color"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "color": {"enum": ["red", "green", "blue"]}}}  # fmt: skip


@pytest.fixture(scope="module")
def server(llm):
    with serving(llm) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def model_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """log-softmax [T, V] at every position of one pass over `ids` (a separate pass, without the engine)."""
    from kvlab.kv.cache import NoCache

    cache = NoCache(llm.config.num_layers)  # every position recomputed from the ids: no cache to trust
    logits = llm.engine.runner.driver.run(torch.tensor([ids]), cache, None, logits_index=torch.arange(len(ids)))
    return torch.log_softmax(logits[0].float(), -1)


def test_n_choices_share_one_prefill_and_are_seeded_per_choice(server, client):
    before = server.llm.engine.stats.step_tokens
    r = client.completions.create(model="tiny", prompt="The capital of the country is", n=3, max_tokens=6,
                                  temperature=1.0, seed=7)  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.text for c in r.choices}) == 3
    kv = r.model_extra["kvlab"]
    prompt = r.usage.prompt_tokens
    assert sum(c["prefill_tokens"] for c in kv["choices"]) == prompt  # the prompt went through the model once
    assert server.llm.engine.stats.step_tokens - before == prompt + 3 * 5  # then 5 decodes per choice
    again = client.completions.create(model="tiny", prompt="The capital of the country is", n=3, max_tokens=6,
                                      temperature=1.0, seed=7)  # fmt: skip
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    alone = client.completions.create(model="tiny", prompt="The capital of the country is", max_tokens=6,
                                      temperature=1.0, seed=8)  # choice 1 draws as seed 8 alone does  # fmt: skip
    assert alone.choices[0].text == r.choices[1].text
    server.assert_still_serving()


def test_streamed_choices_carry_their_index(client, server):
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                            max_tokens=4, temperature=1.0, seed=3, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
    text, finished, usage = {0: "", 1: ""}, set(), None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and usage.completion_tokens == 8
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                           max_tokens=4, temperature=1.0, seed=3)  # fmt: skip
    assert [c.message.content for c in plain.choices] == [text[0], text[1]]
    server.assert_still_serving()


def test_greedy_logprobs_agree_with_the_engines_own_logits(client, server, tiny_llm):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=5)  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens or len(content) == r.usage.completion_tokens - 1  # EOS hidden
    for entry in content:
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-6)  # greedy: the max
        assert sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1 + 1e-6
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token or "\ufffd" in entry.token
    ids = tiny_llm.encode_chat([{"role": "user", "content": "hello"}])
    out = tiny_llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=5, temperature=0, logprobs=5))
    assert [e.token_id for e in out.outputs[0].logprobs] == [
        t for t in out.token_ids if t not in tiny_llm.engine.eos_token_ids
    ]
    assert [e.token for e in content] == [tiny_llm.tokenizer.decode([e.token_id]) for e in out.outputs[0].logprobs]
    ref = model_logprobs(tiny_llm, ids + out.token_ids)
    for i, entry in enumerate(out.outputs[0].logprobs):
        assert math.isclose(entry.logprob, ref[len(ids) - 1 + i, entry.token_id].item(), abs_tol=1e-4)


def test_echo_prompt_logprobs_equal_a_separate_pass_and_transformers(client, llm, tiny_chat_model):
    import transformers

    r = client.completions.create(model="tiny", prompt="one two three four", max_tokens=1, temperature=0,
                                  echo=True, logprobs=2)  # fmt: skip
    lp = r.choices[0].logprobs
    ids = llm.encode("one two three four")
    assert r.choices[0].text.startswith("one two three four")
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + 1
    ours = model_logprobs(llm, ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    for q in range(1, len(ids)):
        assert math.isclose(lp.token_logprobs[q], ours[q - 1, ids[q]].item(), abs_tol=1e-5)
        assert math.isclose(lp.token_logprobs[q], theirs[q - 1, ids[q]].item(), abs_tol=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_json_schema_outputs_validate_on_20_seeded_runs_at_temperature_1(client):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    for seed in range(20):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a thing"}],
                                           temperature=1.0, seed=seed, max_tokens=120, response_format=fmt)  # fmt: skip
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_vllm_guided_fields_constrain_the_answer(server):
    r = server.post("/v1/completions", {"model": "tiny", "prompt": "pick", "max_tokens": 20, "temperature": 1.0,
                                        "seed": 1, "guided_choice": ["alpha", "beta"]})  # fmt: skip
    assert r.json()["choices"][0]["text"] in ("alpha", "beta"), r.text
    r = server.post("/v1/completions", {"model": "tiny", "prompt": "n", "max_tokens": 20, "temperature": 1.0,
                                        "seed": 2, "guided_regex": "[0-9]{3}-[a-z]{2}"})  # fmt: skip
    text = r.json()["choices"][0]["text"]
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-", text


def test_penalties_and_bias_reach_the_sampler(server):
    body = {"model": "tiny", "prompt": "a", "max_tokens": 4, "temperature": 0}
    plain = server.post("/v1/completions", {**body, "logprobs": 0}).json()["choices"][0]
    first = plain["logprobs"]["tokens"][0]
    token_id = server.llm.tokenizer.encode(first, add_special_tokens=False)[0]
    banned = server.post("/v1/completions", {**body, "logprobs": 0, "logit_bias": {str(token_id): -100}}).json()
    assert banned["choices"][0]["logprobs"]["tokens"][0] != first
    r = server.post("/v1/completions", {**body, "presence_penalty": 2, "frequency_penalty": 2})
    assert r.status_code == 200
    server.assert_still_serving()


def test_several_prompts_in_one_request_are_indexed_prompt_by_prompt(server):
    r = server.post("/v1/completions", {"model": "tiny", "prompt": ["one", [5, 6, 7]], "n": 2, "max_tokens": 3,
                                        "temperature": 0})  # fmt: skip
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][0]["text"] == body["choices"][1]["text"]  # greedy: choices agree
    single = server.post("/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0})
    assert body["choices"][2]["text"] == single.json()["choices"][0]["text"]
    assert body["usage"]["prompt_tokens"] == len(server.llm.encode("one")) + 3
    server.assert_still_serving()


def test_best_of_keeps_the_most_likely_choices(server, tiny_llm):
    params = {"max_tokens": 4, "temperature": 1.0, "seed": 5, "logprobs": 0}
    every = tiny_llm.generate("x", SamplingParams(n=4, **params)).outputs  # the same four sequences (seed + i)
    best = tiny_llm.generate("x", SamplingParams(n=2, best_of=4, **params)).outputs
    ranked = sorted(every, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked] and [c.index for c in best] == [0, 1]
    r = server.post("/v1/completions", {"model": "tiny", "prompt": "x", "n": 1, "best_of": 4, **params})
    assert r.json()["choices"][0]["text"] == ranked[0].text
    server.assert_still_serving()


def test_models_by_id(server):
    assert server.get("/v1/models/tiny").json()["id"] == "tiny"
    r = server.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_the_python_api_returns_choices_and_logprobs(tiny_llm):
    out = tiny_llm.generate("The", SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=0, logprobs=1,
                                             prompt_logprobs=1))  # fmt: skip
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.logprobs) <= len(c.token_ids) and c.cumulative_logprob <= 0 for c in out.outputs)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    constrained = tiny_llm.generate(
        "x",
        SamplingParams(
            max_tokens=30, temperature=1.0, seed=3, structured_outputs=StructuredOutputs(choice=["yes", "no"])
        ),
    )
    assert constrained.text in ("yes", "no")
    assert not tiny_llm.engine.has_unfinished_requests and tiny_llm.engine.ledger().is_balanced


def test_a_schema_the_engine_cannot_compile_is_a_400_naming_it(server):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        headers=server.headers(),
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}},
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
