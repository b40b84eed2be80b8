"""kvlab against transformers, side by side in one process, on the same GGUF weights.

    .venv/bin/python benchmarks/bench_core.py --model smollm2-135m --dtype float32 --repeat 5

Measures, alternating the two engines so that machine drift hits both:
  - read bandwidth: sum over a large tensor (median of several)
  - decode tok/s: 32 greedy tokens after a 64-token prompt (kvlab: LLMEngine, the serving engine
    every user-facing path runs; transformers: generate())
  - prefill tok/s at 256 and 1024 tokens (one forward, logits of the last position only; kvlab: the
    same engine's prefill of a one-token request, prefix caching off so every run computes it all)
and prints medians (min–max), kvlab/transformers ratios, and decode's share of the bandwidth
roofline: weight bytes one decode step reads ÷ step time ÷ bandwidth. Warm-up runs are excluded.

On a GPU, where the real GGUF files may not be at hand, `--random qwen3-0.6b` builds a model with a
bundled config's real shapes and random weights (speed depends on shapes, not on the numbers):

    python benchmarks/bench_core.py --device cuda --random qwen3-0.6b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import atexit
import json
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab import SamplingParams  # noqa: E402
from kvlab.config import EngineConfig  # noqa: E402
from kvlab.engine import LLMEngine  # noqa: E402
from kvlab.hub import resolve_model  # noqa: E402
from kvlab.model.loader import load_model  # noqa: E402
from kvlab.output.result import RequestOutput  # noqa: E402


def median_min_max(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "samples": len(xs)}


DEVICE = torch.device("cpu")


def tensor(ids: list[int]) -> torch.Tensor:
    return torch.tensor([ids], device=DEVICE)


def read_bandwidth(gib: float = 2.0, repeats: int = 7) -> list[float]:
    """GB/s of a sum over a large float32 tensor (reads every byte once); `.item()` waits for a GPU."""
    x = torch.ones(int(gib * 2**30) // 4, device=DEVICE)
    x.sum().item()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum().item()
        out.append(x.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return out


def random_model(name: str, dtype: torch.dtype) -> Path:
    """A bundled config's shapes with random weights, saved as safetensors in a temporary folder."""
    import tempfile
    from importlib.resources import files

    import transformers

    cfg = json.loads(files("kvlab.configs").joinpath(f"{name}.json").read_text())
    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    directory = Path(tempfile.mkdtemp(prefix=f"kvlab-random-{name}-"))
    atexit.register(shutil.rmtree, directory, True)
    model.save_pretrained(directory)
    return directory


def prompt_ids(n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(100, min(vocab, 30000), (n,), generator=g).tolist()


def kvlab_request(engine: LLMEngine, ids: list[int], max_tokens: int) -> RequestOutput:
    """One greedy request through the serving engine, alone, to its end."""
    out = RequestOutput(prompt=None, prompt_token_ids=list(ids))
    engine.add_request(ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), output=out)
    while engine.has_unfinished_requests:
        engine.step()
    return out


def kvlab_decode(engine: LLMEngine, ids: list[int], steps: int) -> float:
    """Decode tok/s after the prompt: (steps - 1) tokens over the time from first to last token."""
    return kvlab_request(engine, ids, steps).metrics.decode_tok_s


def kvlab_prefill(engine: LLMEngine, ids: list[int]) -> float:
    """Prompt tokens per second of the step that prefilled them (the prompt fits one step's budget)."""
    m = kvlab_request(engine, ids, 1).metrics
    assert m.prefill_chunks == 1 and m.cached_prompt_tokens == 0, "the prompt must be one uncached chunk"
    return len(ids) / m.prefill_compute_s


