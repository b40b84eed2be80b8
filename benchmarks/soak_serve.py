"""Soak: `kvlab serve` at 16× overload, with clients that hang up at random (not a test; minutes).

    .venv/bin/python benchmarks/soak_serve.py --model smollm2-135m --requests 256 --max-num-seqs 16

One server process (`kvlab serve`, its defaults but for --max-num-seqs) gets --requests requests
from as many concurrent clients (256 against 16 running sequences: 16× overload), all arriving
within --ramp seconds: random prompts and lengths, half of them streamed, and --disconnect-rate of
them dropped by their client at a random moment; `--waves N` sends that N times, one wave after the
other (RSS after each: the KV pool's pages become resident as its blocks are first used, so RSS
grows towards "up to ... once the KV pool fills" of the start-up report, then stays). Every request
must end one of three ways:

    completed     200 and a whole answer (a finish reason from OpenAI's set; a stream ends in [DONE])
    refused       a clean refusal in OpenAI's error shape (429 at --max-concurrent-requests, 4xx)
    disconnected  the client hung up on purpose (the server must abort it and free its blocks)

Anything else — a 5xx, a malformed answer, a stream cut short, no answer by --deadline — is
**lost**; the run fails if any request is lost, or if the server does not come back to idle (no
request running or waiting, no KV block held, by its own /metrics). RSS of the server process is
read from /proc after a warm-up, after each wave, and its peak (VmHWM).

`--abuse` runs issue 29's experiment instead (`abuse_soak.py`): ordinary clients alone, then beside
abusive ones — slow uploaders, a giant multi-prompt client, grammar bombs — reporting the ordinary
clients' TTFT p50/p99 in each, their 429s and losses, and RSS after each wave.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import time
from pathlib import Path

import httpx
from soak_lib import OPENAI_FINISH, WORDS, Tally, _check_stream, _refusal, metric, rss, start_server, wait_idle  # noqa: E402

async def one_request(client: httpx.AsyncClient, rng: random.Random, args, tally: Tally) -> None:
    await asyncio.sleep(rng.uniform(0, args.ramp))
    stream = rng.random() < 0.5
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 64)))
    body = {"model": args.model, "prompt": prompt, "max_tokens": rng.randint(8, args.max_output), "temperature": 0.8,
            "seed": rng.randrange(2**32), "stream": stream}  # fmt: skip
    hang_up = rng.uniform(0.0, args.hang_up_within) if rng.random() < args.disconnect_rate else None
    task = asyncio.ensure_future(_send(client, body, tally))
    try:
        await asyncio.wait_for(asyncio.shield(task), hang_up) if hang_up is not None else await task
    except asyncio.TimeoutError:  # our client hangs up: the connection closes mid-request
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        tally.add("disconnected")


async def _send(client: httpx.AsyncClient, body: dict, tally: Tally) -> None:
    try:
        if body["stream"]:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return _refusal(r, tally)
                lines = [line async for line in r.aiter_lines() if line]
            return _check_stream(lines, tally)
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return _refusal(r, tally)
        reason = r.json()["choices"][0]["finish_reason"]
        tally.add("completed" if reason in OPENAI_FINISH else "lost", f"finish_reason {reason!r}")
    except (httpx.HTTPError, ValueError, KeyError) as e:
        tally.add("lost", f"{type(e).__name__}: {e}")


async def soak(args, url: str, tally: Tally, wave: int) -> tuple[float, bool, str]:
    rng = random.Random(args.seed * 1000 + wave)
    limits = httpx.Limits(max_connections=args.requests + 8, max_keepalive_connections=args.requests + 8)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.deadline, connect=30), limits=limits) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(one_request(client, random.Random(rng.random()), args, tally))
                 for _ in range(args.requests)]  # fmt: skip
        done, pending = await asyncio.wait(tasks, timeout=args.deadline)
        for task in pending:  # past the deadline: lost
            task.cancel()
            tally.add("lost", "no answer by the deadline")
        wall = time.perf_counter() - t0
        idle, text = await wait_idle(client, 30)
    return wall, idle, text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=256, help="requests in a wave, all concurrent")
    p.add_argument("--waves", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-concurrent-requests", type=int, default=128, help="the server's admission limit (its default)")
    p.add_argument("--max-output", type=int, default=48, help="max_tokens is drawn from 8..this")
    p.add_argument("--disconnect-rate", type=float, default=0.25)
    p.add_argument("--hang-up-within", type=float, default=20.0, help="a disconnecting client hangs up within this (s)")
    p.add_argument("--ramp", type=float, default=2.0, help="requests arrive within this many seconds")
    p.add_argument("--deadline", type=float, default=600.0, help="seconds before an unanswered request counts as lost")
    p.add_argument("--kv-memory", default="512MiB")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--abuse", action="store_true", help="issue 29's experiment: ordinary clients beside abusive ones")
    from abuse_soak import add_abuse_args, run_abuse  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

    add_abuse_args(p)
    args = p.parse_args()
    if args.abuse:
        return run_abuse(args)

    proc, url = start_server(args)
    try:
        warm = httpx.post(url + "/v1/completions", json={"model": args.model, "prompt": "warm up", "max_tokens": 4},
                          timeout=120)  # fmt: skip
        warm.raise_for_status()
        rss_start, tally, waves = rss(proc.pid), Tally(), []
        for wave in range(args.waves):
            wall, idle, metrics = asyncio.run(soak(args, url, tally, wave))
            waves.append({"wall_s": round(wall, 1), "idle_after": idle, "rss_mb": round(rss(proc.pid)["rss"] / 2**20)})
            if not idle:
                break
        rss_end = rss(proc.pid)
        health = httpx.get(url + "/health", timeout=30).json()
    finally:
        proc.terminate()
        code = proc.wait(60)
    finished = {r: metric(metrics, "kvlab_requests_finished_total", f'finish_reason="{r}"') for r in ("stop", "length", "abort")}
    figures = {
        "command": " ".join(sys.argv), "machine": f"{platform.machine()}, {platform.processor() or '?'}",
        "requests": args.requests * args.waves, "max_num_seqs": args.max_num_seqs,
        "overload": args.requests / args.max_num_seqs, **tally.outcomes, "refused_by_status": tally.refusals,
        "lost_why": tally.lost[:10], "waves": waves, "server_idle_after": idle, "health_after": health,
        "server_finished": finished, "server_exit_code": code,
        "rss_start_mb": round(rss_start["rss"] / 2**20), "rss_end_mb": round(rss_end["rss"] / 2**20),
        "rss_peak_mb": round(rss_end["peak"] / 2**20),
    }  # fmt: skip
    print(json.dumps(figures, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    ok = tally.outcomes["lost"] == 0 and idle and health == {"status": "ok"} and code == 0
    print("soak:", "PASS" if ok else "FAIL", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
