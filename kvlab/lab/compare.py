"""`--compare transformers`: the phases and cache measurements again, with transformers on the same weights.

transformers loads the very file kvlab loaded (a Hugging Face directory, or a GGUF file it dequantizes
itself) in the same dtype, on the same threads. The workloads copy kvlab's: the same random prompts,
lengths and step counts, greedy decoding, a fresh cache per prefill, logits of the last position only.
The results go into the phases and cache entries as `transformers`; their tables gain ratio columns.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict
from pathlib import Path

import torch

from kvlab.errors import KvlabError
from kvlab.lab.common import Lab
from kvlab.model.loader import DTYPES


def load_transformers(path: Path, dtype: str):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise KvlabError("--compare transformers needs transformers: pip install 'kvlab[dev]'") from None
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=DTYPES[dtype])
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=DTYPES[dtype])
    return model.eval()


class HFRunner:
    """Greedy prefill / decode / recompute passes through a transformers model."""

    def __init__(self, model):
        self.model = model
        # transformers 5.x names the cache argument `cache`; earlier versions `past_key_values`
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def prefill(self, ids: torch.Tensor):
        """ids [1, T] → (next token [1, 1], the new cache)."""
        out = self.model(ids, use_cache=True, logits_to_keep=1)
        cache = out.get("cache") or out.get("past_key_values")
        return out.logits[:, -1].argmax(-1, keepdim=True), cache

    def decode(self, token: torch.Tensor, cache, steps: int) -> list[int]:
        ids = []
        for _ in range(steps):
            out = self.model(token, use_cache=True, logits_to_keep=1, **{self.cache_arg: cache})
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            ids.append(int(token))
        return ids

    def recompute(self, ids: torch.Tensor, steps: int) -> list[int]:
        produced = []
        for _ in range(steps):
            token = self.model(ids, use_cache=False, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            produced.append(int(token))
            ids = torch.cat([ids, token], dim=1)
        return produced


def rewind(cache, length: int) -> None:
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # a negative count removes that many tokens from the end


@torch.inference_mode()
def compare(lab: Lab, experiments: dict[str, dict]) -> None:
    """Add a "transformers" entry to the phases and cache results (JSON form) in `experiments`."""
    import transformers

    runner = HFRunner(load_transformers(Path(lab.loaded.path), lab.dtype))
    label = f"transformers {transformers.__version__}"
    if "phases" in experiments:
        experiments["phases"]["transformers"] = {"library": label, **phases(lab, runner, experiments["phases"])}
    if "cache" in experiments:
        experiments["cache"]["transformers"] = {"library": label, "points": cache(lab, runner, experiments["cache"])}


def phases(lab: Lab, hf: HFRunner, data: dict) -> dict:
    bar = lab.progress(len(data["prefill"]) + len(data["decode"]), "transformers phases")
    prefill = []
    for p in data["prefill"]:
        n, ids = p["prompt_tokens"], lab.prompt(p["prompt_tokens"])
        timing = lab.measure(lambda: hf.prefill(ids))
        prefill.append({"prompt_tokens": n, "timing": asdict(timing), "tok_s": n / timing.median_s})
        bar.update()
    decode = []
    for d in data["decode"]:
        context, steps = d["context"], d["new_tokens"]
        first, cache = hf.prefill(lab.prompt(context))
        out: list[list[int]] = []
        timing = lab.measure(lambda: out.append(hf.decode(first, cache, steps)), setup=lambda: rewind(cache, context))
        ids = [int(first)] + out[-1]
        decode.append({"context": context, "new_tokens": steps, "timing": asdict(timing),
                       "tok_s": steps / timing.median_s, "same_tokens_as_kvlab": ids == d["token_ids"]})  # fmt: skip
        bar.update()
    bar.close()
    return {"prefill": prefill, "decode": decode}


def cache(lab: Lab, hf: HFRunner, data: dict) -> list[dict]:
    points = []
    bar = lab.progress(len(data["points"]), "transformers cache")
    for p in data["points"]:
        context, steps, n = p["context"], p["cached_steps"], p["uncached_steps"]
        prompt = lab.prompt(context)
        first, kv = hf.prefill(prompt)
        decoded: list[list[int]] = []
        recomputed: list[list[int]] = []
        cached = lab.measure(lambda: decoded.append(hf.decode(first, kv, steps)), setup=lambda: rewind(kv, context))
        sequence = torch.cat([prompt, first], dim=1)
        uncached = lab.measure(lambda: recomputed.append(hf.recompute(sequence, n)))
        cached_tok_s, uncached_tok_s = steps / cached.median_s, n / uncached.median_s
        points.append({
            "context": context, "cached": asdict(cached), "cached_tok_s": cached_tok_s, "uncached": asdict(uncached),
            "uncached_tok_s": uncached_tok_s, "slowdown": cached_tok_s / uncached_tok_s,
            "same_tokens_as_kvlab": [int(first)] + decoded[-1] == p["cached_ids"]
            and recomputed[-1] == p["uncached_ids"][1:],
        })  # fmt: skip
        bar.update()
    bar.close()
    return points
