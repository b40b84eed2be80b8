"""`kvlab quality`: is a cheaper setting safe on this model? KL divergence against float32 KV.

    kvlab quality smollm2-135m --kv-cache-dtype q8_0
    kvlab quality qwen2.5-coder-0.5b --cache-type-k q8_0 --cache-type-v q4_0 --json
    kvlab quality ~/models/model-f16 --quantization q4_0 --text notes.txt
    kvlab quality qwen2.5-coder-0.5b --activation-quant int8
"""

from __future__ import annotations

import argparse
import json
import sys

from kvlab.errors import KvlabError

DEFAULT_TOKENS = 8192
DEFAULT_WINDOW = 2048
DECODE_CHUNK = 16  # --activation-quant's passes after a window's prompt: a decode step's rows


def register(subparsers) -> None:
    from kvlab.engine_cli import add_kv_cache_args

    p = subparsers.add_parser(
        "quality",
        help="how much a quantized KV cache (or weights) changes the model: KL divergence, same top token",
        description="Runs the model over real text twice, position by position: with float32 KV and its own "
                    "weights (the reference), and with the chosen setting. Reports llama.cpp's --kl-divergence "
                    "statistics and a verdict: ok (mean KLD <= 0.005 and same top >= 97%), caution (<= 0.03 and "
                    ">= 90%), unsafe. Results are kept, and kvlab run / serve warn about an unsafe setting.",
    )  # fmt: skip
    p.add_argument("model", help="registry name, .gguf file, or Hugging Face directory")
    add_kv_cache_args(p)
    g = p.add_argument_group("model")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="activations of the measured setting (the reference is float32)")
    g.add_argument("--dequantize", action="store_true", help="the measured setting expands a GGUF file's blocks")
    g.add_argument("--quantization", choices=["q8_0", "q4_0"],
                   help="the measured setting quantizes a float checkpoint's weights at load")
    g.add_argument("--activation-quant", choices=["int8", "bf16x3"],
                   help="the measured setting: activations rounded to 8 bits, or split into three bfloat16 parts "
                        "on AMX tiles, in its products (run's --activation-quant)")  # fmt: skip
    g.add_argument("--device", default="cpu", help="torch device (default cpu)")
    g.add_argument("--threads", type=int, help="CPU threads (default: torch's count)")
    t = p.add_argument_group("text")
    t.add_argument("--text", metavar="FILE", help="UTF-8 text to read (default: Python's own standard library sources)")
    t.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="tokens of text to read")
    t.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                   help="tokens per window; each starts with an empty cache")
    t.add_argument("--chunk", type=int, default=512, help="tokens per forward pass within a window")
    t.add_argument("--decode-chunk", type=int, metavar="N",
                   help="after a window's first --chunk tokens (its prompt), N tokens per pass, as a decode's "
                        "(default: --chunk; with --activation-quant, 16: that setting computes a prompt's passes "
                        "and a decode's differently, and this measures both as served)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-save", action="store_true", help="do not keep the result for kvlab run / serve")
    p.set_defaults(func=run)


def _check(args) -> None:
    for flag, value, least in (("--tokens", args.tokens, 2), ("--window", args.window, 2), ("--chunk", args.chunk, 1),
                               ("--decode-chunk", args.decode_chunk, 1)):  # fmt: skip
        if value is not None and value < least:
            raise KvlabError(f"{flag} must be at least {least}, got {value}")
    if args.threads is not None and args.threads < 1:
        raise KvlabError(f"--threads must be at least 1, got {args.threads}")


