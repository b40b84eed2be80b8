"""`kvlab lab batching`'s engine decode steps on a tiny random model: what is measured, and a verdict
that follows the numbers.

The structure test runs the real measurement (the serving engine, B requests, consecutive steps) and
checks what ran: every timed step was exactly B one-token decode rows, on the decode path the engine
chose for the model. The verdict tests inject the step times (Lab.measure replaced by a cost curve of
B), so they say the same on a quiet machine and a busy one; no test asserts a timing.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from kvlab.kernels import gemv
from kvlab.lab import batching, decode_steps
from kvlab.lab.common import Lab, Timing
from kvlab.kv.paged import PagedKVCache
from kvlab.lab.report import num, pct, ratio, verdict_text
from kvlab.model.loader import load_model


@pytest.fixture(scope="module")
def lab(tiny_chat_model, one_thread):
    return Lab(load_model(tiny_chat_model), "tiny", repeat=2, quick=True, show_progress=False)


def test_engine_decode_steps_are_b_one_token_rows_on_the_engine_path(lab):
    from kvlab.backends import choose_decode_path

    data = asdict(batching.run(lab))
    steps = data["decode_steps"]
    assert [p["sequences"] for p in steps] == list(batching.QUICK_DECODE_BATCHES)
    assert data["decode_context"] == batching.QUICK_DECODE_CONTEXT
    runs = 1 + lab.repeat  # the warm-up and the timed runs, each steps_per_run consecutive steps
    for p in steps:
        assert p["pure_decode"], p  # B decode rows of one token, no prompt chunk, in every step
        assert p["steps_per_run"] == decode_steps.QUICK_DECODE_STEPS
        assert p["timed_steps"] == runs * p["steps_per_run"]
        assert p["step"]["runs"] == lab.repeat and p["tok_s"] > 0
    assert steps[0]["relative_cost"] == 1.0
    assert all(p["relative_cost"] == p["step"]["median_s"] / steps[0]["step"]["median_s"] for p in steps)
    # the path `kvlab serve` would take for this model: the decode backend for every step, or the modules
    backend = choose_decode_path(lab.model).backend is not None
    assert data["decode_path"].startswith("decode on ")
    assert all(p["backend_steps"] == (p["timed_steps"] if backend else 0) for p in steps), (data["decode_path"], steps)
    # what each step read and multiplied: the weights a decode step streams, the sequences' K/V, B tokens' products
    assert data["bandwidth_gb_s"] > 0
    weights, macs = lab.loaded.decode_weight_bytes(), sum(lab.model.matmul_macs_per_token())
    per_token = PagedKVCache.bytes_per_token_for(lab.config, lab.model.dtype)
    for p in steps:
        median = p["step"]["median_s"]
        assert p["read_bytes"] - weights >= p["sequences"] * batching.QUICK_DECODE_CONTEXT * per_token  # K/V
        assert p["read_gb_s"] == pytest.approx(p["read_bytes"] / median / 1e9)
        assert p["gmac_s"] == pytest.approx(p["sequences"] * macs / median / 1e9)
    # the arithmetic roof: the FMA loop's rate on the engine's threads and on one; the exact products here
    assert data["roof_threads"] == torch.get_num_threads() and data["activation_quant"] == ""
    if gemv.gemv_available():
        assert data["mac_roof_g"] > 0 and data["mac_roof_one_g"] > 0
    table = batching.table(data)
    assert "ms per engine step" in table and "seed" in table and "ms per pass" in table
    assert "GB/s read" in table and "A plain sum reads" in table
    assert verdict_text(batching, data, quick=True).startswith("Not judged (quick run)")


@pytest.mark.parametrize(
    "per_extra_sequence, word",
    [
        (0.05, "Held"),  # 10 sequences: 1.45× one
        (0.12, "Held"),  # 2.08×: above the seed's 1.86×, within its 15% noise margin (2.14×)
        (0.2, "Partly held"),  # 2.8×: beyond the margin
        (0.3, "Partly held"),  # 3.7×: batching pays, but not as the seed says
        (1.0, "Did not hold"),  # 10×: ten sequences cost ten steps
    ],
)
def test_verdict_follows_injected_step_times(lab, monkeypatch, per_extra_sequence, word):
    """A step of B sequences costs 20 ms × (1 + k·(B − 1)): the verdict's word is fixed by k alone."""
    engines = []
    real_engine = batching.decode_engine

    def spy_engine(*args):
        engines.append(real_engine(*args))
        return engines[-1]

    def fake_measure(run, setup=None, repeat=None):
        if setup:
            setup()
        run()  # the real steps run (their checks count), their time is replaced
        b = engines[-1].num_running if engines and engines[-1].has_unfinished_requests else 1
        steps = decode_steps.QUICK_DECODE_STEPS
        return Timing.of([0.020 * (1 + per_extra_sequence * (b - 1)) * steps] * 3)

    monkeypatch.setattr(batching, "decode_engine", spy_engine)
    monkeypatch.setattr(lab, "measure", fake_measure)
    data = asdict(batching.run(lab))
    ten = next(p for p in data["decode_steps"] if p["sequences"] == 10)
    assert ten["relative_cost"] == pytest.approx(1 + 9 * per_extra_sequence)
    expected = ("Held" if ten["relative_cost"] <= batching.SEED_RATIO * (1 + batching.NOISE)
                else "Partly held" if ten["relative_cost"] < 5 else "Did not hold")  # fmt: skip
    assert expected == word
    text = verdict_text(batching, data, quick=False)
    assert text.startswith(word + ":"), text
    assert ratio(ten["relative_cost"]) in text and "1.9×" in text  # measured and the seed's, side by side
    assert verdict_text(batching, data, quick=True).startswith("Not judged (quick run)")


