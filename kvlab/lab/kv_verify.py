"""Experiment `kv-verify`: the real cache tensors against the formula and against `kvlab mem`.

After prefilling a 512-token prompt, the engine's cache is measured (tensor shapes, element count,
bytes, positions actually written) and compared with

    numbers = layers × 2 (K and V) × KV heads × head dim × tokens × sequences,   bytes = numbers × dtype size

and with kvlab.memory (the calculator behind `kvlab mem`), which reads the model's own config. The
course's models (bundled configs) are allocated on PyTorch's meta device, which records shapes without
touching memory, and checked the same way. DeepSeek-V3's latent cache is allocated beside the same model
with plain multi-head attention (kvlab.lab.kv_latent): the measured ratio beside the course's "about 70×".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.config import ModelConfig
from kvlab.kv.cache import ContiguousKVCache
from kvlab.lab import kv_latent
from kvlab.lab.common import Lab, forward
from kvlab.lab.report import held, md_table, num
from kvlab.lab.sources import COURSE
from kvlab.memory import kv_bytes, kv_bytes_per_token, load_config

NAME = "kv-verify"
TITLE = "KV cache size: real tensors against the formula"
CLAIM = (
    "Every attention layer keeps one key and one value vector per KV head for each token, so the cache "
    "holds layers × 2 × KV heads × head dim × tokens numbers; the real tensors match that exactly, and "
    "grouped-query attention shrinks it by the ratio of query heads to KV heads."
)
SOURCE = COURSE
MEASURED = "Qwen3-0.6B: [1, 8, 512, 128] per layer, 29,360,128 numbers at 512 tokens, 112 KiB per token in bfloat16"

CONTEXT, QUICK_CONTEXT = 512, 16
SEED_MODELS = ("qwen3-0.6b", "qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-72b")
SEED_QWEN3_NUMBERS = 29_360_128  # the course's figure: Qwen3-0.6B's cache at 512 tokens
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Check:
    what: str
    measured: str | int  # from the engine's tensors
    formula: str | int
    calculator: str | int | None  # kvlab.memory; None where it has no such figure
    equal: bool


@dataclass
class SeedModel:
    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    numbers_at_512: int  # cache.numel() of a meta-device cache
    bytes_per_token: int  # bfloat16, kvlab.memory
    bytes_per_token_without_gqa: int  # if every query head had its own K and V
    bytes_at_32k: int  # one sequence of 32,768 tokens, bfloat16
    equal: bool  # meta cache == formula == calculator


@dataclass
class KvVerifyResult:
    context: int
    checks: list[Check]
    seed_models: list[SeedModel]
    exact: bool  # every check and every seed model equal
    notes: list[str] = field(default_factory=list)
    latent: kv_latent.LatentComparison | None = None  # DeepSeek-V3's latent cache against full multi-head attention


def formula_numbers(config: ModelConfig, tokens: int, batch: int = 1) -> int:
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * tokens * batch


@torch.inference_mode()
def run(lab: Lab) -> KvVerifyResult:
    c, dtype = lab.config, lab.model.dtype
    context, notes = lab.capped(CONTEXT, QUICK_CONTEXT)
    spec = load_config(lab.loaded.path)
    cache = lab.new_cache(context)
    forward(lab.model, cache, lab.prompt(context))
    size = dtype.itemsize
    shape = [1, c.num_kv_heads, context, c.head_dim]
    shapes = sorted({tuple(t.shape) for t in cache.k + cache.v})
    written = int((torch.stack([t[0].abs().sum(dim=(0, 2)) for t in cache.k]) != 0).all(dim=0).sum())
    numbers = formula_numbers(c, context)
    checks = [
        Check("shape of every layer's K and V", " and ".join(str(list(s)) for s in shapes), str(shape), None,
              shapes == [tuple(shape)]),
        Check("positions written by the prefill", written, context, None, written == context),
        Check("numbers (all layers, K and V)", cache.numel(), numbers, kv_bytes(spec, context, kv_dtype=lab.dtype) // size,
              False),
        Check("bytes", cache.nbytes(), numbers * size, kv_bytes(spec, context, kv_dtype=lab.dtype), False),
        Check("bytes per token", cache.bytes_per_token(), numbers // context * size,
              kv_bytes_per_token(spec, lab.dtype), False),
    ]  # fmt: skip
    for name, torch_dtype in DTYPES.items():  # other dtypes and a batch of 4, allocated on the meta device
        meta = ContiguousKVCache.for_model(c, context, batch_size=4, dtype=torch_dtype, device="meta")
        expected = formula_numbers(c, context, 4) * torch_dtype.itemsize
        checks.append(Check(f"bytes, 4 sequences, {name}", meta.nbytes(), expected,
                            kv_bytes(spec, context, batch=4, kv_dtype=name), False))  # fmt: skip
    for check in checks[2:]:
        check.equal = check.measured == check.formula == check.calculator
    seeds = [seed_model(name) for name in SEED_MODELS]
    latent = kv_latent.compare()
    exact = all(ch.equal for ch in checks) and all(s.equal for s in seeds) and latent.equal
    return KvVerifyResult(context, checks, seeds, exact, notes, latent)


def seed_model(name: str) -> SeedModel:
    config = spec = load_config(name)  # one description: the engine's cache and the calculator read the same
    cache = ContiguousKVCache.for_model(config, 512, dtype=torch.bfloat16, device="meta")
    per_token = kv_bytes_per_token(spec, "bfloat16")
    equal = cache.numel() == formula_numbers(config, 512) and cache.nbytes() == kv_bytes(spec, 512, kv_dtype="bfloat16")
    return SeedModel(
        name, config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim, cache.numel(), per_token,
        per_token * config.num_heads // config.num_kv_heads, kv_bytes(spec, 32768, kv_dtype="bfloat16"),
        equal and per_token == cache.bytes_per_token(),
    )  # fmt: skip


def table(data: dict) -> str:
    checks = md_table(
        [f"{num(data['context'])}-token cache", "engine's tensors", "formula", "kvlab.memory", "equal"],
        [[c["what"], fmt(c["measured"]), fmt(c["formula"]), fmt(c["calculator"]), "yes" if c["equal"] else "**no**"]
         for c in data["checks"]],
    )  # fmt: skip
    seeds = md_table(
        ["course's models (bundled configs)", "layers", "query / KV heads", "head dim", "numbers at 512 tokens",
         "KiB per token", "without GQA", "GiB at 32,768 tokens", "equal"],
        [[s["name"], s["layers"], f"{s['heads']} / {s['kv_heads']}", s["head_dim"], num(s["numbers_at_512"]),
          num(s["bytes_per_token"] / 1024, 0), num(s["bytes_per_token_without_gqa"] / 1024, 0),
          num(s["bytes_at_32k"] / 2**30), "yes" if s["equal"] else "**no**"] for s in data["seed_models"]],
    )  # fmt: skip
    latent = "\n\n" + kv_latent.table(data["latent"]) if data.get("latent") else ""
    return (checks + "\n\n" + seeds + "\n\n(KV in bfloat16 for the course's models; KiB = 1,024 bytes, GiB = 2³⁰ bytes.)"
            + latent)  # fmt: skip


def fmt(value) -> str:
    return "–" if value is None else num(value) if isinstance(value, int) else str(value)


def verdict(data: dict) -> str:
    checks, seeds = data["checks"], data["seed_models"]
    qwen3 = next((s for s in seeds if s["name"] == "qwen3-0.6b"), None)
    seed_match = qwen3 is not None and qwen3["numbers_at_512"] == SEED_QWEN3_NUMBERS
    numbers = next(c for c in checks if c["what"].startswith("numbers"))
    text = (
        f"{held(data['exact'] and seed_match, data['exact'])}: {sum(c['equal'] for c in checks)} of {len(checks)} "
        f"checks on this model's cache were exact ({num(numbers['measured'])} numbers for "
        f"{num(data['context'])} tokens, the formula's count and kvlab.memory's)"
    )
    if qwen3:
        text += (
            f", and Qwen3-0.6B's config gives {num(qwen3['numbers_at_512'])} numbers at 512 tokens and "
            f"{num(qwen3['bytes_per_token'] / 1024, 0)} KiB per token, "
            f"{'as' if seed_match else 'unlike'} {SOURCE.short}'s 29,360,128 and 112 KiB"
        )
    latent = data.get("latent")
    if latent:
        text += (f"; DeepSeek-V3's latent cache takes {num(latent['mla_bytes_per_token'])} bytes per token, plain "
                 f"multi-head attention {latent['ratio']:.1f}× more ({SOURCE.short}: about {kv_latent.SEED_RATIO}×)")
    return text + "."
