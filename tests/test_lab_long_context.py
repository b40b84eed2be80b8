"""`kvlab lab long-context` on a tiny random llama trained to 512 positions: the position buckets'
perplexities against a direct computation with transformers (one pass over the whole text, no cache,
no chunks), for RoPE as shipped, the YaRN override and the restarted control; the model restored
after; the verdict's arithmetic on given figures."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvlab.cli import main
from kvlab.lab import long_context as lc

TRAINED, TOKENS = 512, 1024  # tiny.build_tiny's max_position_embeddings, and twice it
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": TRAINED}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny import build_tiny

    from kvlab.model.loader import load_model

    directory = build_tiny("llama", tmp_path_factory.mktemp("tiny-long-context"), seed=5)
    return directory, load_model(directory)


@pytest.fixture(scope="module")
def ids():
    return [1] + torch.randint(3, 512, (TOKENS - 1,), generator=torch.Generator().manual_seed(7)).tolist()  # BOS first


def hf_nll(directory, ids: list[int], scaling: dict | None = None) -> torch.Tensor:
    """−log p(ids[i] | ids[:i]) for every i ≥ 1 from transformers' model in one pass."""
    import transformers

    config = transformers.LlamaConfig.from_pretrained(directory)
    if scaling:
        config.rope_parameters = {**scaling, "rope_theta": 10000.0}
    model = transformers.LlamaForCausalLM.from_pretrained(directory, config=config).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)  # [T, V]
    return -logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def direct_buckets(nll: torch.Tensor, edges: list[int]) -> list[float]:
    """Perplexity of each bucket, token by token: the predicted token at position p is scored by nll[p - 1]."""
    out = []
    for lo, hi in zip(edges, edges[1:]):
        scores = [float(nll[p - 1]) for p in range(max(lo, 1), hi)]
        out.append(math.exp(sum(scores) / len(scores)))
    return out


def driver(loaded):
    from kvlab.runner.driver import ModelDriver

    return ModelDriver(loaded.model)


def test_edges_are_quarters_of_the_trained_length():
    assert lc.bucket_edges(TOKENS, TRAINED) == [0, 128, 256, 384, 512, 640, 768, 896, 1024]
    assert lc.bucket_edges(16384, 8192) == list(range(0, 16385, 2048))
    assert lc.bucket_edges(200, 512) == [0, 25, 50, 75, 100, 125, 150, 175, 200]  # a text inside the trained length


@pytest.mark.parametrize("scaling", [None, YARN])
def test_bucket_perplexities_equal_a_direct_computation(tiny, ids, scaling):
    directory, loaded = tiny
    edges = lc.bucket_edges(TOKENS, TRAINED)
    with lc.rotary_for(loaded, TOKENS, scaling) as stretched:
        nll = lc.token_nll(driver(stretched), stretched, ids, chunk=100)  # chunks that do not divide the buckets
    expected = hf_nll(directory, ids, scaling)
    torch.testing.assert_close(nll, expected, rtol=1e-4, atol=1e-4)
    assert lc.bucket_ppl(nll, edges) == pytest.approx(direct_buckets(expected, edges), rel=1e-4)
    assert lc.span_ppl(nll, TRAINED, TOKENS) == pytest.approx(math.exp(float(expected[TRAINED - 1 :].mean())), rel=1e-4)


def test_restarted_control_scores_each_window_from_an_empty_cache(tiny, ids):
    directory, loaded = tiny
    step = TRAINED - 1  # each window: the BOS and 511 tokens
    expected = torch.cat([hf_nll(directory, [1] + ids[w : w + step]) for w in range(1, TOKENS, step)])
    shipped = lc.token_nll(driver(loaded), loaded, ids[:TRAINED], chunk=64)
    got = lc.restarted_nll(driver(loaded), loaded, ids, TRAINED, chunk=64, bos=1)
    reused = lc.restarted_nll(driver(loaded), loaded, ids, TRAINED, chunk=64, bos=1, first=shipped)
    assert len(got) == len(reused) == TOKENS - 1
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(reused, got, rtol=1e-5, atol=1e-5)


