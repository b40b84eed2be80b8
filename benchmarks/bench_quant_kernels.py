"""The block-format kernels (kernels/quant.c) against the float32 GEMV (kernels/gemv.c), shape by shape.

    .venv/bin/python benchmarks/bench_quant_kernels.py                   # every format, both models' shapes
    .venv/bin/python benchmarks/bench_quant_kernels.py --formats Q4_1 Q8_0 --rows 1 --decode
    .venv/bin/python benchmarks/bench_quant_kernels.py --rows 1 16 --int8   # and the 8-bit-activation kernels

For each matrix shape of SmolLM2-135M and Qwen2.5-Coder-0.5B ([out, in]: attention, MLP up/gate and
down, LM head) and 1 and 16 activation rows: median µs per call and GB/s of weight bytes read, for
each block format (random blocks with valid fp16 scales: speed does not depend on the values) and for
float32 weights through the GEMV, on the same threads. The calls go straight to the C functions (one
ctypes call each, the same for both), alternating kernels within each repeat so that machine drift
hits all of them, and every kernel cycles through enough copies of its matrix to read
`--working-set-mb` per pass: weights come from memory, as in a decode step of a model larger than
the caches, not from a cache holding one matrix (--huge-pages: the copies in 2 MB pages, as a loaded
model's streamed weights are; kvlab/model/huge_pages.py). K-quants need rows of whole 256-value super-blocks:
shapes whose input size is not one are skipped for them.

--decode adds a whole model's decode: `kvlab run MODEL ... --max-tokens 64 --json` with the file's
own blocks and with --dequantize (float32), alternating processes, medians of tok/s.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlab.kernels import gemv, quant  # noqa: E402
from kvlab.lab.common import cpu_model  # noqa: E402
from kvlab.model.huge_pages import HugeArena  # noqa: E402
from kvlab.quant.formats import FORMATS  # noqa: E402

SHAPES = {  # [out, in] of each model's matrices
    "smollm2-135m": [(576, 576), (1536, 576), (576, 1536), (49152, 576)],
    "qwen2.5-coder-0.5b": [(896, 896), (4864, 896), (896, 4864), (151936, 896)],
}
QUANTIZED = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"]
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(fmt: str, out: int, n: int, rng: np.random.Generator) -> torch.Tensor:
    """uint8 [out, row bytes]: random codes, fp16 scales of a realistic size."""
    f = FORMATS[fmt]
    blocks = rng.integers(0, 256, size=(out * n // f.block_values, f.block_bytes), dtype=np.uint8)
    for at in FP16_FIELDS[fmt]:
        d = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16)
        blocks[:, at : at + 2] = d.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(blocks.reshape(out, -1))


class Kernel:
    """One kernel on one shape: copies of its matrix, and a call that reads the next copy."""

    def __init__(self, name: str, matrices: list[torch.Tensor], call):
        self.name, self.matrices, self.call = name, matrices, call
        self.bytes = matrices[0].numel() * matrices[0].element_size()
        self.next = 0

    def run(self, calls: int) -> float:
        """Seconds per call over `calls` calls."""
        start = time.perf_counter()
        for _ in range(calls):
            self.call(self.matrices[self.next])
            self.next = (self.next + 1) % len(self.matrices)
        return (time.perf_counter() - start) / calls


HUGE_PAGES = False  # --huge-pages: the copies in 2 MB pages, as a loaded model's weights are (model/huge_pages.py)


def copies(make, nbytes: int, working_set: int) -> list[torch.Tensor]:
    n = max(1, -(-working_set // nbytes))
    if not HUGE_PAGES:
        return [make() for _ in range(n)]
    arena = HugeArena(chunk=n * nbytes + (64 << 10) * n)
    return [arena.empty(m.shape, m.dtype).copy_(m) for m in (make() for _ in range(n))]


def kernels_for(out: int, n: int, rows: int, formats: list[str], threads: int, working_set: int,
                int8: bool = False) -> list[Kernel]:
    x, y = torch.randn(rows, n), torch.empty(rows, out)
    f32 = gemv._kernels[torch.float32]
    w = torch.randn(out, n) * 0.02
    found = [Kernel("f32 GEMV", copies(w.clone, w.numel() * 4, working_set),
                    lambda m: f32(m.data_ptr(), x.data_ptr(), 0, y.data_ptr(), rows, n, out, threads))]  # fmt: skip
    ids, matmul, rng = quant._format_ids(), gemv._quant["matmul"], np.random.default_rng(0)
    for fmt in formats:
        if n % FORMATS[fmt].block_values:
            continue
        blocks = random_blocks(fmt, out, n, rng)

        def call(m, fid=ids[fmt]):
            matmul(fid, m.data_ptr(), m.stride(0), x.data_ptr(), y.data_ptr(), rows, n, out, out, threads)

        found.append(Kernel(fmt, copies(blocks.clone, blocks.numel(), working_set), call))
        if int8:  # the same matrix interleaved for 8-bit activations (--activation-quant int8)
            from kvlab.quant.linear import PackedTensor

            inter = quant.interleave(PackedTensor(fmt, (out, n), blocks))[1]

            def call8(m, fid=ids[fmt + "x16"]):
                matmul(fid, m.data_ptr(), 0, x.data_ptr(), y.data_ptr(), rows, n, out, out, threads)

            found.append(Kernel(f"{fmt} i8", copies(inter.clone, inter.numel(), working_set), call8))
    return found


def measure(kernels: list[Kernel], repeats: int, sample_s: float) -> dict[str, float]:
    """Median seconds per call of each kernel; kernels alternate within every repeat."""
    calls = {}
    for k in kernels:  # warm-up, and calls per sample from the warm-up's time
        k.run(max(1, len(k.matrices)))
        calls[k.name] = max(len(k.matrices), int(sample_s / max(k.run(len(k.matrices)), 1e-7)))
    samples: dict[str, list[float]] = {k.name: [] for k in kernels}
    for _ in range(repeats):
        for k in kernels:
            samples[k.name].append(k.run(calls[k.name]))
    return {name: statistics.median(s) for name, s in samples.items()}


def kernel_table(args) -> list[dict]:
    results = []
    print(f"{'shape':>20} {'rows':>4} {'kernel':>9} {'µs':>9} {'GB/s':>6} {'vs f32':>7}")  # GB/s: bytes held
    for model, shapes in SHAPES.items():
        for out, n in shapes:
            for rows in args.rows:
                kernels = kernels_for(out, n, rows, args.formats, args.threads, args.working_set_mb << 20, args.int8)
                times = measure(kernels, args.repeats, args.sample_s)
                base = times["f32 GEMV"]
                for k in kernels:
                    t = times[k.name]
                    row = {"model": model, "out": out, "in": n, "rows": rows, "kernel": k.name, "us": t * 1e6,
                           "gb_s": k.bytes / t / 1e9, "speedup_vs_f32": base / t, "bytes": k.bytes}  # fmt: skip
                    results.append(row)
                    print(f"{f'{out}x{n}':>20} {rows:>4} {k.name:>9} {t * 1e6:9.1f} {row['gb_s']:6.1f} "
                          f"{base / t:6.2f}x", flush=True)  # fmt: skip
                del kernels
    return results


def decode_runs(args) -> dict:
    """Whole-model decode tok/s: the file's blocks vs --dequantize, alternating processes."""
    kvlab = Path(sys.executable).with_name("kvlab")
    base = [str(kvlab), "run", args.model, "The capital of France is", "--max-tokens", "64", "--ignore-eos",
            "--json", "--threads", str(args.threads)]  # fmt: skip
    runs: dict[str, list[dict]] = {"native": [], "dequantize": []}
    for _ in range(args.decode_repeats):
        for mode, extra in (("native", []), ("dequantize", ["--dequantize"])):
            out = subprocess.run(base + extra, check=True, capture_output=True, text=True).stdout
            runs[mode].append(json.loads(out))
    summary = {}
    for mode, outs in runs.items():
        tok_s = [o["decode_tok_s"] for o in outs]
        summary[mode] = {"decode_tok_s_median": statistics.median(tok_s), "min": min(tok_s), "max": max(tok_s),
                         "weight_format": outs[0]["weight_format"], "weight_bytes": outs[0]["weight_bytes"],
                         "load_s_median": statistics.median(o["load_s"] for o in outs)}  # fmt: skip
        s = summary[mode]
        print(f"{args.model} {mode:>10}: decode {s['decode_tok_s_median']:6.1f} tok/s ({s['min']:.1f}-{s['max']:.1f}), "
              f"{s['weight_format']}, {s['weight_bytes'] / 1e6:.0f} MB of weights, load {s['load_s_median']:.2f} s")  # fmt: skip
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", nargs="+", default=QUANTIZED, choices=QUANTIZED + ["F16", "BF16"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 16])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--sample-s", type=float, default=0.03, help="seconds of calls per sample")
    p.add_argument("--working-set-mb", type=int, default=768, help="MB each kernel cycles through (more than the L3)")
    p.add_argument("--int8", action="store_true",
                   help="also each format interleaved for 8-bit activations (--activation-quant int8; '<fmt> i8')")
    p.add_argument("--decode", action="store_true", help="also a whole model's decode, native vs --dequantize")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--decode-repeats", type=int, default=3)
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--huge-pages", action="store_true", help="the matrices in 2 MB pages, as a loaded model's weights")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()
    global HUGE_PAGES
    HUGE_PAGES = args.huge_pages
    if not quant.available():
        print("the C kernels are not built here (no compiler?)", file=sys.stderr)
        return 2
    machine = {"cpu": cpu_model(), "python": platform.python_version(), "torch": torch.__version__,
               "threads": args.threads, "command": " ".join(sys.argv)}  # fmt: skip
    print(f"# {machine['cpu']}, {args.threads} threads, working set {args.working_set_mb} MB per kernel")
    results = {"machine": machine}
    if not args.skip_kernels:
        results["kernels"] = kernel_table(args)
    if args.decode:
        results["decode"] = decode_runs(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
