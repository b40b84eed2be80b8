"""`kvlab run` and `kvlab chat`: generate from a prompt, then say what each phase cost."""

from __future__ import annotations

import json
import sys

from kvlab.engine_cli import (
    add_model_args,
    add_parallel_args,
    add_sampling_args,
    dtype_text,
    open_llm_advised,
    sampling_params,
    threads_text,
    warn_if_busy,
)
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
    add_model_args(run)
    add_parallel_args(run)
    add_sampling_args(run)
    run.set_defaults(func=cmd_run, late_positional="prompt")  # `run MODEL --chat "hi"` (cli.parse)

    chat = subparsers.add_parser(
        "chat", help="interactive multi-turn chat that keeps the KV cache between turns",
        description="Chat with MODEL; /help lists the commands. Ctrl-C stops an answer, Ctrl-D (or Ctrl-C at "
                    "an empty prompt twice) leaves.",
    )  # fmt: skip
    chat.add_argument("model", help="registry name, .gguf file, or Hugging Face directory")
    chat.add_argument("--system", help="system message")
    add_model_args(chat)
    add_parallel_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)


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
    try:
        return _generate(llm, prompt, params, args)
    finally:
        llm.close()  # the prompt cache's queued blocks written (--prompt-cache-dir), its threads stopped


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
        decode_weight_bytes=llm.loaded.decode_weight_bytes(),
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


def reused_line(llm, m) -> str:
    """The prompt tokens the prefix cache served, split into memory and disk (--prompt-cache-dir)."""
    disk = m.cached_prompt_tokens_disk
    line = (f"reused     {m.cached_prompt_tokens:6d} of {m.prompt_tokens} prompt tokens from the prefix cache: "
            f"{m.cached_prompt_tokens - disk} from memory, {disk} from disk")  # fmt: skip
    tier = llm.engine.prompt_cache
    return line + (f" ({tier.describe()})" if tier is not None else "")


def active_weights_line(llm) -> str | None:
    """For a mixture of experts: the weight bytes one token reads (its chosen experts) beside the total."""
    from kvlab.config import MoE

    experts = [layer.mlp for layer in llm.config.layers if isinstance(layer.mlp, MoE)]
    if not experts:
        return None
    total, active = llm.loaded.weight_bytes, llm.loaded.decode_weight_bytes()
    moe = experts[0]
    return (f"active     {active / 1e6:.1f} MB of the {total / 1e6:.1f} MB of weights read per token "
            f"({moe.top_k} of {moe.num_experts} experts in each of {len(experts)} MoE layers; "
            f"a batch of B reads up to B × {moe.top_k} experts a layer)")  # fmt: skip


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
    if m.cached_prompt_tokens or llm.engine.prompt_cache is not None:
        lines.insert(2, reused_line(llm, m))
    active = active_weights_line(llm)
    if active:
        lines.insert(1, active)
    state = llm.engine.pool_plan.state
    if state is not None and not args.no_cache:  # a hybrid: its recurrent layers' constant-size state
        lines.insert(lines.index(f"KV cache   {cache}") + 1,
                     f"state      {_mib(state.bytes_per_sequence)} for this sequence ({len(state.layers)} Gated "
                     f"DeltaNet layers' conv windows and delta-rule matrices, whatever the context)")  # fmt: skip
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
        drafting = llm.engine.spec is not None and llm.engine.spec.config.method == "mtp"
        lines.append(f"MTP heads  {mtp} layer(s) in the checkpoint, kept out of the trunk and the KV pool "
                     + ("(drafting: --speculative-config method mtp)" if drafting else "(loaded only for "
                        "--speculative-config '{\"method\": \"mtp\", ...}')"))  # fmt: skip
    print("\n".join(lines), file=file)
