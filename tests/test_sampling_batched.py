"""The batched sampler (issue 16 point 3, issue 15 point 4): penalties by OpenAI's formula, logit_bias,
exact filtered distributions without a full sort, a step's rows together equal to each alone,
choices seeded seed + index, log-probabilities of the processed distribution."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.errors import KvlabError
from kvlab.sampling.draw import SLACK, draw, filtered_probabilities
from kvlab.sampling.logprobs import token_logprobs
from kvlab.sampling.params import SamplingParams, StructuredOutputs
from kvlab.sampling.penalties import penalize
from kvlab.sampling.sampler import BatchSampler, choice_seed, greedy_tokens


class Row:
    """What the sampler reads of a request."""

    def __init__(self, rid: str, params: SamplingParams, prompt=(), index: int = 0, fork_ids=()):
        self.request_id, self.params, self.prompt_token_ids = rid, params, list(prompt)
        self.index, self.fork_ids, self.num_output_tokens = index, tuple(fork_ids), 0


def dense_reference(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The filters by a full sort (transformers' order): the distribution the fast path must equal."""
    x = logits.double().clone()
    if 0 < top_k < x.numel():
        x[x < torch.topk(x, top_k).values[-1]] = -math.inf
    if top_p < 1:
        s, order = torch.sort(x, descending=True)
        p = torch.softmax(s, -1)
        drop = (p.cumsum(-1) - p) >= top_p * (1 - SLACK)  # a mass within rounding of top_p reaches it
        x[order[drop]] = -math.inf
    probs = torch.softmax(x, -1)
    if min_p > 0:
        probs[probs < min_p * probs.max() * (1 - SLACK)] = 0
        probs /= probs.sum()
    return probs


def test_presence_and_frequency_penalties_follow_openais_formula():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25, seed=0)
    sampler = BatchSampler(5)
    row = Row("r", params)
    state = sampler.state("r", params, [])
    state.counts += torch.tensor([3.0, 0.0, 1.0, 0.0, 2.0])  # the output so far: token 0 three times, ...
    expected = torch.tensor([2.0 - 0.75 - 0.5, 1.0, 0.5 - 0.25 - 0.5, -1.0, 0.0 - 0.5 - 0.5])
    assert torch.allclose(penalize(logits, state.counts, 0.5, 0.25), expected)
    assert torch.allclose(sampler.probabilities([row], logits[None])[0], torch.softmax(expected, -1), atol=1e-7)


def test_penalties_count_only_the_sequences_own_output_and_repetition_sees_the_prompt():
    sampler = BatchSampler(4)
    params = SamplingParams(temperature=0, presence_penalty=2.0, repetition_penalty=1.0)
    row = Row("r", params, prompt=[0])
    logits = torch.tensor([[3.0, 2.5, 0.0, 0.0]])
    assert sampler.sample([row], logits).tokens == {"r": 0}  # the prompt's token 0 is not penalised
    assert sampler.sample([row], logits).tokens == {"r": 1}  # once generated it is: 3 - 2 < 2.5
    rep = Row("p", SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0])
    assert sampler.sample([rep], logits).tokens == {"p": 1}  # repetition: 3 / 2 < 2.5


def test_logit_bias_bans_and_forces():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    sampler = BatchSampler(3)
    ban = Row("a", SamplingParams(temperature=0, logit_bias={0: -100}))
    force = Row("b", SamplingParams(temperature=1.0, seed=1, logit_bias={2: 100}))
    out = sampler.sample([ban, force], torch.cat([logits, logits]))
    assert out.tokens == {"a": 1, "b": 2}


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 0.95, 0.0), (0, 0.5, 0.0), (40, 0.9, 0.0), (0, 1.0, 0.05),
                                                 (7, 1.0, 0.0), (0, 0.99, 0.01), (3000, 0.999, 0.0)])  # fmt: skip
@pytest.mark.parametrize("scale", [0.3, 3.0])  # flat (the nucleus holds thousands of tokens) and peaked
def test_filtered_distribution_equals_a_full_sort(top_k, top_p, min_p, scale):
    logits = torch.randn(3, 20_000, generator=torch.Generator().manual_seed(1)) * scale
    ours = filtered_probabilities(logits, [top_k] * 3, [top_p] * 3, [min_p] * 3)
    for i in range(3):
        assert torch.allclose(ours[i].double(), dense_reference(logits[i], top_k, top_p, min_p), atol=1e-6)


def test_draws_follow_the_kept_distribution_and_never_a_dropped_token():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(2)) * 2
    expected = dense_reference(logits[0], 0, 0.8, 0.0)
    n = 20_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    tokens = draw(logits.expand(n, -1), [0] * n, [0.8] * n, [0.0] * n, u)
    counts = torch.bincount(tokens, minlength=1000).double() / n
    assert counts[expected == 0].sum() == 0
    se = (expected * (1 - expected) / n).sqrt()
    assert bool(((counts - expected).abs() <= 4 * se + 1e-9).all())