def point(b: int, ms: float, one_ms: float, pure: bool = True, read_mb: float = 0, macs_per_token: int = 0) -> dict:
    return asdict(decode_steps.decode_step_point(b, Timing.of([ms / 1e3]), 8, 32, 32, pure, one_ms / 1e3,
                                                 int(read_mb * 1e6), b * macs_per_token))  # fmt: skip


def test_verdict_needs_pure_decode_steps_and_a_ten_sequence_point():
    base = {"passes": [], "sequences": [], "decode_path": "decode on c-step"}
    good = [point(1, 28, 28), point(10, 50, 28)]
    assert batching.verdict({**base, "decode_steps": good}).startswith("Held:")
    mixed = [point(1, 28, 28), point(10, 50, 28, pure=False)]  # a prompt chunk rode along: not a decode step
    assert batching.verdict({**base, "decode_steps": mixed}).startswith("Did not hold:")
    assert batching.verdict({**base, "decode_steps": [point(1, 28, 28), point(8, 40, 28)]}).startswith("Not judged")
    seed = [point(1, batching.SEED_ONE_MS, 28), point(10, batching.SEED_TEN_MS, 28), point(16, 80, 28)]
    text = batching.verdict({**base, "decode_steps": seed})
    assert text.startswith("Held:") and "at 16 sequences 2.9×" in text and "≤ 2.5×" in text


@pytest.mark.parametrize(
    "one_ms, reason",
    [
        (3.0, "waits on memory"),  # 100 MB in 3 ms: 33 GB/s, 83% of the 40 a plain sum reads
        (10.0, "goes to arithmetic"),  # 100 MB in 10 ms: 10 GB/s, 25%: the step's time is not the read
    ],
)
def test_verdict_says_why_from_the_read_rate_against_the_bandwidth(one_ms, reason):
    """The 1-sequence step's read rate against a plain sum's says whether a step waits on memory (batching
    rides on its read) or on arithmetic (each sequence adds its own); the rates are the points' own."""
    macs = 135_000_000
    steps = [point(1, one_ms, one_ms, read_mb=100, macs_per_token=macs),
             point(10, 3 * one_ms, one_ms, read_mb=110, macs_per_token=macs),
             point(16, 5 * one_ms, one_ms, read_mb=116, macs_per_token=macs)]  # fmt: skip
    data = {"passes": [], "sequences": [], "decode_path": "decode on c-step", "decode_steps": steps,
            "bandwidth_gb_s": 40.0}  # fmt: skip
    text = batching.verdict(data)
    assert text.startswith("Partly held:") and "Why: one sequence's step read 100 MB" in text, text
    assert reason in text
    assert f"at {num(100 / one_ms)} GB/s, {pct(100 / one_ms / 40)} of the 40.0 GB/s" in text  # rate, share
    assert "3.2× one sequence's" in text  # 16 sequences' products: 16 / 5 of one's rate
    assert ("waits on memory" in text) != ("goes to arithmetic" in text)
    # results saved before the rates were measured: the verdict and the table as they were
    old = {**data, "decode_steps": [point(1, one_ms, one_ms), point(10, 3 * one_ms, one_ms)]}
    del old["bandwidth_gb_s"]
    assert "Why" not in batching.verdict(old) and "GB/s read" not in batching.table(old)


def test_verdict_sets_the_step_against_the_multiply_add_roof():
    """With the FMA loop's rate measured, the verdict says the least time the big step's multiply-adds take
    at it (exact products), against the 1-sequence step; with --activation-quant, that it does not bind."""
    macs = 135_000_000  # a token's multiply-adds: 16 sequences make 2.16 G a step
    steps = [point(1, 10.0, 10.0, read_mb=100, macs_per_token=macs),
             point(10, 30.0, 10.0, read_mb=110, macs_per_token=macs),
             point(16, 50.0, 10.0, read_mb=116, macs_per_token=macs)]  # fmt: skip
    data = {"passes": [], "sequences": [], "decode_path": "decode on c-step", "decode_steps": steps,
            "bandwidth_gb_s": 40.0, "mac_roof_g": 100.0, "mac_roof_one_g": 90.0, "roof_threads": 2}  # fmt: skip
    text = batching.verdict(data)
    # 2.16 G at 100 G MAC/s: 21.6 ms, 2.2× the 10 ms step; the step's own 43.2 G MAC/s are 43% of the roof
    assert "the 2.16 G multiply-adds of a 16-sequence step take at least 21.6 ms" in text, text
    assert "2.2× the 1-sequence step" in text and "ran at 43% of it" in text
    assert "100 G MAC/s on 2 threads (90.0 on one: the threads shared one core's units)" in text
    assert "on one)" in batching.verdict({**data, "mac_roof_one_g": 50.0})  # two cores: no sharing said
    quantized = batching.verdict({**data, "activation_quant": "int8"})
    assert "--activation-quant int8's products are integer or bfloat16 ones, which it does not bound" in quantized
    assert "take at least" not in quantized
    assert "G MAC/s on" not in batching.verdict({**data, "mac_roof_g": 0.0})  # not measured: not said
    assert "A loop of float32 FMAs makes 100 G MAC/s here on 2 threads (90.0 on one)." in batching.table(data)