def hf_decode(model, ids: list[int], steps: int) -> float:
    from transformers import StoppingCriteria

    stamps = []

    class Stamp(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if DEVICE.type == "cuda":
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    with torch.inference_mode():
        model.generate(
            tensor(ids), attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=DEVICE), max_new_tokens=steps,
            min_new_tokens=steps, do_sample=False, stopping_criteria=[Stamp()], pad_token_id=0,
        )  # fmt: skip
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def hf_prefill(model, ids: list[int]) -> float:
    with torch.inference_mode():
        t = time.perf_counter()
        model(tensor(ids), use_cache=True, logits_to_keep=1).logits[0, -1].argmax().item()
        return len(ids) / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--random", metavar="CONFIG", help="a bundled config's shapes with random weights, not --model")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--decode-context", type=int, default=64)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    global DEVICE
    DEVICE = torch.device(args.device)
    import transformers

    dtype = getattr(torch, args.dtype)
    if args.random:
        path = random_model(args.random, dtype)
        args.model = f"{args.random} (random weights)"
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        path = Path(resolve_model(args.model))
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    hf = hf.to(DEVICE).eval()
    ours = load_model(path, dtype=args.dtype, device=DEVICE)
    # one sequence at a time, a pool for one 2,048-token sequence, each prompt in one step
    engine = LLMEngine(ours, None, EngineConfig(max_model_len=2048, max_num_seqs=1, max_num_batched_tokens=2048,
                                                 enable_prefix_caching=False))
    vocab = ours.config.vocab_size
    decode_prompt = prompt_ids(args.decode_context, vocab)

    results = {"kvlab": {}, "transformers": {}}
    runs = {
        "decode_tok_s": (lambda: kvlab_decode(engine, decode_prompt, 33), lambda: hf_decode(hf, decode_prompt, 33)),
        "prefill_256_tok_s": (lambda: kvlab_prefill(engine, prompt_ids(256, vocab)), lambda: hf_prefill(hf, prompt_ids(256, vocab))),
        "prefill_1024_tok_s": (lambda: kvlab_prefill(engine, prompt_ids(1024, vocab)), lambda: hf_prefill(hf, prompt_ids(1024, vocab))),
    }  # fmt: skip
    bandwidth = read_bandwidth()
    for name, (ours_fn, hf_fn) in runs.items():
        ours_fn(), hf_fn()  # warm-up
        a, b = [], []
        for _ in range(args.repeat):  # alternate, so drift hits both
            a.append(ours_fn())
            b.append(hf_fn())
        results["kvlab"][name] = median_min_max(a)
        results["transformers"][name] = median_min_max(b)
        results.setdefault("ratio", {})[name] = median_min_max([x / y for x, y in zip(a, b)])
    bandwidth += read_bandwidth()
    bw = statistics.median(bandwidth)
    step_bytes = ours.decode_weight_bytes()
    hf_step_bytes = step_bytes  # same weights, same dtype: the same bytes per step
    for engine_name, nbytes in (("kvlab", step_bytes), ("transformers", hf_step_bytes)):
        tok_s = results[engine_name]["decode_tok_s"]["median"]
        results[engine_name]["decode_weight_GB_s"] = nbytes * tok_s / 1e9
        results[engine_name]["decode_share_of_roofline"] = nbytes * tok_s / 1e9 / bw
    results["machine"] = {
        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
    }  # fmt: skip
    results["model"] = {"name": args.model, "dtype": args.dtype, "decode_weight_bytes": step_bytes}
    results["bandwidth_GB_s"] = median_min_max(bandwidth)
    results["roofline_tok_s"] = bw * 1e9 / step_bytes
    print_table(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def print_table(r: dict, args) -> None:
    def cell(d):
        return f"{d['median']:8.1f} ({d['min']:.1f}–{d['max']:.1f})"

    print(f"\n{args.model} {args.dtype} on {r['machine']['device']}, {r['machine']['threads']} threads, torch {r['machine']['torch']}, "
          f"transformers {r['machine']['transformers']}; medians (min–max) of {args.repeat}")  # fmt: skip
    print(f"{'':22s} {'kvlab':>22s} {'transformers':>22s} {'ratio':>22s}")
    for name in ("decode_tok_s", "prefill_256_tok_s", "prefill_1024_tok_s"):
        ratio = r["ratio"][name]
        print(f"{name:22s} {cell(r['kvlab'][name]):>22s} {cell(r['transformers'][name]):>22s} "
              f"{ratio['median']:8.2f}× ({ratio['min']:.2f}–{ratio['max']:.2f})")  # fmt: skip
    bw = r["bandwidth_GB_s"]
    print(f"\nread bandwidth (sum over 2 GiB): {bw['median']:.1f} GB/s ({bw['min']:.1f}–{bw['max']:.1f})")
    print(f"decode reads {r['model']['decode_weight_bytes'] / 1e6:.1f} MB of weights per token → roofline "
          f"{r['roofline_tok_s']:.1f} tok/s")  # fmt: skip
    for e in ("kvlab", "transformers"):
        print(f"  {e:13s} decode streams {r[e]['decode_weight_GB_s']:5.1f} GB/s = "
              f"{100 * r[e]['decode_share_of_roofline']:.0f}% of the roofline")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
