"""Experiment `roofline`: is decode limited by memory bandwidth and prefill by arithmetic?

1. Read bandwidth: the median time to sum a large float32 tensor (≥ 1 GiB, ≤ 1/4 of free RAM), which
   reads every byte once and computes almost nothing.
2. Decode: 16 steps at context 64. Bytes read per step = the weights a step streams + the KV cache.
3. Prefill: one 1,024-token prompt. FLOPs = 2 × matmul params × tokens (+ the LM head once) + attention.
Arithmetic intensity = FLOPs ÷ bytes read; a phase below the machine's ridge point (compute ÷
bandwidth) waits for memory. The bandwidth also predicts decode's best case: bandwidth ÷ bytes per step.
4. The arithmetic roof: the best rate a loop of float32 FMAs reaches on the lab's threads (kernels/probe.c,
   2 FLOPs a multiply-add), against which prefill's and decode's FLOP/s are shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.kv.cache import ContiguousKVCache
from kvlab.lab.common import Lab, Timing, meminfo_bytes, time_decode, time_prefill
from kvlab.lab.report import gb, held, md_table, num, pct, spread
from kvlab.lab.sources import BLOG_POST

NAME = "roofline"
TITLE = "The memory wall: bandwidth, FLOP/s and arithmetic intensity"
CLAIM = (
    "A decode step reads every weight once and does about two operations per weight, so it runs at the "
    "speed memory delivers bytes, close to the machine's read bandwidth, while using a small fraction "
    "of the arithmetic prefill reaches; bandwidth ÷ bytes per token predicts decode's best speed."
)
SOURCE = BLOG_POST
MEASURED = "Qwen2.5-0.5B float32: sum 83 GB/s; decode reads weights at 72 GB/s (87%); prefill 1,600 GFLOP/s vs decode 36"

GIB = 2**30
DECODE_CONTEXT, QUICK_DECODE_CONTEXT = 64, 8
DECODE_STEPS, QUICK_DECODE_STEPS = 16, 4
PREFILL_TOKENS, QUICK_PREFILL_TOKENS = 1024, 16


@dataclass
class Bandwidth:
    bytes: int  # size of the summed tensor
    timing: Timing  # seconds per sum
    gb_s: float  # bytes ÷ median seconds, in 1e9 bytes per second
    best_gb_s: float  # bytes ÷ fastest run


@dataclass
class PhaseCost:
    name: str  # decode | prefill
    new_tokens: int  # tokens in one forward pass
    context: int  # tokens cached before the pass
    timing: Timing  # seconds per forward pass
    flops: float  # per pass
    bytes_read: int  # per pass: weights streamed + KV cache read
    flop_s: float
    bytes_s: float  # bytes_read ÷ seconds
    intensity: float  # FLOPs per byte read


@dataclass
class RooflineResult:
    bandwidth: Bandwidth
    decode: PhaseCost
    prefill: PhaseCost
    decode_share_of_bandwidth: float  # decode bytes/s ÷ bandwidth
    predicted_decode_tok_s: float  # bandwidth ÷ bytes per decode step
    measured_decode_tok_s: float
    ridge_intensity: float  # FLOP/byte where prefill's FLOP/s meets the bandwidth roof
    notes: list[str] = field(default_factory=list)
    mac_roof_g: float = 0.0  # the FMA loop's G MAC/s on roof_threads threads (0: not measured)
    roof_threads: int = 0


@dataclass
class MacRoof:
    threads: int = 0  # the lab's threads (torch's, which the engines it builds use); 0: not measured
    g_mac_s: float = 0.0  # the FMA loop's best rate on those threads, 1e9 multiply-adds a second
    one_g_mac_s: float = 0.0  # on one thread


def measure_bandwidth(lab: Lab) -> Bandwidth:
    available = meminfo_bytes("MemAvailable") or 8 * GIB
    size = 64 * 2**20 if lab.quick else max(min(2 * GIB, available // 4), min(GIB, available // 4))
    x = torch.ones(size // 4, dtype=torch.float32)  # ones(): every page is written, so really in RAM
    timing = lab.measure(lambda: x.sum(), repeat=max(lab.repeat, 5))
    return Bandwidth(size, timing, size / timing.median_s / 1e9, size / timing.min_s / 1e9)


def measure_mac_roof(lab: Lab) -> MacRoof:
    """The arithmetic roof (kernels/probe.py): the best rate a loop of float32 FMAs reaches on the lab's
    threads and on one. Zeros where the kernels are not built, or the model is not on the CPU (whose
    vector units do not bound a GPU's passes)."""
    from kvlab.kernels.probe import mac_rate

    if lab.model.device.type != "cpu":
        return MacRoof()
    seconds, threads = (0.05 if lab.quick else 0.3), torch.get_num_threads()
    rate = mac_rate(threads, seconds) or 0.0
    return MacRoof(threads, rate, (rate if threads == 1 else mac_rate(1, seconds)) or 0.0)


def pass_cost(lab: Lab, name: str, new: int, context: int, timing: Timing) -> PhaseCost:
    """FLOPs and bytes of a forward over `new` tokens after `context` cached ones (logits of the last only)."""
    c = lab.config
    layers, head = lab.model.matmul_macs_per_token()
    pairs = new * context + new * (new + 1) / 2  # (query, key) pairs a causal pass scores
    attention = 4 * c.num_layers * c.num_heads * c.head_dim * pairs  # q·k and weights·v, 2 FLOPs each
    flops = 2 * layers * new + 2 * head + attention
    kv_per_token = ContiguousKVCache.bytes_per_token_for(c, lab.model.dtype)  # the lab's caches are contiguous
    bytes_read = lab.loaded.decode_weight_bytes() + kv_per_token * (context + new)
    seconds = timing.median_s
    return PhaseCost(name, new, context, timing, flops, bytes_read, flops / seconds, bytes_read / seconds,
                     flops / bytes_read)  # fmt: skip


@torch.inference_mode()
def run(lab: Lab) -> RooflineResult:
    bar = lab.progress(4, NAME)
    bar.set_postfix_str("read bandwidth")
    bandwidth = measure_bandwidth(lab)
    bar.update()
    bar.set_postfix_str("multiply-add rate")
    roof = measure_mac_roof(lab)
    bar.update()

    bar.set_postfix_str("decode")
    context = QUICK_DECODE_CONTEXT if lab.quick else DECODE_CONTEXT
    steps = QUICK_DECODE_STEPS if lab.quick else DECODE_STEPS
    timing, _ = time_decode(lab, context, steps)
    per_step = Timing.of([s / steps for s in timing.samples_s])
    decode = pass_cost(lab, "decode", 1, context + steps // 2, per_step)
    bar.update()

    bar.set_postfix_str("prefill")
    tokens, notes = lab.capped(PREFILL_TOKENS, QUICK_PREFILL_TOKENS)
    prefill = pass_cost(lab, "prefill", tokens, 0, time_prefill(lab, tokens))
    bar.update()
    bar.close()

    bw = bandwidth.gb_s * 1e9
    notes += [
        f"bandwidth: the median of {bandwidth.timing.runs} sums of a {gb(bandwidth.bytes)} float32 tensor",
        "bytes read per pass count the weights once and the KV cache; prefill's true traffic is higher "
        "(activations, weights re-read between tiles), so its intensity is an upper bound",
    ]
    return RooflineResult(
        bandwidth, decode, prefill, decode.bytes_s / bw, bw / decode.bytes_read, 1 / decode.timing.median_s,
        prefill.flop_s / bw, notes, roof.g_mac_s, roof.threads,
    )  # fmt: skip


def table(data: dict) -> str:
    bw = data["bandwidth"]
    head = ["", "time per pass ms (min–max)", "GFLOP per pass", "GFLOP/s", "MB read per pass", "GB/s read",
            "FLOP per byte"]  # fmt: skip
    rows = [["read bandwidth (tensor sum)", spread(bw["timing"]), "–", "–", num(bw["bytes"] / 1e6, 0),
             num(bw["gb_s"]), "–"]]  # fmt: skip
    for p in (data["decode"], data["prefill"]):
        label = f"{p['name']} ({num(p['new_tokens'])} token{'s' if p['new_tokens'] > 1 else ''})"
        rows.append([label, spread(p["timing"]), num(p["flops"] / 1e9), num(p["flop_s"] / 1e9),
                     num(p["bytes_read"] / 1e6, 0), num(p["bytes_s"] / 1e9), num(p["intensity"])])  # fmt: skip
    decode = data["decode"]
    summary = md_table(
        ["decode share of bandwidth", "predicted max decode tok/s", "measured decode tok/s",
         "ms per step at full bandwidth", "measured ms per step", "ridge point FLOP/byte"],
        [[pct(data["decode_share_of_bandwidth"]), num(data["predicted_decode_tok_s"]),
          num(data["measured_decode_tok_s"]), num(decode["bytes_read"] / bw["gb_s"] / 1e6),
          num(decode["timing"]["median_s"] * 1e3), num(data["ridge_intensity"])]],
    )  # fmt: skip
    shares = roof_shares(data)
    if shares:
        roof, prefill, decode = shares
        threads = data["roof_threads"]
        summary += (f"\n\nA loop of float32 FMAs makes {num(roof / 1e9)} GFLOP/s here on {threads} "
                    f"thread{'s' if threads > 1 else ''}: prefill ran at {pct(prefill)} of it, decode at {pct(decode)}.")  # fmt: skip
    return md_table(head, rows) + "\n\n" + summary


def roof_shares(data: dict) -> tuple[float, float, float] | None:
    """(the arithmetic roof in FLOP/s: 2 a multiply-add of the FMA loop, prefill's share of it, decode's);
    None where the roof was not measured (results from before it, or a GPU's run)."""
    roof = 2 * (data.get("mac_roof_g") or 0.0) * 1e9
    if not roof:
        return None
    return roof, data["prefill"]["flop_s"] / roof, data["decode"]["flop_s"] / roof


def verdict(data: dict) -> str:
    share = data["decode_share_of_bandwidth"]
    decode, prefill = data["decode"], data["prefill"]
    compute_gap = prefill["flop_s"] / decode["flop_s"]
    ok_share, ok_gap = share >= 0.5, compute_gap >= 5
    return (
        f"{held(ok_share and ok_gap, ok_share or ok_gap)}: decode read {num(decode['bytes_s'] / 1e9)} GB/s "
        f"of weights and cache, {pct(share)} of the {num(data['bandwidth']['gb_s'])} GB/s a plain sum "
        f"reaches ({SOURCE.short} measured 87%), while doing {num(decode['flop_s'] / 1e9)} GFLOP/s, 1/{num(compute_gap, 0)} "
        f"of prefill's {num(prefill['flop_s'] / 1e9)} ({SOURCE.short}: under 1/40); bandwidth ÷ bytes per step "
        f"predicts at most {num(data['predicted_decode_tok_s'])} tok/s and decode made "
        f"{num(data['measured_decode_tok_s'])}, {pct(data['measured_decode_tok_s'] / data['predicted_decode_tok_s'])} of it."
    ) + arithmetic_roof(data)


def arithmetic_roof(data: dict) -> str:
    """The verdict's sentence on prefill's and decode's shares of the arithmetic roof ("" without one)."""
    shares = roof_shares(data)
    if not shares:
        return ""
    roof, prefill, decode = shares
    return (f" A loop of float32 FMAs makes {num(roof / 1e9)} GFLOP/s here: prefill ran at {pct(prefill)} of "
            f"that arithmetic roof, decode at {pct(decode)}.")  # fmt: skip
