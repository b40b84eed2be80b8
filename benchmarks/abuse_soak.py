"""Issue 29's soak: ordinary clients alone, then beside abusive ones (run through soak_serve.py --abuse).

    .venv/bin/python benchmarks/soak_serve.py --abuse --model smollm2-135m --max-num-seqs 16

One `kvlab serve`; --ordinary-clients clients each send --ordinary-requests streamed completions one
after the other (random prompts of 8-32 words, --ordinary-max-tokens, greedy). Wave 0 runs them alone
(the baseline); every later wave runs them beside:

    slow uploaders  --slow-uploaders sockets, each sending headers with Content-Length: 100000 and a
                    few bytes, then nothing, until the server answers 408 and closes; then again
    giant           one client sending completions of --giant-prompts prompts each, one after the other
    grammar bombs   one client sending response_format schemas no grammar engine can compile
                    (pattern ^(a{1000}){1000}$, $refs that point at each other), one after the other

The abusers stop when the ordinary clients are done. Reported per wave: the ordinary clients' TTFT
(send → first token) p50/p99, their outcomes (completed, refused by status and code, lost), the
abusers' outcomes, wall time and the server's RSS after it. The run fails if an ordinary request is
lost, an ordinary client gets a 429 while the abusers run, the abused TTFT p99 is over 5× the
baseline's, or the server is not idle after a wave.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time

import httpx

from soak_lib import WORDS, Tally, _check_stream, _refusal, rss, start_server, wait_idle

BOMBS = (
    {"type": "json_schema", "json_schema": {"name": "bomb", "schema": {"type": "string", "pattern": "^(a{1000}){1000}$"}}},
    {"type": "json_schema", "json_schema": {"name": "loop", "schema": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}},
)  # fmt: skip


def add_abuse_args(p) -> None:
    g = p.add_argument_group("--abuse")
    g.add_argument("--ordinary-clients", type=int, default=16)
    g.add_argument("--ordinary-requests", type=int, default=6, help="requests each ordinary client sends in a wave")
    g.add_argument("--ordinary-max-tokens", type=int, default=16)
    g.add_argument("--slow-uploaders", type=int, default=16)
    g.add_argument("--giant-prompts", type=int, default=64)
    g.add_argument("--giant-max-tokens", type=int, default=32)
    g.add_argument("--abuse-waves", type=int, default=2, help="waves with the abusers, after the baseline wave")
    g.add_argument("--body-timeout", type=float, default=None, help="the server's --body-timeout (default: its own)")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


async def ordinary_client(client: httpx.AsyncClient, args, rng: random.Random, tally: Tally, ttfts: list) -> None:
    for _ in range(args.ordinary_requests):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 32)))
        body = {"model": args.model, "prompt": prompt, "max_tokens": args.ordinary_max_tokens, "temperature": 0,
                "stream": True}  # fmt: skip
        t0, first, lines = time.perf_counter(), None, []
        try:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    _refusal(r, tally)
                    continue
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter() - t0
                    if line:
                        lines.append(line)
        except httpx.HTTPError as e:
            tally.add("lost", f"{type(e).__name__}: {e}")
            continue
        _check_stream(lines, tally)
        if first is not None:
            ttfts.append(first)


async def slow_uploader(port: int, done: asyncio.Event, tally: Tally) -> None:
    """Headers with Content-Length: 100000 and a few bytes, then nothing, until the server answers; again."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n{\"model\": \"x")  # fmt: skip
    while not done.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head)
            await writer.drain()
            answer = await _read_or_done(reader, done)
            writer.close()
        except OSError as e:
            tally.add("lost", f"uploader: {e}")
            await asyncio.sleep(1)
            continue
        if answer is not None:
            status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1") else "closed"
            tally.add("refused", f"{status} (upload)")


async def _read_or_done(reader: asyncio.StreamReader, done: asyncio.Event) -> bytes | None:
    """The server's whole answer (until it closes), or None when the ordinary clients finished first."""
    read = asyncio.ensure_future(reader.read())
    stop = asyncio.ensure_future(done.wait())
    await asyncio.wait({read, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if read.done():
        return read.result()
    read.cancel()
    return None


async def giant(client: httpx.AsyncClient, args, done: asyncio.Event, tally: Tally) -> None:
    rng = random.Random(args.seed + 7)
    while not done.is_set():
        prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 48))) for _ in range(args.giant_prompts)]
        body = {"model": args.model, "prompt": prompts, "max_tokens": args.giant_max_tokens, "temperature": 0.8,
                "ignore_eos": True}  # fmt: skip
        try:
            r = await client.post("/v1/completions", json=body)
        except httpx.HTTPError as e:
            tally.add("lost", f"{type(e).__name__}: {e}")
            continue
        if r.status_code != 200:
            _refusal(r, tally)
            await asyncio.sleep(0.5)
        else:
            ok = len(r.json()["choices"]) == args.giant_prompts
            tally.add("completed" if ok else "lost", "giant: wrong number of choices")


