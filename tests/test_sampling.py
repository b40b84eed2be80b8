"""Sampling: parameter validation, each filter's exact effect, seeds, and the drawn distribution."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.errors import KvlabError
from kvlab.sampling.params import SamplingParams
from kvlab.sampling.sampler import Sampler
from kvlab.sampling.sampler import apply_repetition_penalty

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_values_are_user_errors(kwargs, word):
    with pytest.raises(KvlabError, match=word):
        SamplingParams(**kwargs)


def test_stop_accepts_a_string_or_a_list():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_greedy_is_argmax():
    s = Sampler(SamplingParams(temperature=0))
    assert s(torch.tensor([0.1, 3.0, -1.0, 2.9])) == 1


def test_top_k_1_is_greedy_at_any_temperature():
    s = Sampler(SamplingParams(temperature=5.0, top_k=1, seed=0))
    assert all(s(LOGITS) == 0 for _ in range(50))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = Sampler(SamplingParams(top_p=0.7)).probabilities(LOGITS)
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    probs = Sampler(SamplingParams(top_p=0.5)).probabilities(LOGITS)
    assert torch.allclose(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))  # a set holding exactly top_p suffices
    probs = Sampler(SamplingParams(top_p=0.5 + 1e-4)).probabilities(LOGITS)  # just above it: one more token
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def ulps(x: torch.Tensor, n: int) -> torch.Tensor:
    """x moved n float32 ulps (up for n > 0): a CPU whose vector log rounds the other way."""
    for _ in range(abs(n)):
        x = torch.nextafter(x, torch.full_like(x, math.inf if n > 0 else -math.inf))
    return x


@pytest.mark.parametrize("shift", [-4, -1, 0, 1, 4])
def test_the_top_p_and_min_p_boundaries_do_not_depend_on_the_last_ulp(shift):
    """exp(log(0.5)) lands on either side of 0.5 with the CPU's vector math: the rule must not."""
    top_moved = LOGITS.clone()
    top_moved[0] = ulps(LOGITS[:1], shift)[0]
    for logits in (ulps(LOGITS, shift), top_moved):  # every logit rounded the other way, or only the first
        at_p = Sampler(SamplingParams(top_p=0.5)).probabilities(logits)
        assert torch.count_nonzero(at_p) == 1, logits
        at_floor = Sampler(SamplingParams(min_p=0.6)).probabilities(logits)  # 0.3 is at 0.6 × 0.5
        assert torch.count_nonzero(at_floor) == 2, logits


def test_top_p_matches_transformers():
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.randn(1, 200, generator=torch.Generator().manual_seed(0)) * 3
    for p in (0.3, 0.9, 0.99):
        ours = Sampler(SamplingParams(top_p=p)).probabilities(logits[0])
        theirs = torch.softmax(TopPLogitsWarper(p)(None, logits.clone())[0], -1)
        assert torch.allclose(ours, theirs, atol=1e-6)


def test_min_p_drops_tokens_below_a_share_of_the_best():
    probs = Sampler(SamplingParams(min_p=0.5)).probabilities(LOGITS)
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_temperature_sharpens():
    hot = Sampler(SamplingParams(temperature=2.0)).probabilities(LOGITS)
    cold = Sampler(SamplingParams(temperature=0.5)).probabilities(LOGITS)
    assert cold[0] > PROBS[0] > hot[0]
    assert math.isclose(cold.sum().item(), 1.0, rel_tol=1e-6)


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    history = torch.tensor([0, 1, 1, 3])
    ours = apply_repetition_penalty(logits[0], history, 1.3)
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(history[None], logits.clone())[0]
    assert torch.allclose(ours, theirs)
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=10.0))(logits[0], torch.tensor([0])) == 4


def test_same_seed_same_draws_different_seed_differs():
    def draws(seed):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [s(LOGITS) for _ in range(64)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_draws_follow_the_filtered_distribution():
    """20,000 seeded draws: every frequency within 4 standard errors of its probability."""
    params = SamplingParams(temperature=1.0, top_k=3, seed=123)
    s = Sampler(params)
    expected = s.probabilities(LOGITS)
    n = 20_000
    counts = torch.bincount(torch.tensor([s(LOGITS) for _ in range(n)]), minlength=4).float()
    assert counts[3] == 0  # removed by top_k
    for p, c in zip(expected.tolist(), counts.tolist()):
        se = math.sqrt(p * (1 - p) / n)
        assert abs(c / n - p) <= 4 * se + 1e-9
