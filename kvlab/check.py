"""`kvlab check MODEL`: the equivalence the test suite proves, run on the user's own model and machine.

    kvlab check smollm2-135m                      # every path × every KV format, batch 1 and 16
    kvlab check MODEL --kv-cache-dtype float32 q8_0 --num-prompts 4 --max-tokens 8

Every path the model has here decodes the same prompts greedily (real text: Python's own sources), and
each is compared with the one it must equal:

    reference   the single-sequence oracle (reference.py: the modules over a contiguous float cache)
    modules     the serving engine with the modules decoding (its paged cache in the KV format)
    cpu-c       the serving engine with the C decode backend (kvlab/backends), where the model takes it

with float KV of the activations' dtype both engine paths against the reference; with a lossy format
(bfloat16, float16, q8_0, q4_0, fp8_e4m3) the backend against the modules on the same format (the
format's loss is `kvlab quality`'s to measure). Each row says whether the greedy tokens agree and the
largest logit difference over the positions up to the first token that differs (after it the inputs
differ). Exit code 0 when every comparison agrees, 1 when one does not.
"""

from __future__ import annotations

from kvlab.errors import KvlabError

def register(subparsers) -> None:
    p = subparsers.add_parser(
        "check", help="run this model through every path it has here and compare their greedy tokens and logits",
        description="Decodes the same prompts greedily through every path this machine has for MODEL (the "
                    "reference engine, the serving engine's modules, its C decode backend), with each KV format "
                    "and at batch 1 and 16, and says whether each path's tokens agree with the one it must "
                    "equal, with the largest logit difference. Exit code 1 when one does not agree.",
    )  # fmt: skip
    p.add_argument("model", help="registry name, .gguf file, or Hugging Face directory")
    p.add_argument("--kv-cache-dtype", nargs="+", metavar="FORMAT",
                   help="KV formats to check (default: every one: float32 bfloat16 float16 q8_0 q4_0 fp8_e4m3)")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=16, help="prompts (the batch of the batched runs)")
    p.add_argument("--prompt-tokens", type=int, default=48, help="tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=8, help="greedy tokens per prompt")
    p.add_argument("--threads", type=int, help="CPU threads (default: torch's count)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.set_defaults(func=cmd_check)


def cmd_check(args) -> int:
    for flag, value in (("--num-prompts", args.num_prompts), ("--prompt-tokens", args.prompt_tokens),
                        ("--max-tokens", args.max_tokens)):  # fmt: skip
        if value < 1:
            raise KvlabError(f"{flag} must be at least 1, got {value}")
    from kvlab import hub
    from kvlab.config.engine import KV_CACHE_DTYPES

    formats = args.kv_cache_dtype or [f for f in KV_CACHE_DTYPES if f != "auto"]
    unknown = [f for f in formats if f not in KV_CACHE_DTYPES]
    if unknown:
        raise KvlabError(f"unknown KV cache dtype {unknown[0]!r}: choose from {', '.join(KV_CACHE_DTYPES)}")
    from kvlab.engine_cli import check_device

    check_device(args.device)
    hub.ensure_pulled(str(args.model))
    from kvlab.check_run import run_checks

    comparisons = run_checks(args, formats)
    return 0 if all(c.agree for c in comparisons) else 1
