"""`kvlab run` and `kvlab chat`: generate from a prompt, then say what each phase cost."""

from __future__ import annotations

import argparse
import json
import sys

from kvlab.errors import KvlabError


def register(subparsers) -> None:
    run = subparsers.add_parser(
        "run", help="generate from a prompt and print the cost of each phase",
        description="Generate from PROMPT (or standard input), then print what each phase cost. Without a "
                    "prompt on a terminal it opens the chat. A registry model that is not pulled yet is pulled first.",
    )  # fmt: skip
    run.add_argument("model", help="registry name (see `kvlab list`), .gguf file, or Hugging Face directory")
    run.add_argument("prompt", nargs="?",
                     help="the prompt text ('-' or none: standard input; none on a terminal: the chat)")  # fmt: skip
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    run.add_argument("--system", help="system message (with --chat, and in the chat)")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_model_args(run)
    add_parallel_args(run)
    _add_sampling_args(run)
    run.set_defaults(func=cmd_run, late_positional="prompt")  # `run MODEL --chat "hi"` (cli.parse)

    chat = subparsers.add_parser(
        "chat", help="interactive multi-turn chat that keeps the KV cache between turns",
        description="Chat with MODEL; /help lists the commands. Ctrl-C stops an answer, Ctrl-D (or Ctrl-C at "
                    "an empty prompt twice) leaves.",
    )  # fmt: skip
    chat.add_argument("model", help="registry name, .gguf file, or Hugging Face directory")
    chat.add_argument("--system", help="system message")
    _add_model_args(chat)
    add_parallel_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="activations and float weights; auto: the checkpoint's own, float32 on a CPU where "
                        "its 16-bit type is slower (default auto)")  # fmt: skip
    g.add_argument("--dequantize", action="store_true",
                   help="expand a GGUF file's quantized blocks to --dtype floats at load (default: compute with them)")
    g.add_argument("--quantization", choices=["q8_0", "q4_0"],
                   help="quantize a float checkpoint's weights to these GGUF blocks at load")
    g.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, … (default cpu)")
    g.add_argument("--threads", type=int,
                   help="CPU threads (default: one per core, fewer when other programs keep cores busy)")
    g.add_argument("--max-model-len", type=int, help="context length to allow (default: the model's)")
    g.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step (slow)")
    add_engine_args(p)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The serving engine's sizing: KV pool, block size, batch limits, prefix caching."""
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    g.add_argument("--kv-memory", help="KV pool size, e.g. 2GiB or 500MB (default: a share of free memory)")
    g.add_argument("--kv-memory-fraction", type=float,
                   help="share of free memory for the KV pool when --kv-memory is not given (default 0.2)")  # fmt: skip
    g.add_argument("--max-num-seqs", type=int, default=32, help="requests running at once (default 32)")
    g.add_argument("--max-batched-tokens", type=int, default=512,
                   help="tokens through the model per step; longer prompts are prefilled in chunks (default 512)")  # fmt: skip
    g.add_argument("--no-prefix-caching", action="store_true", help="do not reuse K/V of earlier prompts")
    add_kv_cache_args(p)
    add_speculative_args(p)


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding, as vLLM spells it: --speculative-config JSON and its two shorthands."""
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative-config", metavar="JSON",
                   help='draft and verify: {"method": "ngram" or "draft_model", "model": DRAFT, "num_speculative_tokens": '
                        'K, "prompt_lookup_min": N, "prompt_lookup_max": N, "adaptive": true} (default: off)')  # fmt: skip
    g.add_argument("--speculative-model", metavar="NAME",
                   help="a draft model with the same tokenizer (method draft_model)")
    g.add_argument("--num-speculative-tokens", type=int, metavar="K", help="tokens drafted per step")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Tensor parallelism (kvlab/parallel, docs/tensor-parallel.md): this process is one rank of a torchrun job."""
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model over N ranks: launch with torchrun --nproc-per-node N -m kvlab ... "
                        "(--nnodes/--rdzv-endpoint for several hosts); rank 0 prints (default 1)")  # fmt: skip


