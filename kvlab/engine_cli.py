"""The model, engine and sampling flags every command that runs a model shares (`run`, `chat`, `serve`,
`bench serve`, `quality`), checked before anything slow, and the LLM they open; the footer's words for
threads and dtype. `generate_cli.py` (run) and `chat_cli.py` (chat) both build on it.
"""

from __future__ import annotations

import argparse
import re
import sys

from kvlab.errors import KvlabError


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="activations and float weights; auto: the checkpoint's own, float32 on a CPU where "
                        "its 16-bit type is slower (default auto)")  # fmt: skip
    g.add_argument("--dequantize", action="store_true",
                   help="expand a GGUF file's quantized blocks to --dtype floats at load (default: compute with them)")
    g.add_argument("--quantization", choices=["q8_0", "q4_0"],
                   help="quantize a float checkpoint's weights to these GGUF blocks at load")
    g.add_argument("--activation-quant", choices=["int8", "bf16x3"],
                   help="int8: quantize activations to 8 bits in every product over GGUF blocks, as llama.cpp does "
                        "(faster, most of all for many sequences at once, but not exact: kvlab quality MODEL "
                        "--activation-quant int8 measures it); bf16x3: each activation as three bfloat16 parts, "
                        "multiplied exactly on AMX tiles (Intel Xeon 4th generation or later; faster for many "
                        "sequences at once); default: exact float32 activations")  # fmt: skip
    g.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, … (default cpu)")
    g.add_argument("--threads", type=int,
                   help="CPU threads (default: one per core, fewer when other programs keep cores busy)")
    g.add_argument("--max-model-len", type=int, help="context length to allow (default: the model's)")
    g.add_argument("--rope-scaling", metavar="JSON",
                   help='replace the model\'s RoPE scaling, as a config.json rope_scaling block: \'{"rope_type": '
                        '"yarn", "factor": 2.0, "original_max_position_embeddings": 8192}\' lets the context run to '
                        "original × factor tokens (vLLM's --hf-overrides, llama.cpp's --rope-scaling yarn)")  # fmt: skip
    g.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step (slow)")
    add_engine_args(p)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The serving engine's sizing: KV pool, block size, batch limits, prefix caching."""
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    g.add_argument("--kv-memory", help="KV pool size, e.g. 2GiB or 500MB (default: a share of free memory)")
    g.add_argument("--kv-memory-fraction", type=float,
                   help="share of free memory for the KV pool when --kv-memory is not given (default 0.2)")  # fmt: skip
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests running at once (default 128; 32 for a model with recurrent layers or float matrices)")
    g.add_argument("--max-batched-tokens", "--max-num-batched-tokens", dest="max_batched_tokens", type=int, default=1024,
                   help="tokens through the model per step; longer prompts are prefilled in chunks (default 1024; "
                        "vLLM's name also works)")  # fmt: skip
    g.add_argument("--no-prefix-caching", action="store_true", help="do not reuse K/V of earlier prompts")
    g.add_argument("--prompt-cache-dir", metavar="DIR",
                   help="keep the prefix cache's full blocks as files in DIR too: a later process (or a request whose "
                        "blocks memory evicted) reads them back instead of prefilling them again (default: off)")  # fmt: skip
    g.add_argument("--prompt-cache-size", metavar="SIZE",
                   help="most bytes --prompt-cache-dir may hold, e.g. 10GiB; the least recently used blocks go "
                        "first (default 4GiB)")  # fmt: skip
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
        if value is not None and value < 1:
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
        **prompt_cache_options(args),
    )


def prompt_cache_options(args) -> dict:
    """--prompt-cache-dir and --prompt-cache-size, checked (a DIR that cannot be written, a bad size: one line)."""
    directory, size = getattr(args, "prompt_cache_dir", None), getattr(args, "prompt_cache_size", None)
    if directory is None:
        if size is not None:
            raise KvlabError("--prompt-cache-size needs --prompt-cache-dir")
        return {}
    from kvlab.kv.disk_tier import cache_size, check_writable

    check_writable(directory)
    return dict(prompt_cache_dir=directory, prompt_cache_size=cache_size(size))


def speculative_config(args):
    """The SpeculativeConfig the flags ask for (None: off), checked before anything loads; a draft model
    not pulled yet is pulled."""
    from kvlab import hub
    from kvlab.config.speculative import from_flags

    config = from_flags(args.speculative_config, args.speculative_model, args.num_speculative_tokens)
    if config is not None and config.model:
        hub.ensure_pulled(str(config.model))
    return config


def add_sampling_args(p: argparse.ArgumentParser) -> None:
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
    if getattr(args, "rope_scaling", None) is not None:
        from kvlab.config.rope import parse_rope_scaling

        parse_rope_scaling(args.rope_scaling)  # a typo is one line, before anything loads
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
    check_model_args(args, resolve_dtype=False)  # the loader resolves "auto" from the one parse of the file
    from kvlab.llm import LLM, settle_heap  # torch: only once the flags are known to be good
    options = {**engine_options(args), **overrides}
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        use_cache=not getattr(args, "no_cache", False),
        threads=args.threads,
        dequantize=getattr(args, "dequantize", False),
        quantization=getattr(args, "quantization", None),
        activation_quant=getattr(args, "activation_quant", None),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        rope_scaling=getattr(args, "rope_scaling", None),
        **options,
    )
    settle_heap()  # the model lives until the command exits
    return llm


def open_llm_advised(args):
    """open_llm, then `kvlab quality`'s word on a lossy setting for this model (one line on stderr)."""
    llm = open_llm(args)
    from kvlab.quality.store import advice
    note = advice(str(args.model), llm.loaded.path, llm.engine.pool_plan.formats,
                  getattr(args, "dequantize", False), getattr(args, "quantization", None),
                  getattr(args, "activation_quant", None))  # fmt: skip
    if note and llm.group.is_leader:
        print(note, file=sys.stderr, flush=True)
    return llm


DEVICE = re.compile(r"(cpu|cuda|mps|xpu)(:\d+)?")  # the torch device types kvlab may be asked for


def check_device(device: str) -> None:
    """A device kvlab can run on, or one line: judged from the name first (no torch for a typo)."""
    if not DEVICE.fullmatch(str(device).strip()):
        raise KvlabError(f"unknown device '{device}': use cpu, cuda or cuda:N")
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise KvlabError("--device cuda asked for, but torch sees no CUDA device here")


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