def test_a_batch_draws_what_each_row_draws_alone():
    params = [SamplingParams(temperature=t, top_p=p, top_k=k, seed=s, frequency_penalty=f)
              for t, p, k, s, f in [(0.8, 0.95, 0, 1, 0.0), (0, 1.0, 0, None, 0.0), (1.2, 1.0, 50, 2, 0.5),
                                    (0.7, 0.9, 0, 3, 0.0), (1.0, 1.0, 0, 4, 1.0)]]  # fmt: skip
    logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(4))
    together, alone = BatchSampler(3000), BatchSampler(3000)
    for _ in range(6):
        rows = [Row(f"r{i}", p) for i, p in enumerate(params)]
        batch = together.sample(rows, logits).tokens
        single = {r.request_id: alone.sample([r], logits[i : i + 1]).tokens[r.request_id] for i, r in enumerate(rows)}
        assert batch == single


def test_forked_choices_draw_with_seed_plus_index():
    params = SamplingParams(temperature=1.0, seed=41, n=3)
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(5))
    out = BatchSampler(500).sample([Row("r", params, fork_ids=["r#1", "r#2"])], logits)
    assert out.forks == {"r": ["r#1", "r#2"]} and set(out.tokens) == {"r", "r#1", "r#2"}
    for i, rid in enumerate(["r", "r#1", "r#2"]):  # choice i is what a lone request seeded 41 + i draws
        lone = BatchSampler(500).sample([Row("x", SamplingParams(temperature=1.0, seed=41 + i))], logits)
        assert lone.tokens["x"] == out.tokens[rid]
    assert choice_seed(2**63 - 1, 1) == -(2**63)  # wraps within int64


def test_logprobs_are_the_processed_distributions_and_raw_is_the_models():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    sampler = BatchSampler(4)
    hot = Row("a", SamplingParams(temperature=0.5, seed=0, logprobs=2))
    raw = Row("b", SamplingParams(temperature=0.5, seed=0, logprobs=2, logprobs_mode="raw"))
    out = sampler.sample([hot, raw], torch.cat([logits, logits]))
    processed, model = torch.log_softmax(logits[0] / 0.5, -1), torch.log_softmax(logits[0], -1)
    for rid, ref in (("a", processed), ("b", model)):
        lp = out.logprobs[rid]
        assert math.isclose(lp.logprob, ref[out.tokens[rid]].item(), abs_tol=1e-6)
        assert [t for t, _ in lp.top] == [0, 1] and math.isclose(lp.top[0][1], ref[0].item(), abs_tol=1e-6)
        assert lp.rank == int((ref > ref[out.tokens[rid]]).sum()) + 1


def test_token_logprobs_rank_and_top():
    rows = torch.tensor([[0.0, 3.0, 1.0]])
    (lp,) = token_logprobs(rows, [2], [3])
    assert lp.rank == 2 and [t for t, _ in lp.top] == [1, 2, 0]
    assert math.isclose(sum(math.exp(v) for _, v in lp.top), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize("kwargs, word", [({"n": 0}, "n"), ({"n": 3, "best_of": 2}, "best_of"), ({"logprobs": 21}, "logprobs"),
                                          ({"presence_penalty": 2.5}, "presence_penalty"), ({"logit_bias": {1: 101}}, "logit_bias"),
                                          ({"logit_bias": {-1: 1}}, "logit_bias"), ({"logprobs_mode": "x"}, "logprobs_mode"),
                                          ({"structured_outputs": StructuredOutputs(regex="a"), "ignore_eos": True}, "ignore_eos")])  # fmt: skip
def test_new_params_are_checked(kwargs, word):
    with pytest.raises(KvlabError, match=word):
        SamplingParams(**kwargs)


def test_structured_outputs_take_exactly_one_form():
    with pytest.raises(KvlabError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    assert StructuredOutputs(choice=["a", "b"]).choice == ("a", "b")


@pytest.mark.parametrize("ops", ["torch", "cpu"])
def test_greedy_tokens_are_argmax_ties_nan_and_infinities_included(ops):
    """The greedy picks (PyTorch's `max(...).indices`; on a CPU the C kernel's rows over two threads) are
    what `argmax` picks: the first of tied largest logits, a NaN over any number, a row of -inf's first
    index, a largest or a NaN in a row's last values past its whole groups of eight; random ties too."""
    from kvlab.backends.ops import TORCH, ops_for
    from kvlab.kernels.gemv import argmax_rows, gemv_available
    from kvlab.kernels.policy import ThreadPolicy

    if ops == "cpu" and not gemv_available():
        pytest.skip("the C kernels are off here (KVLAB_KERNELS=0)")
    chosen = TORCH if ops == "torch" else ops_for("cpu")
    x = torch.zeros(7, 49155)
    x[0, 100] = x[0, 40000] = 5.0
    x[1, 7] = x[1, 9] = float("nan")
    x[1, 3] = 1e30
    x[2] = -float("inf")
    x[3, 49151] = x[3, 5] = 2.0
    x[4, 1] = float("inf")
    x[5, 49154] = 3.0  # in the tail after the last group of eight
    x[6, 49153] = float("nan")
    x[6, 0] = 7.0
    with ThreadPolicy(threads=2).active():
        assert chosen.greedy_tokens(x).tolist() == x.argmax(dim=-1).tolist() == [100, 7, 0, 5, 1, 49154, 49153]
        g = torch.Generator().manual_seed(0)
        for rows, cols in ((1, 49152), (16, 49152), (3, 1000), (2, 5)):
            y = torch.randint(-3, 3, (rows, cols), generator=g).float()  # ties everywhere
            assert torch.equal(chosen.greedy_tokens(y), y.argmax(dim=-1))
    if ops == "cpu":  # the kernel itself, not a fallback, made those picks
        assert argmax_rows(x, 2) is not None