def add_kv_cache_args(p: argparse.ArgumentParser) -> None:
    """How the KV cache stores keys and values: vLLM's --kv-cache-dtype, llama.cpp's --cache-type-k/-v."""
    from kvlab.config.engine import KV_CACHE_DTYPES, KV_ROTATIONS

    g = p.add_argument_group("KV cache")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="keys and values: floats, or quantized with their scales (q8_0, q4_0: llama.cpp's blocks of "
                        "32; fp8_e4m3: a scale per vector); auto: the activations' dtype. Check a setting with "
                        "kvlab quality (default auto)")  # fmt: skip
    g.add_argument("--cache-type-k", choices=KV_CACHE_DTYPES[1:], help="keys only (overrides --kv-cache-dtype)")
    g.add_argument("--cache-type-v", choices=KV_CACHE_DTYPES[1:], help="values only (overrides --kv-cache-dtype)")
    g.add_argument("--kv-rotation", default="auto", choices=KV_ROTATIONS,
                   help="Hadamard-rotate keys and values before quantizing them (llama.cpp's default); auto: "
                        "each side stored as q8_0 or q4_0, not fp8 (measured worse rotated) (default auto)")  # fmt: skip


def engine_options(args) -> dict:
    """EngineConfig fields from the command line, checked."""
    from kvlab.memory.units import parse_size

    kv_bytes = None
    if args.kv_memory is not None:
        kv_bytes = int(args.kv_memory) if args.kv_memory.isdigit() else parse_size(args.kv_memory)
    for flag, value in (("--block-size", args.block_size), ("--max-num-seqs", args.max_num_seqs),
                        ("--max-batched-tokens", args.max_batched_tokens)):  # fmt: skip
        if value < 1:
            raise KvlabError(f"{flag} must be at least 1, got {value}")
    return dict(
        block_size=args.block_size,
        kv_memory_bytes=kv_bytes,
        kv_memory_fraction=args.kv_memory_fraction,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype,
        cache_type_k=args.cache_type_k,
        cache_type_v=args.cache_type_v,
        kv_rotation=args.kv_rotation,
        speculative_config=speculative_config(args),
    )