async def grammar_bombs(client: httpx.AsyncClient, args, done: asyncio.Event, tally: Tally) -> None:
    for i in range(10_000):
        if done.is_set():
            return
        body = {"model": args.model, "prompt": "Answer:", "max_tokens": 8, "response_format": BOMBS[i % len(BOMBS)]}
        try:
            r = await client.post("/v1/completions", json=body)
        except httpx.HTTPError as e:
            tally.add("lost", f"{type(e).__name__}: {e}")
            continue
        if r.status_code == 200:  # an answer must parse as its schema asked; the bombs' cannot (issue 29 item 3)
            tally.add("lost", f"bomb answered 200: {r.text[:120]}")
        else:
            _refusal(r, tally)
        await asyncio.sleep(0.2)


async def wave(args, url: str, abused: bool) -> dict:
    port = int(url.rsplit(":", 1)[1])
    ordinary, abusers, ttfts = Tally(), Tally(), []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.deadline, connect=30), limits=limits) as c:
        done = asyncio.Event()
        side = []
        if abused:
            side = [asyncio.ensure_future(slow_uploader(port, done, abusers)) for _ in range(args.slow_uploaders)]
            side += [asyncio.ensure_future(giant(c, args, done, abusers)),
                     asyncio.ensure_future(grammar_bombs(c, args, done, abusers))]  # fmt: skip
            await asyncio.sleep(1.0)  # the abusers are in before the ordinary clients start
        t0 = time.perf_counter()
        clients = [asyncio.ensure_future(ordinary_client(c, args, random.Random(args.seed * 100 + i), ordinary, ttfts))
                   for i in range(args.ordinary_clients)]  # fmt: skip
        _, pending = await asyncio.wait(clients, timeout=args.deadline)
        wall = time.perf_counter() - t0
        for task in pending:
            task.cancel()
            ordinary.add("lost", "no answer by the deadline")
        done.set()
        _, stuck = await asyncio.wait(side, timeout=args.deadline) if side else (set(), set())
        for task in stuck:
            task.cancel()
            abusers.add("lost", "an abuser's request had no answer by the deadline")
        idle, _ = await wait_idle(c, 60)
    return {"abused": abused, "wall_s": round(wall, 1), "ordinary_requests": sum(ordinary.outcomes.values()),
            "ttft_p50_ms": _ms(percentile(ttfts, 0.5)), "ttft_p99_ms": _ms(percentile(ttfts, 0.99)),
            "ttft_mean_ms": _ms(statistics.fmean(ttfts) if ttfts else None),
            "ordinary": ordinary.outcomes, "ordinary_refused": ordinary.refusals, "ordinary_lost_why": ordinary.lost[:5],
            "abusers": abusers.outcomes, "abusers_refused": abusers.refusals, "abusers_lost_why": abusers.lost[:5],
            "idle_after": idle}  # fmt: skip


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def run_abuse(args) -> int:
    extra = ("--body-timeout", str(args.body_timeout)) if args.body_timeout else ()
    proc, url = start_server(args, *extra)
    waves = []
    try:
        warm = httpx.post(url + "/v1/completions", json={"model": args.model, "prompt": "warm up", "max_tokens": 4},
                          timeout=120)  # fmt: skip
        warm.raise_for_status()
        rss_start = rss(proc.pid)
        for i in range(1 + args.abuse_waves):
            figures = asyncio.run(wave(args, url, abused=i > 0))
            figures["rss_mb"] = round(rss(proc.pid)["rss"] / 2**20)
            waves.append(figures)
            print(json.dumps(figures), flush=True)
        health = httpx.get(url + "/health", timeout=30).json()
        peak = rss(proc.pid)["peak"]
    finally:
        proc.terminate()
        code = proc.wait(60)
    base = waves[0]["ttft_p99_ms"] or 0.0
    worst = max((w["ttft_p99_ms"] or 0.0) for w in waves[1:]) if len(waves) > 1 else base
    report = {"command": " ".join(sys.argv), "rss_start_mb": round(rss_start["rss"] / 2**20),
              "rss_peak_mb": round(peak / 2**20), "ttft_p99_ratio": round(worst / base, 2) if base else None,
              "health_after": health, "server_exit_code": code, "waves": waves}  # fmt: skip
    print(json.dumps(report, indent=2))
    if args.json:
        from pathlib import Path

        Path(args.json).write_text(json.dumps(report, indent=2))
    ok = (all(w["ordinary"]["lost"] == 0 and w["idle_after"] for w in waves) and health == {"status": "ok"}
          and not any(k.startswith("429") for w in waves[1:] for k in w["ordinary_refused"])
          and (report["ttft_p99_ratio"] or 0) <= 5 and code == 0)  # fmt: skip
    print("abuse soak:", "PASS" if ok else "FAIL", file=sys.stderr)
    return 0 if ok else 1
