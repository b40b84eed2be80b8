"""`kvlab mem`: how much memory a model takes at a context and batch, and whether it fits.

    kvlab mem qwen3-0.6b --context 32768 --batch 8 --device-memory 24GiB
    kvlab mem qwen2.5-7b gemma-3-27b gpt-oss-20b --context 131072 --plot kv.png
    kvlab mem ~/models/smollm2.gguf --json
    kvlab mem --pairs 6 2
    kvlab mem --list
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re

from kvlab.errors import KvlabError
from kvlab.memory.fit import PREFILL_CHUNK, Query, estimate
from kvlab.memory.kv import kv_bytes_per_token, resolve_kv_dtype, state_bytes, window_bytes_per_token
from kvlab.memory.pairs import pairs_with_cache, pairs_without_cache
from kvlab.memory.report import render, render_list, render_pairs
from kvlab.config import bundled_names, load_config
from kvlab.memory.units import KV_DTYPE_BITS, parse_size
from kvlab.memory.weights import count_params


def register(subparsers) -> None:
    """Add `kvlab mem` to the top-level parser."""
    p = subparsers.add_parser(
        "mem",
        help="KV-cache, state and weight memory of a model; does it fit?",
        description="Exact KV-cache, recurrent-state and weight bytes, layer by layer, from a model's "
                    "own config. MODEL: a bundled config name (see --list), a config.json, a Hugging Face "
                    "directory, a .gguf file or a registry name. Several models are compared side by side.",
    )
    p.add_argument("models", nargs="*", metavar="MODEL")
    p.add_argument("--list", action="store_true", help="list the bundled configs")
    p.add_argument("-c", "--context", metavar="S",
                   help="tokens per sequence (32768, 32k = 32,768); default: the model's trained maximum")
    p.add_argument("-b", "--batch", default="1", metavar="B", help="concurrent sequences (default 1)")
    p.add_argument("--kv-dtype", default="auto", metavar="DTYPE",
                   help=f"KV-cache element type: auto (what `kvlab run` keeps for a model file; a bare config's "
                        f"own dtype), {', '.join(KV_DTYPE_BITS)}")
    p.add_argument("--cache-type-k", metavar="DTYPE", help="keys only (overrides --kv-dtype), e.g. q8_0")
    p.add_argument("--cache-type-v", metavar="DTYPE", help="values only (overrides --kv-dtype), e.g. q4_0")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="what one of N ranks holds: its share of the heads (and so of the KV cache)")
    p.add_argument("--weights", default="auto", metavar="FORMAT",
                   help="weight format: auto (as stored), float32, bfloat16, fp8, int8, int4 (group 128 "
                        "+ fp16 scale = 4.125 bits), mxfp4, q8_0, q4_0, q4_1, q4_k, q5_0, q5_k, q6_k, or "
                        "bits per weight such as 4.5")
    p.add_argument("--state-dtype", default="auto", metavar="DTYPE",
                   help="dtype of linear-attention / SSM states (default: as the config says)")
    p.add_argument("--mtp", action="store_true",
                   help="count the multi-token-prediction layers (speculative decoding with MTP)")
    p.add_argument("--device-memory", metavar="SIZE", help="device memory, e.g. 80GiB or 24GB")
    p.add_argument("--utilization", default="0.9", metavar="F",
                   help="share of device memory the engine may use (default 0.9)")
    p.add_argument("--prefill-chunk", default=str(PREFILL_CHUNK), metavar="T",
                   help=f"tokens per prefill step, for the workspace allowance (default {PREFILL_CHUNK})")
    p.add_argument("--pairs", nargs=2, metavar=("N", "M"),
                   help="query-key pairs for a prompt of N and M new positions, with and without a cache")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.add_argument("--plot", metavar="FILE.png", help="plot KV memory against context (log axes)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Entry point of `kvlab mem`; every user error is a KvlabError."""
    if args.list:
        entries = list_entries()
        print(json.dumps(entries, indent=2) if args.json else render_list(entries))
        return 0
    if not args.models and not args.pairs:
        raise KvlabError("give a MODEL (kvlab mem --list shows the bundled ones) or --pairs N M")
    pairs = None
    if args.pairs:
        n, m = (_int(v, "--pairs") for v in args.pairs)
        pairs = {"n": n, "m": m, "with_cache": pairs_with_cache(n, m), "without_cache": pairs_without_cache(n, m)}
    specs = [load_config(name) for name in args.models]
    if args.tensor_parallel_size != 1:
        from kvlab.config.shard import shard_config

        if args.tensor_parallel_size < 1:
            raise KvlabError(f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}")
        specs = [shard_config(spec, args.tensor_parallel_size) for spec in specs]
    if args.mtp:
        specs = [spec.with_mtp() for spec in specs]
    base = Query(
        context=1,
        batch=_int(args.batch, "--batch"),
        kv_dtype=_kv_dtype(args),  # 'auto' sides become, per model, what `kvlab run` would keep (_query)
        weights=args.weights,
        state_dtype=args.state_dtype,
        device_bytes=parse_size(args.device_memory) if args.device_memory else None,
        utilization=_float(args.utilization, "--utilization"),
        prefill_chunk=_int(args.prefill_chunk, "--prefill-chunk"),
    )
    context = _tokens(args.context) if args.context else None
    queries = [_query(base, spec, context) for spec in specs]
    reports = [estimate(spec, q) for spec, q in zip(specs, queries)]
    if args.plot and specs:
        from kvlab.memory.plot import plot_kv

        top = max([context or 0] + [s.max_position_embeddings or 0 for s in specs]) or 131072
        plot_kv(specs, args.plot, batch=base.batch, top_context=top, device_bytes=base.device_bytes,
                kv_dtypes=[resolve_kv_dtype(s, q.kv_dtype) for s, q in zip(specs, queries)])
    if args.json:
        print(json.dumps(_json(reports, pairs), indent=2))
        return 0
    blocks = [render(reports)] if reports else []
    if pairs:
        blocks.append(render_pairs(pairs["n"], pairs["m"]))
    if args.plot and specs:
        blocks.append(f"plot written to {args.plot}")
    print("\n\n".join(blocks))
    return 0


