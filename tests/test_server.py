"""The OpenAI-compatible server on loopback: the official `openai` client, SSE, errors, auth, disconnects.

The server runs in a thread (uvicorn on a free port) in front of a tiny random model.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import torch

from kvlab import LLM

KEY = "test-key"


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    import uvicorn

    from kvlab.server.app import ServerConfig, create_app
    from kvlab.server.async_engine import AsyncEngine

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(tiny_chat_model, max_model_len=256)
    engine = AsyncEngine(llm.engine)
    app = create_app(llm, engine, ServerConfig(model_name="tiny", api_keys=(KEY,), max_body_bytes=64 * 1024))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    for _ in range(200):
        if uv.started:
            break
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", llm, engine
    uv.should_exit = True
    thread.join(10)
    torch.set_num_threads(before)
    assert engine.stopped.is_set()  # the lifespan's shutdown stopped the engine thread


@pytest.fixture(scope="module")
def reference(tiny_chat_model):
    """The same model in an engine of its own: the server's engine belongs to its thread."""
    return LLM(tiny_chat_model, max_model_len=256)


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def http(server, method: str, path: str, key: str | None = KEY, timeout: float = 30, **kwargs):
    headers = kwargs.pop("headers", {})
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.request(method, server[0] + path, headers=headers, timeout=timeout, **kwargs)


def wait_idle(llm, timeout: float = 10.0) -> None:
    """Until the engine holds no request and no block (requests end in the engine thread)."""
    end = time.time() + timeout
    while time.time() < end:
        if not llm.engine.has_unfinished_requests and llm.engine.kv.pool.num_used_blocks == 0:
            return
        time.sleep(0.02)
    raise AssertionError("the engine still holds requests or blocks")


def test_completions_with_the_openai_client(client, reference):
    out = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    expected = reference.generate("The capital of France is", _greedy(7))
    assert out.choices[0].text == expected.text and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids) and out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7
    split = out.model_extra["kvlab"]
    assert split["generated_tokens"] == 7 and split["queue_s"] >= 0 and split["prefill_chunks"] >= 1


def test_streaming_chat_with_the_openai_client(client, reference):
    messages = [{"role": "user", "content": "hello there"}]
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == reference.chat(messages, _greedy(9)).text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length" and "kvlab" in finals[0].model_extra
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9


