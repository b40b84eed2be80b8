"""`kvlab bench serve`: load a running server (--url) or an in-process engine (--model) and report."""

from __future__ import annotations

import json
import sys

from kvlab.deps import require
from kvlab.errors import KvlabError


def register(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="benchmarks: `kvlab bench serve` loads a server with concurrent requests",
        description="Benchmarks of the serving engine. `kvlab bench serve --help` for the one there is.",
    )  # fmt: skip
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    p = sub.add_parser(
        "serve", help="N concurrent requests against a server URL or an in-process engine",
        description="Send --num-requests requests of random tokens, --concurrency at a time, to a running server "
                    "(--url) or to an engine in this process (--model); report the throughput, TTFT and TPOT "
                    "(p50, p99) and the prefix-cache hit rate.",
    )  # fmt: skip
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running kvlab (or any OpenAI-compatible) server, e.g. http://127.0.0.1:8000")
    target.add_argument("--model", help="run an engine in this process on this model instead")
    p.add_argument("--served-model-name", help="model name to send to the server (default: its first model)")
    p.add_argument("--api-key", help="Bearer key for the server (default: $KVLAB_API_KEY)")
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=16, help="requests to send in all")
    w.add_argument("--concurrency", type=int, default=16, help="requests in flight at once")
    w.add_argument("--prompt-len", type=int, default=64, help="tokens of each prompt after the shared prefix")
    w.add_argument("--output-len", type=int, default=64, help="tokens generated per request (EOS ignored)")
    w.add_argument("--shared-prefix-len", type=int, default=0, help="tokens every prompt starts with")
    w.add_argument("--seed", type=int, default=0, help="seed of the prompts' random tokens")
    w.add_argument("--max-duration", type=float, default=600.0, help="seconds; requests still running then are aborted")
    p.add_argument("--json", help="also write the results as JSON to this file ('-' for standard output)")
    from kvlab.engine_cli import add_model_args

    add_model_args(p)
    p.set_defaults(func=cmd_bench_serve)
    bench.set_defaults(func=lambda args: bench.print_help() or 2)


def cmd_bench_serve(args) -> int:
    import os

    from kvlab.bench.serve import Workload, run_http, run_in_process

    for flag in ("num_requests", "concurrency", "prompt_len", "output_len"):
        if getattr(args, flag) < 1:
            raise KvlabError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.shared_prefix_len < 0 or args.max_duration <= 0:
        raise KvlabError("--shared-prefix-len must be >= 0 and --max-duration > 0")
    workload = Workload(args.num_requests, args.concurrency, args.prompt_len, args.output_len,
                        args.shared_prefix_len, args.seed, args.max_duration)  # fmt: skip
    if args.url:
        require("httpx", "kvlab bench serve --url")  # before any work, as on every command
        import httpx

        try:
            result = run_http(args.url, workload, args.served_model_name, args.api_key or os.environ.get("KVLAB_API_KEY"))
        except OSError as e:
            raise KvlabError(f"cannot reach {args.url}: {e}") from None
        except httpx.HTTPStatusError as e:  # the server refused a request: say what it said, in one line
            detail = " ".join(e.response.text.split())[:200]
            raise KvlabError(f"{args.url} answered {e.response.status_code} to {e.request.url.path}: {detail}") from None
    else:
        from kvlab.engine_cli import open_llm

        llm = open_llm(args)
        result = run_in_process(llm.engine, workload)
    print(result.table(), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        text = json.dumps(result.to_json(), indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0