def _query(base: Query, spec, context: int | None) -> Query:
    """The query for one model: its context, and its KV format where the user left it to 'auto'.

    A model `kvlab run` can load (a GGUF file, a checkpoint directory) is sized in the format `kvlab run`
    keeps on its default device, so `kvlab mem` and the engine agree; a bare config keeps its own dtype."""
    if context is None:
        if not spec.max_position_embeddings:
            raise KvlabError(f"{spec.name}: the config gives no context length; pass --context")
        context = spec.max_position_embeddings
    from kvlab.memory.engine_kv import RUN_DEVICE, fill_auto, has_auto, run_kv_dtype, runs_as_is

    query = dataclasses.replace(base, context=context)
    if not (has_auto(base.kv_dtype) and runs_as_is(spec)):
        return query
    kv_dtype = fill_auto(base.kv_dtype, run_kv_dtype(spec))
    reason = f"what `kvlab run` keeps for this model on {RUN_DEVICE} (--kv-dtype sizes another format)"
    return dataclasses.replace(query, kv_dtype=kv_dtype, kv_reason=reason)


def _json(reports, pairs) -> object:
    """One model: its report object. Otherwise {"models": [...], "pairs": {...}}."""
    if len(reports) == 1 and pairs is None:
        return reports[0].to_json()
    out: dict = {"models": [r.to_json() for r in reports]}
    if pairs is not None:
        out["pairs"] = pairs
    return out


def list_entries() -> list[dict]:
    """One summary per bundled config, KV in bfloat16."""
    entries = []
    for name in bundled_names():
        spec = load_config(name)
        params = count_params(spec)
        entries.append({
            "name": name,
            "architecture": spec.architecture,
            "layers": " + ".join(f"{n} {label}" for label, n in spec.count_by_label().items()),
            "kv_bytes_per_token": kv_bytes_per_token(spec, "bfloat16"),
            "window_bytes_per_token": window_bytes_per_token(spec, "bfloat16"),
            "state_bytes": state_bytes(spec),
            "max_context": spec.max_position_embeddings,
            "params": params.total if params else None,
        })
    return entries


def _int(text: str, flag: str) -> int:
    if not re.fullmatch(r"\s*[+-]?\d+\s*", str(text)):
        raise KvlabError(f"{flag} needs a whole number, got {text!r}")
    value = int(text)
    if value < 0:
        raise KvlabError(f"{flag} must not be negative, got {value}")
    return value


def _tokens(text: str) -> int:
    """'32768', '32k' (x1024) or '1M' (x1024^2)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not match:
        raise KvlabError(f"--context needs a token count such as 32768 or 32k, got {text!r}")
    scale = {"": 1, "k": 1024, "m": 1024**2}[match.group(2).lower()]
    return int(match.group(1)) * scale


def _float(text: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise KvlabError(f"{flag} needs a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise KvlabError(f"{flag} must be in (0, 1], got {value}")
    return value


def _kv_dtype(args) -> str:
    """--kv-dtype, or "K:V" when --cache-type-k / --cache-type-v choose keys and values apart."""
    if args.cache_type_k is None and args.cache_type_v is None:
        return args.kv_dtype
    return f"{args.cache_type_k or args.kv_dtype}:{args.cache_type_v or args.kv_dtype}"