def test_raw_sse_ends_with_done_and_seed_stop_top_k_work(server):
    body = {"model": "tiny", "prompt": "The capital", "max_tokens": 12, "temperature": 0.8, "top_p": 0.9, "top_k": 40,
            "seed": 5, "ignore_eos": True}  # fmt: skip
    plain = [http(server, "POST", "/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(2)]
    assert plain[0] == plain[1]  # the seed reproduces
    with httpx.stream("POST", server[0] + "/v1/completions", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:  # fmt: skip
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events) == plain[0]
    stop = plain[0][3:5]
    stopped = http(server, "POST", "/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == plain[0][: plain[0].index(stop)]


def test_models_health_and_metrics(server):
    models = http(server, "GET", "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert http(server, "GET", "/health", key=None).json() == {"status": "ok"}
    http(server, "POST", "/v1/completions", json={"model": "tiny", "prompt": "abc", "max_tokens": 3})
    metrics = http(server, "GET", "/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    for name in ("kvlab_requests_running", "kvlab_requests_waiting", "kvlab_kv_blocks_used", "kvlab_kv_blocks_total",
                 "kvlab_prefix_cache_hit_rate", "kvlab_time_to_first_token_seconds_bucket",
                 "kvlab_time_per_output_token_seconds_count", "kvlab_generation_tokens_total",
                 "kvlab_engine_prompt_step_seconds_total",
                 'kvlab_step_phase_seconds_total{model_name="tiny",phase="forward"}',
                 'phase="schedule"', 'phase="prepare_inputs"', 'phase="sample"', 'phase="detokenize"'):  # fmt: skip
        assert name in text, name
    for line in text.splitlines():  # every sample line is `name{labels} number`
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])
    prompt_s = next(line for line in text.splitlines() if line.startswith("kvlab_engine_prompt_step_seconds_total"))
    assert float(prompt_s.rsplit(" ", 1)[1]) > 0  # the completion's prompt ran in a step


@pytest.mark.parametrize(
    "path, body, status, code",
    [
        ("/v1/completions", b"{not json", 400, "invalid_json"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model_not_found"),
        ("/v1/completions", {"prompt": "hi"}, 400, None),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1000}, 400, "context_length_exceeded"),
        ("/v1/completions", {"model": "tiny", "prompt": [5] * 300}, 400, "context_length_exceeded"),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, 400, None),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_p": 2}, 400, None),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, None),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": "ten"}, 400, None),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 0}, 400, None),
        ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": 5}, 400, None),
        ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, None),
        ("/v1/completions", {"model": "tiny", "prompt": [99999]}, 400, None),
        ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, None),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}, 400, None),
        ("/v1/completions", {"model": "tiny", "prompt": "x" * 70_000}, 413, "request_too_large"),
        ("/v1/nothing-here", {"model": "tiny"}, 404, None),
    ],
)
def test_errors_have_the_right_status_and_the_openai_shape(server, path, body, status, code):
    kwargs = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = http(server, "POST", path, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code:
        assert error["code"] == code


def test_api_key_is_required_on_v1_and_metrics_but_not_health(server):
    assert http(server, "GET", "/v1/models", key=None).status_code == 401
    r = http(server, "POST", "/v1/completions", key="wrong", json={"model": "tiny", "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    metrics = http(server, "GET", "/metrics", key=None)
    assert metrics.status_code == 401 and metrics.json()["error"]["code"] == "invalid_api_key"
    assert http(server, "GET", "/health", key=None).status_code == 200


def test_openai_client_raises_its_own_errors(client):
    import openai

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=10_000)


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    _, llm, _ = server
    wait_idle(llm)
    body = {"model": "tiny", "prompt": "The capital", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:  # fmt: skip
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert llm.engine.kv.pool.num_used_blocks > 0
    # the connection is closed with the request far from done: the engine aborts it
    wait_idle(llm)
    assert llm.engine.stats.finished.get("abort", 0) >= 1
    llm.engine.kv.pool.check_integrity()


def test_a_client_that_gives_up_on_a_plain_request_frees_its_blocks(server, monkeypatch):
    _, llm, engine = server
    wait_idle(llm)
    aborted = llm.engine.stats.finished.get("abort", 0)
    # hold the engine thread inside its first step until the server has seen the client go:
    # the request cannot finish first, however fast the machine
    step, abort = llm.engine.step, engine.abort
    abort_asked = threading.Event()
    monkeypatch.setattr(llm.engine, "step", lambda: abort_asked.wait(10) and step())
    monkeypatch.setattr(engine, "abort", lambda rid: (abort(rid), abort_asked.set()))
    body = {"model": "tiny", "prompt": "The capital", "max_tokens": 240, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        http(server, "POST", "/v1/completions", json=body, timeout=0.3)
    assert abort_asked.wait(10)
    wait_idle(llm)
    assert llm.engine.stats.finished.get("abort", 0) == aborted + 1


def test_concurrent_requests_are_batched(server):
    _, llm, _ = server
    wait_idle(llm)
    steps_before, tokens_before = llm.engine.stats.steps, llm.engine.stats.generation_tokens
    body = {"model": "tiny", "max_tokens": 20, "temperature": 0, "ignore_eos": True}

    def ask(i):
        results[i] = http(server, "POST", "/v1/completions", json={**body, "prompt": f"request number {i}"}).json()

    results = [None] * 6
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r["usage"]["completion_tokens"] == 20 for r in results)
    assert llm.engine.stats.generation_tokens - tokens_before == 120
    assert llm.engine.stats.steps - steps_before < 120  # several requests per step
    assert max(r["kvlab"]["mean_decode_batch"] for r in results) > 1
    wait_idle(llm)


def test_every_post_counts_as_arriving_only_until_it_queued_or_ended(server):
    """The Arrivals middleware: nothing is left counted after generation requests, a refused one, a GET."""
    _, llm, engine = server
    wait_idle(llm)
    body = {"model": "tiny", "prompt": "hi"}
    assert http(server, "POST", "/v1/completions", json={**body, "max_tokens": 2}).status_code == 200
    assert http(server, "POST", "/v1/completions", json={**body, "max_tokens": -1}).status_code == 400
    with http_stream(server, {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True}) as r:
        assert engine._arriving == 0  # queued: counted no more, while its answer still streams
        r.read()
    assert http(server, "GET", "/v1/models").status_code == 200
    assert engine._arriving == 0


def http_stream(server, body):
    return httpx.stream("POST", server[0] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body,
                        timeout=30)  # fmt: skip


def _prompts_per_step(llm) -> list[int]:
    """Wrap the engine's scheduler: the prompts of each step that has any, appended to the list returned."""
    sizes, schedule = [], llm.engine.scheduler.schedule

    def counted():
        plan = schedule()
        prompts = sum(1 for c in plan.chunks if not c.is_decode)
        if prompts:
            sizes.append(prompts)
        return plan

    llm.engine.scheduler.schedule = counted
    return sizes


def test_a_burst_still_being_read_starts_in_one_step_and_a_lone_request_does_not_wait(tiny_chat_model):
    """Woken from idle by one request, the engine thread waits for the requests the server is still reading
    (here: one that queues its prompt 0.3 s later) and runs both prompts in one step; a request with
    nothing arriving beside it starts at once (burst_wait_s is long here: waiting for it would show)."""
    import asyncio

    from kvlab.output.result import RequestOutput
    from kvlab.server.async_engine import AsyncEngine

    llm = LLM(tiny_chat_model, max_model_len=128)
    engine = AsyncEngine(llm.engine)
    engine.burst_wait_s = 30.0
    prompts = _prompts_per_step(llm)
    engine.start()

    async def request(rid: str, delay: float):
        ids = [ord(rid) + k for k in range(6)]  # prompts that share no prefix
        with engine.arriving():
            await asyncio.sleep(delay)
            queue = engine.submit(rid, ids, _greedy(3), RequestOutput(prompt=None, prompt_token_ids=ids))
            engine.arrived()
            while not (item := await queue.get()).finished:
                pass
        return item

    async def burst():
        return await asyncio.gather(request("a", 0.0), request("b", 0.3))

    try:
        assert all(item.finished and item.error is None for item in asyncio.run(burst()))
        assert prompts[0] == 2  # a's prompt waited for b's
        started = time.monotonic()
        assert asyncio.run(request("c", 0.0)).error is None
        assert time.monotonic() - started < 10 and prompts[1:] == [1]  # alone: no wait for burst_wait_s
    finally:
        engine.shutdown()


def test_a_steps_outputs_reach_the_event_loop_in_one_wake_up_in_order():
    """The engine thread hands a step's outputs to each listening loop in one call, each request's in order;
    a finished request stops listening, and an unknown one is skipped."""
    import asyncio

    from kvlab.output.processor import StepOutput
    from kvlab.server.async_engine import AsyncEngine, _Listener

    loop = asyncio.new_event_loop()
    calls = []
    real = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: (calls.append(a), real(*a))[1]
    engine = AsyncEngine(engine=None)  # never started: only its delivery is exercised
    queues = {rid: asyncio.Queue() for rid in ("a", "b")}
    engine._listeners = {rid: _Listener(loop, q) for rid, q in queues.items()}
    outs = [StepOutput(rid, [t], str(t), finished=(rid == "b" and t == 2), output=None)
            for t in (1, 2) for rid in ("a", "b", "gone")]  # fmt: skip
    engine._deliver_step(outs)
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    assert len(calls) == 1
    got = {rid: [q.get_nowait().new_token_ids[0] for _ in range(q.qsize())] for rid, q in queues.items()}
    assert got == {"a": [1, 2], "b": [1, 2]}
    assert list(engine._listeners) == ["a"]


def _greedy(n: int):
    from kvlab import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_serve_prints_its_memory_plan_then_the_measured_figures(tiny_chat_model, capsys):
    from kvlab.cli import build_parser
    from kvlab.engine_cli import check_model_args, engine_options, open_llm
    from kvlab.server.cli import print_measured, print_plan

    args = build_parser().parse_args(["serve", str(tiny_chat_model), "--kv-memory", "1MiB", "--max-model-len", "256"])
    check_model_args(args)  # as `kvlab serve` does first: --dtype auto becomes the dtype it means
    options = engine_options(args)
    plan, weights = print_plan(args, options)
    llm = open_llm(args, **{**options, "kv_memory_bytes": plan.nbytes})
    print_measured(llm, plan, weights)
    err = capsys.readouterr().err
    for words in ("weights", "KV pool", f"{plan.num_blocks:,} blocks", "max concurrency", "planned → measured",
                  "running at once             128 → 32 requests (--max-num-seqs; 128 by default"):  # fmt: skip
        assert words in err, words
    assert llm.engine.cache.nbytes() == plan.nbytes and weights == llm.loaded.weight_bytes


def test_vllms_name_for_the_token_budget_works_too(tiny_chat_model):
    from kvlab.cli import build_parser
    from kvlab.engine_cli import engine_options

    for flag in ("--max-batched-tokens", "--max-num-batched-tokens"):
        args = build_parser().parse_args(["serve", str(tiny_chat_model), flag, "256"])
        assert engine_options(args)["max_num_batched_tokens"] == 256


@pytest.mark.parametrize(
    "args, words",
    [
        (["serve", "{model}", "--port", "70000"], ["--port"]),
        (["serve", "{model}", "--no-cache"], ["--no-cache"]),
        (["serve", "{model}", "--kv-memory", "1KiB"], ["KV pool", "cannot hold"]),
        (["serve", "{model}", "--max-num-seqs", "0"], ["--max-num-seqs"]),
        (["bench", "serve", "--model", "{model}", "--num-requests", "0"], ["--num-requests"]),
    ],
)
def test_bad_serve_and_bench_flags_are_one_line_errors(capsys, tiny_chat_model, args, words):
    from kvlab.cli import main

    code = main([a.format(model=tiny_chat_model) for a in args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("kvlab: error:"), err
    for word in words:
        assert word in err[0]
