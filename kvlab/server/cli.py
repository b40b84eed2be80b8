"""`kvlab serve MODEL`: the OpenAI-compatible server, after printing its memory plan.

The port is bound first — a port in use is a one-line error before anything slow. Then it prints
what it plans to hold (weights, the KV pool in blocks and tokens, how many full-context sequences
fit); once loaded, the measured figures beside the plan; then it serves until SIGINT or SIGTERM.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import signal
import socket
import sys
import time

from kvlab.errors import KvlabError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible server: continuous batching, paged KV, prefix cache",
        description="Serve MODEL over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, /v1/responses, "
                    "/v1/models), Ollama's (/api/chat, /api/generate, /api/tags, /api/show, /api/ps), Anthropic's "
                    "(/v1/messages) and Prometheus /metrics, and a chat page at /. The port is bound first; then "
                    "it prints its memory plan (weights, the KV pool in blocks and tokens), loads the model, and "
                    "serves until Ctrl-C or SIGTERM. A registry model that is not pulled yet is pulled first.",
    )  # fmt: skip
    p.add_argument("model", help="registry name (see `kvlab list`), .gguf file, or Hugging Face directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--served-model-name", help="the model name clients send (default: MODEL as given)")
    p.add_argument("--max-body-bytes", type=int, default=None, help="largest request body accepted (default 4 MiB)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level; a line per request is shown unless it is error or critical")
    g = p.add_argument_group("access")
    g.add_argument("--api-key", action="append", default=[],
                   help="require 'Authorization: Bearer KEY' on /v1 and /metrics; repeat or comma-separate for "
                        "several keys (default: $KVLAB_API_KEY)")  # fmt: skip
    g.add_argument("--public-metrics", action="store_true", help="serve /metrics without the API key (a scraper)")
    g.add_argument("--allowed-hosts", action="append", default=[],
                   help="more names the Host header may give (comma-separated; '*': any). IP addresses, "
                        "'localhost' and the --host name are always allowed")  # fmt: skip
    g.add_argument("--allowed-origins", action="append", default=[],
                   help="web origins allowed to call from a browser, with CORS headers (comma-separated; '*': any). "
                        "Default: none, a request with an Origin header is refused")  # fmt: skip
    g = p.add_argument_group("isolation and limits")
    g.add_argument("--cache-salt-by", default="api-key", choices=["none", "api-key", "user", "header"],
                   help="tenants that never share prefix-cache blocks: by API key (default), by the request's "
                        "'user' field, by the --tenant-header, or none (everyone shares)")  # fmt: skip
    g.add_argument("--tenant-header", default="X-Tenant-Id", help="the header naming the tenant (--cache-salt-by header)")
    g.add_argument("--max-concurrent-requests", type=int, default=128,
                   help="requests in flight (queued, running, streaming) before new ones get 429 (default 128)")  # fmt: skip
    g.add_argument("--max-queued-seqs", type=int, default=512,
                   help="sequences in flight (each request counts prompts × max(n, best_of)) before new requests "
                        "get 429 (default 512)")  # fmt: skip
    g.add_argument("--max-queued-tokens", type=int, default=None,
                   help="tokens in flight (each prompt's tokens + choices × max_tokens) before new requests get 429 "
                        "(default: 16 × the KV pool's tokens)")  # fmt: skip
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request's headers, else 408 and it closes (default 10)")
    g.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request's body has to arrive after its headers, else 408 and the connection "
                        "closes (default 30)")  # fmt: skip
    g.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle kept-alive connection stays open (default 5)")
    g.add_argument("--max-messages", type=int, default=1024, help="messages in one chat request (default 1024)")
    g.add_argument("--max-prompt-chars", type=int, default=None,
                   help="characters in one prompt (default: the context × the longest token, more cannot fit)")  # fmt: skip
    g = p.add_argument_group("answers")
    g.add_argument("--reasoning-parser", choices=["deepseek_r1", "qwen3"], default=None,
                   help="split a reasoning model's <think>…</think> text from its answer: reasoning_content (chat "
                        "completions), reasoning items (Responses), thinking (Ollama, Anthropic). Default: none, "
                        "the thinking stays in the text")  # fmt: skip
    from kvlab.engine_cli import add_model_args, add_parallel_args

    add_model_args(p)
    add_parallel_args(p)
    p.set_defaults(func=cmd_serve)


def cmd_serve(args) -> int:
    from kvlab.engine_cli import check_model_args, engine_options
    from kvlab.server.app import DEFAULT_MAX_BODY_BYTES, ServerConfig

    if not 0 <= args.port < 65536:
        raise KvlabError(f"--port must be in 0..65535, got {args.port}")
    if args.no_cache:
        raise KvlabError("kvlab serve always keeps a KV cache: drop --no-cache")
    for flag in ("max_concurrent_requests", "max_messages", "max_prompt_chars", "max_body_bytes", "max_queued_seqs",
                 "max_queued_tokens"):  # fmt: skip
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise KvlabError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    for flag in ("header_timeout", "body_timeout", "keep_alive_timeout"):
        if not getattr(args, flag) > 0:
            raise KvlabError(f"--{flag.replace('_', '-')} must be more than 0 seconds, got {getattr(args, flag)}")
    check_model_args(args)
    _check_web_stack()
    from kvlab.parallel.group import launch_rank

    leader = launch_rank(args.tensor_parallel_size) in (None, 0)  # tensor-parallel: rank 0 serves and prints
    config = ServerConfig(
        model_name=args.served_model_name or str(args.model),
        api_keys=_list(args.api_key or [os.environ.get("KVLAB_API_KEY") or ""]),
        max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
        host=args.host,
        allowed_hosts=_list(args.allowed_hosts),
        allowed_origins=_list(args.allowed_origins),
        public_metrics=args.public_metrics,
        cache_salt_by=args.cache_salt_by,
        tenant_header=args.tenant_header,
        max_concurrent_requests=args.max_concurrent_requests,
        max_queued_seqs=args.max_queued_seqs,
        max_queued_tokens=args.max_queued_tokens,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout,
        max_messages=args.max_messages,
        max_prompt_chars=args.max_prompt_chars,
        reasoning_parser=args.reasoning_parser,
    )
    sock = listen(args.host, args.port) if leader else None  # before loading: a port in use fails in a second
    try:
        options = engine_options(args)
        plan, planned_weights = print_plan(args, options, file=None if leader else io.StringIO())
        options["kv_memory_bytes"] = plan.nbytes  # allocate exactly what was planned
        from kvlab.engine_cli import open_llm

        llm = open_llm(args, **options)
        if leader:
            print_measured(llm, plan, planned_weights)
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    code = run_ranks(llm, config, sock, args.log_level) if llm.group.world_size > 1 else \
        run_server(llm, config, sock, args.log_level)
    # The server has stopped and nothing is left to save, but tearing the interpreter down (torch,
    # the weights, the tokenizer) takes seconds: flush and leave now, so that a stop is quick.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _list(values: list[str]) -> tuple[str, ...]:
    """Repeated and comma-separated flag values, in order, without blanks or repeats."""
    return tuple(dict.fromkeys(v.strip() for value in values for v in value.split(",") if v.strip()))


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or a one-line KvlabError (port in use, no such address).

    Its protocol is IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    connections of such a socket. Without it every answer on a kept-alive connection — the openai
    client keeps them — waited ~40 ms for the client's delayed ACK.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        reason = "the port is in use (another server?): pick another --port" if e.errno == errno.EADDRINUSE else e
        raise KvlabError(f"cannot listen on {host}:{port}: {reason}") from None
    return sock


def run_ranks(llm, config, sock: socket.socket | None, log_level: str) -> int:
    """Tensor parallel: rank 0 serves HTTP, its engine thread driving an SpmdEngine (each step's new
    requests and aborts broadcast first); the other ranks step with it until it stops."""
    from kvlab.parallel import SpmdEngine

    spmd = SpmdEngine(llm.engine, llm.group)
    try:
        if llm.group.is_leader:
            return run_server(llm, config, sock, log_level, driver=spmd)
        for sig in (signal.SIGINT, signal.SIGTERM):  # torchrun and a terminal signal every rank: rank 0 decides
            signal.signal(sig, signal.SIG_IGN)
        spmd.run_worker()
        return 0
    finally:
        llm.close()  # rank 0 unlinks the shared-memory segment


SHUTDOWN_GRACE_S = 10.0  # after Ctrl-C, running requests get this long to finish before they are aborted


def run_server(llm, config, sock: socket.socket, log_level: str = "warning", driver=None) -> int:
    """Serve until stopped. `driver`: what the engine thread steps instead of `llm.engine` (an SpmdEngine)."""
    from kvlab.server import access_log
    from kvlab.server.app import create_app
    from kvlab.server.async_engine import AsyncEngine
    from kvlab.server.wire import uvicorn_config

    access_log.configure(log_level)  # one line per request, as vLLM and llama.cpp print
    host, port = sock.getsockname()[:2]
    engine = AsyncEngine(driver or llm.engine)
    app = create_app(llm, engine, config)
    auth = "Bearer key required on /v1 and /metrics" if config.api_keys else "no API key"
    uv_config = uvicorn_config(app, config.header_timeout_s, config.keep_alive_timeout_s, log_level=log_level,
                               timeout_graceful_shutdown=SHUTDOWN_GRACE_S + 5)  # fmt: skip
    server = graceful_server(uv_config, engine)
    engine.on_death = lambda error: setattr(server, "should_exit", True)  # exit: a supervisor restarts us
    shown = f"[{host}]" if ":" in host else host
    print(f"serving '{config.model_name}' on http://{shown}:{port}  (OpenAI API under /v1, Ollama's under /api, "
          f"Anthropic's /v1/messages; /metrics, /health; "
          f"{auth}). Ctrl-C stops.", file=sys.stderr, flush=True)  # fmt: skip
    server.run(sockets=[sock])
    if driver is not None and engine.error is None and engine.stopped.wait(llm.group.timeout_s):
        _stop_ranks(driver)
    if engine.error is not None:
        print(f"kvlab serve: the engine stopped ({type(engine.error).__name__}: {engine.error}); exiting",
              file=sys.stderr)  # fmt: skip
        return 1
    print("kvlab serve: stopped", file=sys.stderr)
    return 0


def _stop_ranks(driver) -> None:
    """The engine thread has stopped: tell the other ranks to stop too (a rank already gone cannot hear it)."""
    from kvlab.parallel import RankFailed

    try:
        driver.close()
    except RankFailed:
        pass


def graceful_server(config, engine):
    """uvicorn's server, with SIGINT (Ctrl-C) and SIGTERM in three stages: drain — let running
    requests finish (up to SHUTDOWN_GRACE_S), then abort them (their streams end with `data: [DONE]`),
    while new requests, on new connections too, are answered 503 and /health says 503 (the socket
    stays open until nothing runs: a client is told, not refused); a second signal aborts at once, a
    third exits without waiting. The signal is not re-raised afterwards (uvicorn does that): the
    process prints "stopped" and exits 0."""
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
                engine.draining = True  # /health: 503 "shutting down"; new requests: 503
                threading.Thread(target=self._exit_when_idle, name="kvlab-drain", daemon=True).start()
            elif self.signals == 2:
                print("kvlab serve: aborting running requests", file=sys.stderr, flush=True)
                engine.abort_all()
            else:
                self.force_exit = self.should_exit = True

        def _exit_when_idle(self) -> None:
            """Stop serving once no request is in the engine (the grace's abort empties it at the latest)."""
            end = time.monotonic() + SHUTDOWN_GRACE_S + 5
            while engine.num_in_flight() and time.monotonic() < end and engine.is_alive:
                time.sleep(0.05)
            self.should_exit = True

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
    from kvlab.model.loader import keeps_blocks, parse_dtype

    file = file or sys.stderr
    config, path = read_config(str(args.model))
    if getattr(args, "rope_scaling", None) is not None:  # the context the engine will allow, as LLM applies it
        config = config.with_rope_scaling(args.rope_scaling)
    ranks = getattr(args, "tensor_parallel_size", 1)
    if ranks > 1:
        from kvlab.parallel import shard_config

        config = shard_config(config, ranks)  # what one rank holds: its heads, its share of the MLP
    dtype = parse_dtype(args.dtype)
    plan = plan_kv_pool(EngineConfig(max_model_len=args.max_model_len, **options), config, dtype,
                        torch.device(args.device))  # the engine plans with the same call once loaded
    max_len = plan.max_model_len
    try:
        # as the loader will hold them: the file's blocks (exact bytes), blocks made at load, or floats
        stored = keeps_blocks(path, args.device, args.dequantize, args.quantization)
        weights = weight_bytes(config, fmt="auto" if stored else args.quantization or args.dtype).bytes
    except KvlabError:
        weights = None
    per_rank = f", per rank of {ranks}" if ranks > 1 else ""
    print(f"kvlab serve {args.model}: memory plan ({args.dtype} on {args.device}{per_rank})", file=file)
    print(f"  weights            {_gb(weights):>12}", file=file)
    print(f"  KV pool            {_gb(plan.nbytes):>12}   {plan.num_blocks:,} blocks × {plan.block_size} tokens = "
          f"{plan.num_tokens:,} tokens, {plan.bytes_per_token:,} B per token ({plan.source})", file=file)  # fmt: skip
    if plan.state is not None:  # a hybrid's recurrent layers: a constant-size state per sequence, beside the blocks
        print(f"  state pool         {_gb(plan.state_nbytes):>12}   {plan.num_state_slots:,} sequences × "
              f"{plan.state.bytes_per_sequence:,} B ({len(plan.state.layers)} Gated DeltaNet layers; no prefix "
              f"caching: their state cannot be rebuilt from attention blocks)", file=file)  # fmt: skip
    if config.mtp_layers:
        print(f"  MTP module         {len(config.mtp_layers)} layer(s) in the checkpoint, loaded only for "
              f"--speculative-config '{{\"method\": \"mtp\", ...}}'", file=file)  # fmt: skip
    print(f"  max concurrency    {plan.max_concurrency(max_len):12.1f}   sequences at the full {max_len:,}-token context "
          f"(more when shorter; a shared prefix is stored once)", file=file, flush=True)  # fmt: skip
    if plan.formats.is_quantized:
        # the same bytes in 16-bit floats: what the quantized format buys
        half = dict(options, kv_cache_dtype="float16", cache_type_k=None, cache_type_v=None, kv_memory_bytes=plan.nbytes)
        plan16 = plan_kv_pool(EngineConfig(max_model_len=args.max_model_len, **half), config, dtype, torch.device(args.device))
        print(f"  KV format          {plan.formats.description}: {plan.num_tokens / plan16.num_tokens:.2f}× the tokens of "
              f"float16 in these bytes ({plan.num_tokens:,} vs {plan16.num_tokens:,}; "
              f"{plan.max_concurrency(max_len):.1f} vs {plan16.max_concurrency(max_len):.1f} full-context sequences)",
              file=file, flush=True)  # fmt: skip
    note = quality_advice(args, path, plan.formats)
    if note:
        print(note, file=file, flush=True)
    return plan, weights


def quality_advice(args, path, formats) -> str | None:
    """`kvlab quality`'s verdict on a lossy setting for this model, as one line (None when nothing to say)."""
    from kvlab.quality.store import advice

    return advice(str(args.model), path, formats, getattr(args, "dequantize", False), getattr(args, "quantization", None),
                  getattr(args, "activation_quant", None))  # fmt: skip


def print_measured(llm, plan, planned_weights: int | None, file=None) -> None:
    from kvlab.stats import peak_memory_bytes

    file = file or sys.stderr
    engine, loaded = llm.engine, llm.loaded
    print(f"loaded in {loaded.load_s:.1f} s: planned → measured", file=file)
    print(f"  weights            {_gb(planned_weights):>12} → "
          f"{_gb(loaded.weight_bytes)}", file=file)  # fmt: skip
    print(f"  KV pool            {_gb(plan.nbytes):>12} → {_gb(engine.cache.nbytes())}   "
          f"{engine.kv.num_blocks:,} blocks, {engine.kv.num_tokens_capacity:,} tokens", file=file)  # fmt: skip
    if engine.cache.states is not None:
        print(f"  state pool         {_gb(plan.state_nbytes):>12} → {_gb(engine.cache.states.nbytes())}", file=file)
    print(f"  max concurrency    {plan.max_concurrency(engine.max_model_len):12.1f} → "
          f"{engine.kv.max_concurrency(engine.max_model_len):.1f} at {engine.max_model_len:,} tokens", file=file)
    seats = engine.scheduler.config.max_num_seqs
    why = ("" if seats == plan.max_num_seqs else
           f"; {plan.max_num_seqs} by default, kept to the decode step's rows that leave each sequence its own numbers")
    print(f"  running at once    {plan.max_num_seqs:12,} → {seats:,} requests (--max-num-seqs{why})", file=file)
    peak = peak_memory_bytes(engine.cache.device)
    if engine.cache.device.type == "cpu":  # the pool's pages become resident only as blocks fill
        print(f"  process RSS        {'':>12}   {_gb(peak)} now, up to {_gb(peak + engine.cache.nbytes())} "
              f"once the KV pool fills", file=file, flush=True)  # fmt: skip
    else:
        print(f"  device peak memory {'':>12}   {_gb(peak)} (the KV pool included)", file=file, flush=True)


def _gb(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
