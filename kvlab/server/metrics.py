"""GET /metrics: the engine's state and history in Prometheus' text format (version 0.0.4).

Gauges are read live (requests running and waiting, KV blocks); counters and histograms come from
`kvlab.stats.EngineStats` — TTFT, time per output token, queue time, latency, and each engine
step's time split into schedule / prepare inputs / forward / sample / detokenize; with speculative
decoding, vLLM's spec_decode counters (drafts, draft tokens, accepted tokens, accepted per position).
"""

from __future__ import annotations

from kvlab.engine import LLMEngine
from kvlab.stats import Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Writer:
    def __init__(self, model: str):
        self.lines: list[str] = []
        self.base = f'model_name="{_escape(model)}"'

    def _labels(self, extra: str = "") -> str:
        return "{" + ",".join(x for x in (self.base, extra) if x) + "}"

    def metric(self, name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
        self.lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
        self.lines += [f"{name}{self._labels(labels)} {_num(value)}" for labels, value in samples]

    def histogram(self, name: str, help: str, series: list[tuple[str, Histogram]]) -> None:
        self.lines += [f"# HELP {name} {help}", f"# TYPE {name} histogram"]
        for labels, h in series:
            for le, count in h.cumulative():
                bucket = ",".join(x for x in (labels, 'le="%s"' % le) if x)
                self.lines.append(f"{name}_bucket{self._labels(bucket)} {count}")
            self.lines.append(f"{name}_sum{self._labels(labels)} {_num(h.sum)}")
            self.lines.append(f"{name}_count{self._labels(labels)} {h.count}")


def render(engine: LLMEngine, model: str, routes: RouteCounts | None = None) -> str:
    w = _Writer(model)
    stats, pool, prefix = engine.stats, engine.kv.pool, engine.kv.stats
    counts = pool.counts()
    w.metric("kvlab_requests_running", "gauge", "Requests in the running batch.", [("", engine.num_running)])
    w.metric("kvlab_requests_waiting", "gauge", "Requests waiting to be admitted.", [("", engine.num_waiting)])
    w.metric("kvlab_kv_blocks_total", "gauge", "Blocks in the KV pool.", [("", counts.total)])
    w.metric("kvlab_kv_blocks_used", "gauge", "KV blocks held by requests.", [("", counts.used)])
    w.metric("kvlab_kv_blocks_cached", "gauge", "Unheld KV blocks kept for the prefix cache.", [("", counts.cached)])
    w.metric("kvlab_kv_block_size_tokens", "gauge", "Tokens per KV block.", [("", engine.kv.block_size)])
    w.metric("kvlab_kv_cache_usage_ratio", "gauge", "Share of KV blocks held.", [("", counts.used / counts.total)])
    w.metric("kvlab_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", [("", prefix.queries)])
    w.metric("kvlab_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", [("", prefix.hits)])
    w.metric("kvlab_prefix_cache_hit_rate", "gauge", "Prefix-cache hits / queries, in tokens.", [("", prefix.hit_rate)])
    w.metric("kvlab_prefix_cache_evictions_total", "counter", "Cached blocks reused for new tokens.", [("", pool.num_evictions)])
    w.metric("kvlab_preemptions_total", "counter", "Requests preempted (to be recomputed).", [("", engine.scheduler.num_preemptions)])
    if engine.prompt_cache is not None:  # the prefix cache's disk tier (--prompt-cache-dir, kv/prompt_cache.py)
        _prompt_cache(w, engine.prompt_cache)
    if engine.spec is not None:  # vLLM's speculative-decoding counters (vllm/v1/spec_decode/metrics.py)
        s = engine.spec.stats
        w.metric("kvlab_spec_decode_num_drafts_total", "counter", "Speculative rounds: steps in which a request's drafts were verified.",
                 [("", s.num_drafts)])  # fmt: skip
        w.metric("kvlab_spec_decode_num_draft_tokens_total", "counter", "Tokens drafted.", [("", s.num_draft_tokens)])
        w.metric("kvlab_spec_decode_num_accepted_tokens_total", "counter", "Drafted tokens the target accepted.",
                 [("", s.num_accepted_tokens)])  # fmt: skip
        w.metric("kvlab_spec_decode_num_accepted_tokens_per_pos_total", "counter",
                 "Drafted tokens accepted at each position of a round (0: the first draft).",
                 [(f'position="{i}"', n) for i, n in enumerate(s.num_accepted_tokens_per_pos)] or [('position="0"', 0)])  # fmt: skip
    with stats.lock:
        w.metric("kvlab_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [("", stats.prompt_tokens)])
        w.metric("kvlab_generation_tokens_total", "counter", "Tokens generated.", [("", stats.generation_tokens)])
        w.metric("kvlab_requests_finished_total", "counter", "Finished requests by reason.",
                 [(f'finish_reason="{r}"', n) for r, n in sorted(stats.finished.items())] or [('finish_reason="stop"', 0)])  # fmt: skip
        w.metric("kvlab_engine_steps_total", "counter", "Engine steps run.", [("", stats.steps)])
        w.metric("kvlab_engine_step_tokens_total", "counter", "Tokens through the model, all steps.", [("", stats.step_tokens)])
        w.metric("kvlab_engine_prompt_step_seconds_total", "counter", "Time of the steps that computed prompt tokens.",
                 [("", stats.prompt_step_seconds)])  # fmt: skip
        w.metric("kvlab_step_phase_seconds_total", "counter", "Engine step time by phase.",
                 [(f'phase="{p}"', s) for p, s in stats.phase_seconds.items()])  # fmt: skip
        w.histogram("kvlab_step_phase_seconds", "Time of each engine step's phases.",
                    [(f'phase="{p}"', h) for p, h in stats.phase_hist.items()])  # fmt: skip
        w.histogram("kvlab_step_seconds", "Time of each engine step.", [("", stats.step_hist)])
        w.histogram("kvlab_time_to_first_token_seconds", "Arrival to first token.", [("", stats.ttft)])
        w.histogram("kvlab_time_per_output_token_seconds", "Decode time per token after the first.", [("", stats.tpot)])
        w.histogram("kvlab_request_queue_seconds", "Arrival to first scheduled.", [("", stats.queue)])
        w.histogram("kvlab_e2e_request_latency_seconds", "Arrival to last token.", [("", stats.e2e)])
    if routes is not None:  # every API's routes: OpenAI's, Ollama's, Anthropic's, the Responses API
        w.metric("kvlab_http_requests_total", "counter", "HTTP requests answered, by route and status.",
                 [(f'route="{_escape(r)}",status="{s}"', n) for (r, s), n in sorted(routes.snapshot().items())]
                 or [('route="/health",status="200"', 0)])  # fmt: skip
    return "\n".join(w.lines) + "\n"


def _prompt_cache(w: _Writer, tier) -> None:
    d, store = tier.stats, tier.store
    w.metric("kvlab_prompt_cache_disk_hits_total", "counter", "KV blocks read back from the prompt cache's directory.", [("", d.hits)])
    w.metric("kvlab_prompt_cache_disk_misses_total", "counter", "Block lookups past the memory hit that found no file there.", [("", d.misses)])
    w.metric("kvlab_prompt_cache_disk_bad_files_total", "counter", "Block files refused (torn, corrupt, foreign) and removed.", [("", d.bad_files)])
    w.metric("kvlab_prompt_cache_disk_read_bytes_total", "counter", "Bytes of block files read.", [("", d.bytes_read)])
    w.metric("kvlab_prompt_cache_disk_written_bytes_total", "counter", "Bytes of block files written.", [("", d.bytes_written)])
    w.metric("kvlab_prompt_cache_disk_evictions_total", "counter", "Block files removed to keep the size bound (LRU).", [("", d.evictions)])
    w.metric("kvlab_prompt_cache_disk_dropped_writes_total", "counter", "Blocks not written: the writer was behind, or writes are off.",
             [("", d.dropped_writes)])  # fmt: skip
    w.metric("kvlab_prompt_cache_disk_tokens_total", "counter", "Prompt tokens of finished requests served from disk.", [("", d.tokens_served)])
    w.metric("kvlab_prompt_cache_disk_bytes", "gauge", "Bytes of block files in the directory.", [("", store.total_bytes)])
    w.metric("kvlab_prompt_cache_disk_max_bytes", "gauge", "The directory's size bound (--prompt-cache-size).", [("", store.max_bytes)])
    w.metric("kvlab_prompt_cache_disk_writable", "gauge", "1 while blocks are written (0: the disk was full or read-only).",
             [("", int(store.writable))])  # fmt: skip


def _num(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class RouteCounts:
    """Requests answered, by route (the route's path template: /v1/responses/{response_id}) and status. Counted
    by an ASGI middleware once the response starts; paths that match no route count as "unmatched"."""

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self._counts: dict[tuple[str, int], int] = {}

    def add(self, route: str, status: int) -> None:
        with self._lock:
            self._counts[(route, status)] = self._counts.get((route, status), 0) + 1

    def snapshot(self) -> dict[tuple[str, int], int]:
        with self._lock:
            return dict(self._counts)

    class Middleware:
        def __init__(self, app, counts: RouteCounts):
            self.app, self.counts = app, counts

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.app(scope, receive, send)

            async def counted(message):
                if message["type"] == "http.response.start":
                    route = scope.get("route")  # set by the router on this scope once it matched
                    self.counts.add(getattr(route, "path", None) or "unmatched", message["status"])
                await send(message)

            return await self.app(scope, receive, counted)