def speculative_config(args):
    """The SpeculativeConfig the flags ask for (None: off), checked before anything loads; a draft model
    not pulled yet is pulled."""
    from kvlab import hub
    from kvlab.config.speculative import from_flags

    config = from_flags(args.speculative_config, args.speculative_model, args.num_speculative_tokens)
    if config is not None and config.model:
        hub.ensure_pulled(str(config.model))
    return config


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
    # greedy by default: small models sample nonsense at 0.7 (SmolLM2: "Estão La Ville … is the capital
    # of France"; its first token has "The" at 15%, "L" at 14%), greedy they answer Paris
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="keep the most likely tokens up to this probability")
    g.add_argument("--top-k", type=int, default=0, help="keep this many most likely tokens; 0 or -1: off")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this share of the likeliest")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="1 is off")
    g.add_argument("--seed", type=int, help="random seed of the sampler (default: a fresh one)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def sampling_params(args):
    from kvlab.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def check_model_args(args, resolve_dtype: bool = True) -> None:
    """Check the model and engine flags, pull a registry model that is not there yet, and (with
    `resolve_dtype`) turn `--dtype auto` into the dtype it means for this checkpoint and device."""
    from kvlab import hub

    if args.threads is not None and args.threads < 1:
        raise KvlabError(f"--threads must be at least 1, got {args.threads}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise KvlabError(f"--max-model-len must be at least 2, got {args.max_model_len}")
    check_device(args.device)
    if hasattr(args, "tensor_parallel_size"):  # under torchrun: before anything slow
        from kvlab.parallel.group import launch_rank

        launch_rank(args.tensor_parallel_size)
    hub.ensure_pulled(str(args.model))
    if resolve_dtype and args.dtype == "auto":
        import torch

        from kvlab.config import load_config
        from kvlab.model.auto_dtype import auto_dtype

        args.dtype = auto_dtype(load_config(hub.resolve_model(str(args.model))), torch.device(args.device))


def open_llm(args, **overrides):
    """An LLM (the serving engine inside) from the model and engine flags."""
    from kvlab.llm import LLM

    check_model_args(args, resolve_dtype=False)  # the loader resolves "auto" from the one parse of the file
    options = {**engine_options(args), **overrides}
    return LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        use_cache=not getattr(args, "no_cache", False),
        threads=args.threads,
        dequantize=getattr(args, "dequantize", False),
        quantization=getattr(args, "quantization", None),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        **options,
    )


def open_llm_advised(args):
    """open_llm, then `kvlab quality`'s word on a lossy setting for this model (one line on stderr)."""
    from kvlab.quality.store import advice

    llm = open_llm(args)
    note = advice(str(args.model), llm.loaded.path, llm.engine.pool_plan.formats,
                  getattr(args, "dequantize", False), getattr(args, "quantization", None))  # fmt: skip
    if note and llm.group.is_leader:
        print(note, file=sys.stderr, flush=True)
    return llm


def check_device(device: str) -> None:
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise KvlabError(f"unknown device '{device}': use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise KvlabError("--device cuda asked for, but torch sees no CUDA device here")


def read_prompt(args) -> str | None:
    """The prompt: the argument, or standard input ('-', or no argument and input piped in) without its
    trailing newline; None when there is none and input is a terminal (the chat opens instead)."""
    if args.prompt is not None and args.prompt != "-":
        return args.prompt
    if args.prompt is None and sys.stdin.isatty():
        return None
    text = sys.stdin.read().rstrip("\r\n")
    if not text:
        raise KvlabError("no prompt: standard input was empty; give the prompt as an argument or pipe it in")
    return text


def cmd_run(args) -> int:
    params = sampling_params(args)  # validate before the slow model load
    if args.tensor_parallel_size != 1:  # every rank of the torchrun job runs this; rank 0 reads and prints
        return cmd_chat(args) if args.prompt is None and sys.stdin.isatty() else _run_parallel(args, params)
    prompt = read_prompt(args)
    if prompt is None:
        return cmd_chat(args)
    llm = open_llm_advised(args)
    return _generate(llm, prompt, params, args)


def _run_parallel(args, params) -> int:
    llm = open_llm_advised(args)
    prompt = llm.group.broadcast(read_prompt(args) if llm.group.is_leader else None)  # stdin is read once
    try:
        return _generate(llm, prompt, params, args)
    finally:
        llm.close()


def _generate(llm, prompt: str, params, args) -> int:
    warn_if_busy(llm, args)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        stream = llm.chat_stream(messages, params)
        stream.output.prompt = prompt
    else:
        stream = llm.stream(prompt, params)
    if not llm.group.is_leader:  # the other ranks take the same steps, in silence
        stream.finish()
        return 0
    if args.json:
        out = stream.finish()
        print(json.dumps(_json_output(llm, out, args), ensure_ascii=False))
        return 0
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print_report(llm, stream.output, args, file=sys.stderr)
    return 0


def speculative_line(llm) -> str | None:
    """The engine's speculation measured against its prediction (None when speculation is off)."""
    spec = llm.engine.spec
    return spec.report().line() if spec is not None else None


def cmd_chat(args) -> int:
    from kvlab.chat_cli import run_chat

    if args.tensor_parallel_size != 1:
        raise KvlabError("kvlab chat runs in one process: for tensor parallelism, serve the model "
                         "(torchrun ... -m kvlab serve MODEL -tp N) and chat through it, or give kvlab run a prompt")
    return run_chat(args)


def threads_text(llm, args) -> str:
    """"2 threads", or why there are fewer (or why they may wait): other programs' load on the cores."""
    n = llm.policy.threads
    text = f"{n} thread{'s' if n != 1 else ''}"
    load = llm.cpu_load
    if load is not None and load.is_busy:
        text += f" ({'--threads; ' if args.threads else ''}{load.describe()})"
    return text


def warn_if_busy(llm, args, file=None) -> None:
    """One line when --threads asks for more threads than other programs leave cores free (rank 0 says it)."""
    load = llm.cpu_load
    busy = load is not None and load.is_busy and llm.group.is_leader
    if args.threads and busy and args.threads > load.threads_for(args.threads):
        print(f"kvlab: warning: {load.describe()}; --threads {args.threads} will wait on them "
              f"({load.threads_for(args.threads)} would not)", file=file or sys.stderr)  # fmt: skip


def dtype_text(llm, args) -> str:
    dtype = str(llm.loaded.model.dtype).removeprefix("torch.")
    return f"{dtype} (auto)" if args.dtype == "auto" else dtype


def _json_output(llm, out, args) -> dict:
    d = out.to_dict()
    d.update(
        model=str(args.model),
        dtype=str(llm.loaded.model.dtype).removeprefix("torch."),
        device=args.device,
        threads=llm.policy.threads,
        cpu_others_busy=llm.cpu_load.others_busy if llm.cpu_load else None,
        use_cache=not args.no_cache,
        weight_format=llm.loaded.weight_format,
        kv_cache_dtype=llm.engine.pool_plan.formats.name,
        weight_bytes=llm.loaded.weight_bytes,
        tensor_parallel_size=llm.group.world_size,
        load_s=llm.loaded.load_s,
        mtp_layers=len(llm.config.mtp_layers),
        **llm.engine.decode_path.to_dict(),
    )
    if llm.engine.spec is not None:
        d["speculative"] = llm.engine.spec.report().to_dict()
    return d


def chat_hint(llm, out, args) -> str | None:
    """A raw completion that ran to --max-tokens on a model with a chat template: most likely a question
    the user meant to ask (`echo hi | kvlab run MODEL` continues "hi" as text). Point to --chat."""
    tokenizer = llm.tokenizer
    if getattr(args, "chat", True) or out.finish_reason != "length" or not getattr(tokenizer, "chat_template", None):
        return None
    return (f"note: the prompt was continued as raw text up to --max-tokens {args.max_tokens}; "
            f"to ask {args.model} a question, add --chat (its chat template)")  # fmt: skip


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def print_report(llm, out, args, file) -> None:
    """The phase breakdown printed after every answer."""
    m = out.metrics
    cache = "off (recomputing every step)" if args.no_cache else (
        f"{_mib(m.kv_cache_bytes)} in use for {m.prompt_tokens + m.generated_tokens - 1} tokens, "
        f"{_mib(m.kv_cache_allocated_bytes)} allocated, {llm.engine.pool_plan.formats.description}"
    )  # fmt: skip
    world = llm.group.world_size
    ranks = f" × {world} ranks (tensor-parallel: weights and KV per rank)" if world > 1 else ""
    lines = [
        f"── {args.model}: {dtype_text(llm, args)} on {args.device}{ranks}, {threads_text(llm, args)}, weights "
        f"{llm.loaded.weight_format} {llm.loaded.weight_bytes / 1e6:.1f} MB, loaded in {llm.loaded.load_s:.2f} s",
        f"prompt     {m.prompt_tokens:6d} tokens   prefill {m.prefill_s:7.3f} s  {m.prefill_tok_s:8.1f} tok/s   "
        f"TTFT {m.ttft_s * 1000:.0f} ms",
        f"generated  {m.generated_tokens:6d} tokens   decode  {m.decode_s:7.3f} s  {m.decode_tok_s:8.1f} tok/s   "
        f"TPOT {m.tpot_s * 1000:.1f} ms   ({out.finish_reason})",
        f"KV cache   {cache}",
        f"peak memory {m.peak_memory_bytes / 2**20:.0f} MiB",
    ]  # fmt: skip
    if llm.engine.spec is not None:
        lines.append(speculative_line(llm))
    path = llm.engine.decode_path
    if path.reason and not args.no_cache:  # off the C decode step: say why (it is slower)
        lines.append(f"decode     on the PyTorch modules, not the C step: {path.reason}")
    hint = chat_hint(llm, out, args)
    if hint:
        lines.append(hint)
    mtp = len(llm.config.mtp_layers)
    if mtp:
        lines.append(f"MTP heads  {mtp} layer(s) in the checkpoint, kept out of the trunk and the KV pool (not run)")
    print("\n".join(lines), file=file)
