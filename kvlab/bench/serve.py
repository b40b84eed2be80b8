"""A serving load generator: N requests, at most C at a time, against a server URL or an in-process engine.

    workload  num_requests, concurrency, prompt_len (+ an optional shared prefix), output_len, seed,
              and a time bound: requests still running at max_duration_s are aborted, none start after
    reports   request throughput, output tok/s, TTFT p50/p99, TPOT p50/p99, prefix-cache hit rate

Prompts are random token ids (seeded), sent as token-id prompts with `ignore_eos`, so every request
produces exactly output_len tokens whatever the model.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Workload:
    num_requests: int = 16
    concurrency: int = 16
    prompt_len: int = 64  # tokens of each prompt after the shared prefix
    output_len: int = 64
    shared_prefix_len: int = 0  # tokens every prompt starts with
    seed: int = 0
    max_duration_s: float = 600.0

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(self.seed)
        low, high = 100, max(vocab_size - 100, 101)  # clear of special tokens at either end
        prefix = [rng.randrange(low, high) for _ in range(self.shared_prefix_len)]
        return [prefix + [rng.randrange(low, high) for _ in range(self.prompt_len)] for _ in range(self.num_requests)]


@dataclass
class RequestRecord:
    ttft_s: float
    tpot_s: float
    e2e_s: float
    output_tokens: int
    cached_prompt_tokens: int | None = None
    finish_reason: str | None = None


@dataclass
class BenchResult:
    target: str
    workload: Workload
    duration_s: float
    records: list[RequestRecord] = field(default_factory=list)
    prefix_hit_rate: float | None = None  # of this run's requests (token-weighted)
    aborted: int = 0
    prompt_step_s: float | None = None  # in process: the run's time in steps that computed prompt tokens

    def summary(self) -> dict:
        done = [r for r in self.records if r.finish_reason != "abort"]
        ttft = [r.ttft_s for r in done]
        tpot = [r.tpot_s for r in done if r.output_tokens > 1]
        out_tokens = sum(r.output_tokens for r in self.records)
        return {
            "target": self.target,
            "completed": len(done),
            "aborted": self.aborted,
            "duration_s": self.duration_s,
            "request_throughput": len(done) / self.duration_s if self.duration_s else 0.0,
            "output_tok_s": out_tokens / self.duration_s if self.duration_s else 0.0,
            "ttft_p50_s": _pct(ttft, 50),
            "ttft_p99_s": _pct(ttft, 99),
            "tpot_p50_s": _pct(tpot, 50),
            "tpot_p99_s": _pct(tpot, 99),
            "prefix_hit_rate": self.prefix_hit_rate,
            "prompt_step_s": self.prompt_step_s,
        }

    def to_json(self) -> dict:
        return {"summary": self.summary(), "workload": asdict(self.workload), "requests": [asdict(r) for r in self.records]}

    def table(self) -> str:
        s, w = self.summary(), self.workload
        prefix = f" + {w.shared_prefix_len} shared" if w.shared_prefix_len else ""
        hit = "-" if s["prefix_hit_rate"] is None else f"{s['prefix_hit_rate']:.1%}"
        rows = [
            ("target", s["target"]),
            ("workload", f"{w.num_requests} requests, {w.concurrency} at a time, {w.prompt_len}{prefix} prompt "
                         f"tokens, {w.output_len} output tokens"),  # fmt: skip
            ("completed", f"{s['completed']} ({s['aborted']} aborted) in {s['duration_s']:.2f} s"),
            ("request throughput", f"{s['request_throughput']:.2f} req/s"),
            ("output throughput", f"{s['output_tok_s']:.1f} tok/s"),
            ("TTFT p50 / p99", f"{_ms(s['ttft_p50_s'])} / {_ms(s['ttft_p99_s'])}"),
            ("TPOT p50 / p99", f"{_ms(s['tpot_p50_s'])} / {_ms(s['tpot_p99_s'])}"),
            ("prefix-cache hit rate", hit),
        ]
        if s["prompt_step_s"] is not None and s["duration_s"]:
            share = s["prompt_step_s"] / s["duration_s"]
            rows.append(("steps with prompt tokens", f"{s['prompt_step_s']:.2f} s ({share:.0%} of the run)"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if q < 100 else values[-1]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


# ---- in process ------------------------------------------------------------------------------------


def run_in_process(engine, workload: Workload) -> BenchResult:
    """Drive an LLMEngine directly: keep `concurrency` requests in it until `num_requests` have run."""
    from kvlab.sampling import SamplingParams

    params = SamplingParams(max_tokens=workload.output_len, temperature=0.0, ignore_eos=True)
    pending = workload.prompts(engine.loaded.config.vocab_size)
    stats = engine.kv.stats
    queries, hits = stats.queries, stats.hits
    prompt_s = engine.stats.prompt_step_seconds
    records, in_flight, aborted = [], set(), 0
    start = time.perf_counter()
    deadline = start + workload.max_duration_s
    while pending or in_flight:
        while pending and len(in_flight) < workload.concurrency and time.perf_counter() < deadline:
            in_flight.add(engine.add_request(pending.pop(0), params))
        if time.perf_counter() >= deadline:
            pending.clear()
            for rid in list(in_flight):
                aborted += 1
                records.append(_record(engine.abort_request(rid).output))
            in_flight.clear()
            break
        for out in engine.step():
            if out.finished:
                in_flight.discard(out.request_id)
                records.append(_record(out.output))
    duration = time.perf_counter() - start
    dq, dh = stats.queries - queries, stats.hits - hits
    return BenchResult("in-process engine", workload, duration, records, dh / dq if dq else 0.0, aborted,
                       engine.stats.prompt_step_seconds - prompt_s)  # fmt: skip


def _record(output) -> RequestRecord:
    m = output.metrics
    return RequestRecord(m.ttft_s, m.tpot_s, m.ttft_s + m.decode_s, m.generated_tokens, m.cached_prompt_tokens,
                         output.finish_reason)  # fmt: skip


# ---- against a server ------------------------------------------------------------------------------


def run_http(url: str, workload: Workload, model: str | None = None, api_key: str | None = None) -> BenchResult:
    import asyncio

    return asyncio.run(_run_http(url.rstrip("/"), workload, model, api_key))


async def _run_http(url: str, workload: Workload, model: str | None, api_key: str | None) -> BenchResult:
    import asyncio

    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(None, connect=10)) as client:
        cards = (await client.get("/v1/models")).raise_for_status().json()["data"]
        model = model or cards[0]["id"]
        prompts = workload.prompts(await _vocab_size(client))
        before = _prefix_counters((await client.get("/metrics")).text)
        semaphore = asyncio.Semaphore(workload.concurrency)
        start = time.perf_counter()
        deadline = start + workload.max_duration_s

        async def one(prompt):
            async with semaphore:
                if time.perf_counter() >= deadline:
                    return None
                try:
                    return await asyncio.wait_for(_stream_one(client, model, prompt, workload), deadline - time.perf_counter())
                except asyncio.TimeoutError:
                    return RequestRecord(0.0, 0.0, 0.0, 0, finish_reason="abort")

        results = await asyncio.gather(*(one(p) for p in prompts))
        duration = time.perf_counter() - start
        after = _prefix_counters((await client.get("/metrics")).text)
    records = [r for r in results if r is not None]
    dq, dh = after[0] - before[0], after[1] - before[1]
    aborted = sum(r.finish_reason == "abort" for r in records)
    return BenchResult(url, workload, duration, records, dh / dq if dq else 0.0, aborted)


async def _vocab_size(client) -> int:
    """Token ids the served model knows (the server checks them): its vocabulary, from a kvlab server's
    /api/ps; 32,000 from another server (every real model's vocabulary is larger)."""
    import httpx

    try:
        response = await client.get("/api/ps")
        return int(response.raise_for_status().json()["models"][0]["kvlab"]["vocab_size"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return 32000


async def _stream_one(client, model: str, prompt: list[int], workload: Workload) -> RequestRecord:
    body = {"model": model, "prompt": prompt, "max_tokens": workload.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    sent = time.perf_counter()
    first = None
    tokens, cached, reason = 0, None, None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                choice = event["choices"][0]
                if first is None and (choice.get("text") or choice.get("finish_reason")):
                    first = time.perf_counter()
                reason = choice.get("finish_reason") or reason
            if event.get("kvlab"):
                cached = event["kvlab"].get("cached_prompt_tokens")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    tpot = (end - first) / (tokens - 1) if tokens > 1 else 0.0
    return RequestRecord(first - sent, tpot, end - sent, tokens, cached, reason)


def _prefix_counters(metrics_text: str) -> tuple[float, float]:
    values = {}
    for line in metrics_text.splitlines():
        for name in ("kvlab_prefix_cache_queries_total", "kvlab_prefix_cache_hits_total"):
            if line.startswith(name + "{") or line.startswith(name + " "):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values.get("kvlab_prefix_cache_queries_total", 0.0), values.get("kvlab_prefix_cache_hits_total", 0.0)