def run(args: argparse.Namespace) -> int:
    _check(args)
    import torch

    from kvlab import hub
    from kvlab.engine_cli import check_device
    from kvlab.kernels import ThreadPolicy
    from kvlab.kv.formats import KVFormats
    from kvlab.tokenizer import load_tokenizer
    from kvlab.model.loader import load_model
    from kvlab.quality import store
    from kvlab.quality.measure import Candidate, measure
    from kvlab.quality.text import ids_digest, text_ids

    check_device(args.device)
    hub.ensure_pulled(str(args.model))
    dtype = getattr(torch, args.dtype)
    formats = KVFormats.resolve(args.kv_cache_dtype, args.cache_type_k, args.cache_type_v, dtype, args.kv_rotation)
    ref_loaded = load_model(args.model, dtype="float32", device=args.device, max_positions=args.window)
    own_weights = args.dtype == "float32" and not args.dequantize and not args.quantization and not args.activation_quant
    loaded = ref_loaded if own_weights else load_model(
        args.model, dtype=args.dtype, device=args.device, max_positions=args.window,
        dequantize=args.dequantize, quantization=args.quantization, huge_pages=not args.activation_quant)  # fmt: skip
    if args.activation_quant:
        from kvlab.quant.activations import with_activation_setting

        loaded = with_activation_setting(loaded, args.activation_quant)
    tokenizer = load_tokenizer(ref_loaded)
    if tokenizer is None:
        raise KvlabError(f"{args.model} has no tokenizer to read text with")
    window = min(args.window, ref_loaded.model.rotary.cos.shape[0])
    ids, what = text_ids(tokenizer, args.tokens, args.text)
    if len(ids) < 2:
        raise KvlabError(f"the text has {len(ids)} token(s): at least 2 are needed to score one position")
    specials = tokenizer.encode("", add_special_tokens=True)
    bos = tokenizer.bos_token_id if specials[:1] == [tokenizer.bos_token_id] else None

    policy = ThreadPolicy(threads=args.threads)
    weights = store.weights_name(args.dequantize, args.quantization, args.activation_quant)
    name = f"{formats.description} KV, weights {weights}" + ("" if args.dtype == "float32" else f", {args.dtype}")
    reference = Candidate("float32 KV, weights as stored", ref_loaded, KVFormats.plain(torch.float32), policy)
    candidate = Candidate(name, loaded, formats, policy)

    def progress(done: int, total: int) -> None:
        if sys.stderr.isatty() and not args.json:
            print(f"\r  window {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True)

    then = args.decode_chunk or (DECODE_CHUNK if args.activation_quant else None)
    result = measure(reference, [candidate], ids, window=window, chunk=args.chunk, bos=bos, progress=progress,
                     then=then)[0]  # fmt: skip
    record = {**result.to_dict(), "model": str(args.model), "text": what, "window": window, "chunk": args.chunk,
              "decode_chunk": then,
              "kv_k": formats.k.name, "kv_v": formats.v.name, "kv_rotation": [formats.rotate_k, formats.rotate_v], "weights": weights, "dtype": args.dtype}  # fmt: skip
    kept = None
    if not args.no_save:
        kept = store.save(ref_loaded.path, store.setting_key(formats, weights), ids_digest(ids), record)
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(render(record, kept))
    return 0


def render(r: dict, kept) -> str:
    from kvlab.quality.measure import CAUTION_MEAN_KLD, CAUTION_SAME_TOP, OK_MEAN_KLD, OK_SAME_TOP

    change = 100 * (r["ppl"] / r["ppl_ref"] - 1)
    rule = {"ok": f"mean KLD <= {OK_MEAN_KLD} and same top >= {OK_SAME_TOP:.0%}",
            "caution": f"mean KLD <= {CAUTION_MEAN_KLD} and same top >= {CAUTION_SAME_TOP:.0%}",
            "unsafe": f"worse than caution (mean KLD > {CAUTION_MEAN_KLD} or same top < {CAUTION_SAME_TOP:.0%})"}
    lines = [
        f"kvlab quality · {r['model']} · {r['setting']}, against float32 KV with the weights as stored",
        f"text: {r['text']}",
        f"      {r['tokens']:,} positions scored, windows of up to {r['window']:,} tokens"
        + (f" (a first pass of {r['chunk']:,}, then passes of {r['decode_chunk']})" if r.get("decode_chunk") else ""),
        "",
        f"  mean KLD      {r['mean_kld']:.6f}",
        f"  median KLD    {r['median_kld']:.6f}",
        f"  p99 KLD       {r['p99_kld']:.6f}",
        f"  max KLD       {r['max_kld']:.6f}",
        f"  same top      {100 * r['same_top_p']:.2f} %",
        f"  perplexity    {r['ppl_ref']:.4f} -> {r['ppl']:.4f} ({change:+.2f} %)",
        f"  verdict       {r['verdict']} ({rule[r['verdict']]})",
        "",
        f"took {r['seconds']:.0f} s" + (f"; kept in {kept}" if kept else ""),
    ]  # fmt: skip
    return "\n".join(lines)