def test_restarted_control_without_a_bos_scores_every_token_once(tiny, ids):
    directory, loaded = tiny
    text = ids[1:]  # no BOS: a window starts with the last token of the one before
    got = lc.restarted_nll(driver(loaded), loaded, text, TRAINED, chunk=64, bos=None)
    assert len(got) == len(text) - 1
    first = hf_nll(directory, text[:TRAINED])  # the first window: tokens 0 … 511
    second = hf_nll(directory, text[TRAINED - 1 : 2 * TRAINED - 1])  # the second: 511 … 1,022
    torch.testing.assert_close(got, torch.cat([first, second]), rtol=1e-4, atol=1e-4)


def test_the_model_is_restored_after_a_stretched_pass(tiny):
    _, loaded = tiny
    before = loaded.model.rotary.cos.clone()
    with lc.rotary_for(loaded, TOKENS, YARN) as stretched:
        assert stretched.model.rotary.cos.shape[0] == TOKENS and stretched.config.rope.type == "yarn"
        assert stretched.config.max_position_embeddings == TRAINED
    assert loaded.model.config is loaded.config and loaded.model.rotary.cos.shape[0] == TRAINED
    assert torch.equal(loaded.model.rotary.cos, before)


def test_lab_run_writes_three_series_and_restores_the_model(tiny, tmp_path):
    directory, _ = tiny
    from tiny import add_tiny_tokenizer

    add_tiny_tokenizer(directory)
    assert main(["lab", "long-context", "--model", str(directory), "--out", str(tmp_path), "--threads", "1",
                 "--no-progress"]) == 0  # fmt: skip
    data = json.loads((tmp_path / "results.json").read_text())["experiments"]["long-context"]
    assert data["trained"] == TRAINED and data["tokens"] == TOKENS and data["edges"][4] == TRAINED
    assert [s["kind"] for s in data["series"]] == ["shipped", "yarn", "restarted"]
    assert data["rope_scaling"] == YARN
    shipped, yarn, restarted = data["series"]
    assert shipped["ppl"][:4] == restarted["ppl"][:4]  # inside the trained length the control is the same pass
    assert shipped["ppl"][4:] != yarn["ppl"][4:]
    report = (tmp_path / "report.md").read_text()
    assert "(long-context.png)" in report and "past trained" in report and "Python" in data["text"]


def figures(plain_past: float, yarn_past: float, control_past: float = 10.0) -> dict:
    def series(kind, label, past):
        return {"kind": kind, "label": label, "rope": "", "ppl": [10.0, 10.0, past, past], "ppl_inside": 10.0,
                "ppl_past": past, "seconds": 1.0}  # fmt: skip

    return {"trained": 100, "tokens": 200, "text": "t", "edges": [0, 50, 100, 150, 200], "rope_scaling": YARN,
            "notes": [], "series": [series("shipped", "as shipped", plain_past), series("yarn", "YaRN ×2", yarn_past),
                                    series("restarted", "restarted every 100", control_past)]}  # fmt: skip


def test_verdict_says_where_plain_rope_breaks_and_whether_yarn_holds():
    text = lc.verdict(figures(plain_past=300.0, yarn_past=11.0))
    assert text.startswith("Held:") and "300 against 10.0" in text and "from position 100 (30×" in text
    assert "YaRN ×2 held it at 11.0" in text
    assert lc.verdict(figures(plain_past=300.0, yarn_past=40.0)).startswith("Partly held:")
    assert lc.verdict(figures(plain_past=11.0, yarn_past=11.0)).startswith("Partly held:")  # YaRN fine, plain too
    assert lc.verdict(figures(plain_past=15.0, yarn_past=40.0)).startswith("Did not hold:")
    assert "| 100–149 (past trained) | 300 | 11.0 | 10.0 |" in lc.table(figures(300.0, 11.0))
