"""`kvlab serve MODEL`: the OpenAI-compatible server, after printing its memory plan.

Before loading anything it prints what it plans to hold (weights, the KV pool in blocks and tokens,
how many full-context sequences fit); once loaded, the measured figures beside the plan.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvlab.errors import KvlabError


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible server: continuous batching, paged KV, prefix cache")
    p.add_argument("model", help="registry name (see `kvlab list`), .gguf file, or Hugging Face directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: $KVLAB_API_KEY)")
    p.add_argument("--served-model-name", help="the model name clients send (default: MODEL as given)")
    p.add_argument("--max-body-bytes", type=int, default=None, help="largest request body accepted (default 4 MiB)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    from kvlab.generate_cli import _add_model_args

    _add_model_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from kvlab.generate_cli import check_model_args, engine_options
    from kvlab.server.app import DEFAULT_MAX_BODY_BYTES, ServerConfig

    if not 0 < args.port < 65536:
        raise KvlabError(f"--port must be in 1..65535, got {args.port}")
    if args.no_cache:
        raise KvlabError("kvlab serve always keeps a KV cache: drop --no-cache")
    check_model_args(args)
    _check_web_stack()
    options = engine_options(args)
    plan, planned_weights = print_plan(args, options)
    options["kv_memory_bytes"] = plan.nbytes  # allocate exactly what was planned
    server = ServerConfig(
        model_name=args.served_model_name or str(args.model),
        api_key=args.api_key or os.environ.get("KVLAB_API_KEY") or None,
        max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
    )
    from kvlab.generate_cli import open_llm

    llm = open_llm(args, **options)
    print_measured(llm, plan, planned_weights)
    return run_server(llm, server, args.host, args.port, args.log_level)


SHUTDOWN_GRACE_S = 10.0  # after Ctrl-C, running requests get this long to finish before they are aborted


def run_server(llm, config, host: str, port: int, log_level: str = "warning") -> int:
    import uvicorn

    from kvlab.server.app import create_app
    from kvlab.server.async_engine import AsyncEngine

    engine = AsyncEngine(llm.engine)
    app = create_app(llm, engine, config)
    auth = "Bearer key required on /v1" if config.api_key else "no API key"
    print(f"serving '{config.model_name}' on http://{host}:{port}  (OpenAI API under /v1; /metrics, /health; "
          f"{auth}). Ctrl-C stops.", file=sys.stderr, flush=True)  # fmt: skip
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                               timeout_graceful_shutdown=SHUTDOWN_GRACE_S + 5)  # fmt: skip
    graceful_server(uv_config, engine).run()
    print("kvlab serve: stopped", file=sys.stderr)
    return 0


def graceful_server(config, engine):
    """uvicorn's server, with Ctrl-C in three stages: stop accepting and let running requests finish
    (up to SHUTDOWN_GRACE_S), then abort them (their streams end with finish_reason "abort" and
    `data: [DONE]`); a second Ctrl-C aborts at once, a third exits without waiting."""
    import threading

    import uvicorn

    class Server(uvicorn.Server):
        signals = 0

        def handle_exit(self, sig, frame):
            self.signals += 1
            if self.signals == 1:
                n = engine.num_in_flight()
                if n:
                    print(f"\nkvlab serve: finishing {n} running request(s) (up to {SHUTDOWN_GRACE_S:.0f} s; "
                          f"Ctrl-C again aborts them)", file=sys.stderr, flush=True)  # fmt: skip
                timer = threading.Timer(SHUTDOWN_GRACE_S, engine.abort_all)
                timer.daemon = True
                timer.start()
                return super().handle_exit(sig, frame)
            if self.signals == 2:
                print("kvlab serve: aborting running requests", file=sys.stderr, flush=True)
                engine.abort_all()
                return None
            return super().handle_exit(sig, frame)

    return Server(config)


def _check_web_stack() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise KvlabError("kvlab serve needs fastapi and uvicorn: pip install 'kvlab[serve]'") from None


# ---- the memory plan --------------------------------------------------------------------------------


def read_config(model: str):
    """The model's config without loading weights (GGUF header or config.json), and its path."""
    from kvlab.config import load_config
    from kvlab.model.loader import resolve_source
    from kvlab.model.registry import architecture_of

    path = resolve_source(model)
    config = load_config(path)
    architecture_of(config)  # refuse what the engine cannot run before planning memory for it
    return config, path


def print_plan(args, options: dict, file=None):
    """Print the plan before loading (to stderr); return the KV pool plan and the weight bytes expected."""
    import torch

    from kvlab.config import EngineConfig
    from kvlab.kv.pool_plan import plan_kv_pool
    from kvlab.memory import weight_bytes
    from kvlab.model.loader import parse_dtype

    file = file or sys.stderr
    config, _ = read_config(str(args.model))
    dtype = parse_dtype(args.dtype)
    plan = plan_kv_pool(EngineConfig(max_model_len=args.max_model_len, **options), config, dtype,
                        torch.device(args.device))  # the engine plans with the same call once loaded
    max_len = plan.max_model_len
    try:
        weights = weight_bytes(config, fmt=args.dtype).bytes
    except KvlabError:
        weights = None
    print(f"kvlab serve {args.model}: memory plan ({args.dtype} on {args.device})", file=file)
    print(f"  weights            {_gb(weights):>12}", file=file)
    print(f"  KV pool            {_gb(plan.nbytes):>12}   {plan.num_blocks:,} blocks × {plan.block_size} tokens = "
          f"{plan.num_tokens:,} tokens, {plan.bytes_per_token:,} B per token ({plan.source})", file=file)  # fmt: skip
    print(f"  max concurrency    {plan.max_concurrency(max_len):12.1f}   sequences at the full {max_len:,}-token context "
          f"(more when shorter; a shared prefix is stored once)", file=file, flush=True)  # fmt: skip
    return plan, weights


def print_measured(llm, plan, planned_weights: int | None, file=None) -> None:
    from kvlab.stats import peak_memory_bytes

    file = file or sys.stderr
    engine, loaded = llm.engine, llm.loaded
    print(f"loaded in {loaded.load_s:.1f} s: planned → measured", file=file)
    print(f"  weights            {_gb(planned_weights):>12} → "
          f"{_gb(loaded.weight_bytes)}", file=file)  # fmt: skip
    print(f"  KV pool            {_gb(plan.nbytes):>12} → {_gb(engine.cache.nbytes())}   "
          f"{engine.kv.num_blocks:,} blocks, {engine.kv.num_tokens_capacity:,} tokens", file=file)  # fmt: skip
    print(f"  max concurrency    {plan.max_concurrency(engine.max_model_len):12.1f} → "
          f"{engine.kv.num_tokens_capacity / engine.max_model_len:.1f} at {engine.max_model_len:,} tokens", file=file)
    print(f"  process peak RSS   {'':>12}   {_gb(peak_memory_bytes(engine.cache.device))} "
          f"(KV pages are touched only as blocks fill)", file=file, flush=True)  # fmt: skip


def _gb(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
