"""Experiment `moe`: does a mixture of experts decode as fast as a dense model of its *active* size?

Two GGUF files are written (kvlab/lab/moe_gguf.py) with random Q4_0 blocks — the values are noise; the
bytes and shapes are a real model's, and speed does not depend on the values: Qwen3-30B-A3B's layer
shape (hidden 2048, 128 experts of width 768, 8 active, GQA 32/4 of 128; 4 of its 48 layers, an 8,192-token
head), and its dense twin (the same attention, one MLP as wide as the 8 active experts: the same active
parameters per token). Each is decoded on `kvlab run`'s path (the serving engine; the C decode step) at
1, 4 and 16 sequences after a 64-token prompt, and prefilled over 256 tokens.

The bytes a decode step reads: attention, the head, and the experts the step's rows chose — at one
sequence top_k of E per layer; at B sequences, the experts any of them chose, E·(1 − (1 − k/E)^B) per
layer when routing is even (random weights route evenly). Bandwidth ÷ those bytes is the prediction.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvlab.lab.common import Lab, Timing, time_prefill
from kvlab.lab.moe_gguf import QWEN3_30B_A3B, TINY_MOE, LayerShape, dense_twin, write_random_gguf
from kvlab.lab.report import held, md_table, num, ratio, spread
from kvlab.lab.sources import Source

NAME = "moe"
TITLE = "Mixture of experts: speed by active parameters"
SOURCE = Source("kvlab's founding notes on inference cost (note 004), which end on mixture-of-experts models",
                "the notes")
CLAIM = (
    "A mixture-of-experts model reads only the experts each token chooses, so a 35B-A3B model should decode "
    "about as fast as a 3B dense model; but activated parameters per token \"cannot be directly converted into "
    "tokens/second\", and the claim is \"merely a performance hypothesis awaiting verification\"."
)
MEASURED = "nothing: the notes state the hypothesis and ask for the measurement"
BATCHES, QUICK_BATCHES = (1, 4, 16), (1, 4)
CONTEXT, QUICK_CONTEXT = 64, 8
PREFILL, QUICK_PREFILL = 256, 16


@dataclass
class BatchPoint:
    sequences: int
    step: Timing  # seconds per decode step (one token of each sequence)
    tok_s: float
    experts_read: float  # experts per layer the step's rows chose (expected, even routing; dense: 0)
    bytes_per_step: int  # weight bytes the step reads
    predicted_tok_s: float  # sequences × bandwidth ÷ bytes per step
    backend_steps: int  # of the timed steps, those the C decode step ran


@dataclass
class ModelPoint:
    label: str
    shape: dict  # LayerShape's fields
    weight_bytes: int  # held (the file's tensors)
    active_bytes: int  # one sequence's decode step reads
    decode: list[BatchPoint]
    prefill_tokens: int
    prefill: Timing
    prefill_tok_s: float


@dataclass
class MoeResult:
    bandwidth_gb_s: float
    models: list[ModelPoint]  # the mixture of experts, then its dense twin
    notes: list[str] = field(default_factory=list)


def expected_experts(experts: int, top_k: int, sequences: int) -> float:
    """Experts of E that at least one of B rows chooses, k each, routing even: E·(1 − (1 − k/E)^B)."""
    return experts * (1 - (1 - top_k / experts) ** sequences)


def step_bytes(loaded, sequences: int) -> tuple[int, float]:
    """(weight bytes a decode step of B sequences reads, experts per layer read): everything but the
    experts once, and each expert any row chose once."""
    from kvlab.model.experts import Experts

    banks = [m for m in loaded.model.modules() if isinstance(m, Experts)]
    if not banks:
        return loaded.decode_weight_bytes(), 0.0
    chosen = expected_experts(banks[0].num_experts, banks[0].top_k, sequences)
    rest = loaded.decode_weight_bytes() - sum(b.bytes_read_per_token() for b in banks)
    return int(rest + sum(b.nbytes() / b.num_experts * chosen for b in banks)), chosen


@torch.inference_mode()
def run(lab: Lab) -> MoeResult:
    from kvlab.lab.roofline import measure_bandwidth
    from kvlab.model.loader import load_model

    moe = TINY_MOE if lab.quick else QWEN3_30B_A3B
    batches = QUICK_BATCHES if lab.quick else BATCHES
    bar = lab.progress(1 + 2 * (len(batches) + 1), NAME)
    bar.set_postfix_str("read bandwidth")
    bandwidth = measure_bandwidth(lab).gb_s * 1e9
    result = MoeResult(bandwidth / 1e9, [], notes=[
        "random Q4_0 blocks: the values are noise; the bytes and shapes are the model's, and speed does not "
        "depend on the values (random router weights spread the tokens evenly over the experts)",
        f"{moe.layers} decoder layers and a {num(moe.vocab)}-token head: the layers weigh what they weigh in the "
        "whole model, not the head",
    ])  # fmt: skip
    bar.update()
    with tempfile.TemporaryDirectory(prefix="kvlab-lab-moe-") as tmp:
        for label, shape in (("moe", moe), ("dense", dense_twin(moe))):
            bar.set_postfix_str(f"writing the {label} file")
            path = write_random_gguf(shape, Path(tmp) / f"{label}.gguf", "Q4_0", seed=lab.seed)
            loaded = load_model(path)
            sub = dataclasses.replace(lab, loaded=loaded, model_name=shape.name)
            result.models.append(measure_model(sub, label, shape, batches, bandwidth, bar))
            bar.save(result)
            del loaded, sub
            path.unlink()
    bar.close()
    return result


def measure_model(lab: Lab, label: str, shape: LayerShape, batches, bandwidth: float, bar) -> ModelPoint:
    from kvlab.lab.decode_steps import decode_engine, time_decode_steps

    loaded = lab.loaded
    context = QUICK_CONTEXT if lab.quick else CONTEXT
    engine = decode_engine(lab, max(batches), context)
    decode = []
    for b in batches:
        bar.set_postfix_str(f"{label}: decode at {b}")
        step = time_decode_steps(lab, engine, b, context)
        nbytes, chosen = step_bytes(loaded, b)
        decode.append(BatchPoint(b, step.step, step.tok_s, chosen, nbytes, b * bandwidth / nbytes, step.backend_steps))
        bar.update()
    n = QUICK_PREFILL if lab.quick else PREFILL
    bar.set_postfix_str(f"{label}: prefill {n}")
    timing = time_prefill(lab, n)
    point = ModelPoint(label, dataclasses.asdict(shape), loaded.weight_bytes, loaded.decode_weight_bytes(), decode, n,
                       timing, n / timing.median_s)  # fmt: skip
    bar.update()
    return point


# ---- the report ---------------------------------------------------------------------------------


def table(data: dict) -> str:
    head = ["model", "sequences", "ms per step (min–max)", "decode tok/s", "experts read / layer",
            "weight MB per step", "predicted tok/s", "share of prediction"]  # fmt: skip
    rows = []
    for m in data["models"]:
        for d in m["decode"]:
            rows.append([_name(m), num(d["sequences"]), spread(d["step"]), num(d["tok_s"]),
                         num(d["experts_read"], 1) if m["shape"]["experts"] else "—", num(d["bytes_per_step"] / 1e6),
                         num(d["predicted_tok_s"]), f"{d['tok_s'] / d['predicted_tok_s']:.0%}"])  # fmt: skip
    decode = md_table(head, rows)
    head = ["model", "weights held MB", "read by one sequence's step MB", f"prefill tok/s ({'prompt tokens'})"]
    rows = [[_name(m), num(m["weight_bytes"] / 1e6), num(m["active_bytes"] / 1e6),
             f"{num(m['prefill_tok_s'])} ({num(m['prefill_tokens'])})"] for m in data["models"]]  # fmt: skip
    return decode + "\n\n" + md_table(head, rows) + f"\n\nRead bandwidth: {num(data['bandwidth_gb_s'])} GB/s."


def _name(m: dict) -> str:
    s = m["shape"]
    if s["experts"]:
        return f"MoE {s['experts']}×{s['expert_size']}, top {s['top_k']}"
    return f"dense, MLP {num(s['intermediate'])}"


def verdict(data: dict) -> str:
    moe, dense = data["models"]
    one = lambda m: m["decode"][0]  # noqa: E731
    r = one(moe)["tok_s"] / one(dense)["tok_s"]
    predicted = one(moe)["predicted_tok_s"] / one(dense)["predicted_tok_s"]
    text = (f"{held(r >= 0.9, r >= 0.6)}: at one sequence the {moe['shape']['name']} file decoded "
            f"{num(one(moe)['tok_s'])} tok/s "
            f"and its dense twin with the same active parameters {num(one(dense)['tok_s'])}: ratio {ratio(r)}; "
            f"predicted from the bytes each step reads: {ratio(predicted)}.")  # fmt: skip
    if len(moe["decode"]) > 1:
        last_m, last_d = moe["decode"][-1], dense["decode"][-1]
        text += (f" At {last_m['sequences']} sequences the steps read {num(last_m['experts_read'], 1)} experts a layer "
                 f"and the ratio is {ratio(last_m['tok_s'] / last_d['tok_s'])} (predicted "
                 f"{ratio(last_m['predicted_tok_s'] / last_d['predicted_tok_s'])}).")  # fmt: skip
    return text + (f" Prefill: {num(moe['prefill_tok_s'])} against {num(dense['prefill_tok_s'])} tok/s "
                   f"({ratio(moe['prefill_tok_s'] / dense['prefill_tok_s'])}).")  # fmt: skip
