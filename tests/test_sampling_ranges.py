"""SamplingParams' ranges and numerical floors: no value it accepts can make a draw fail (issue 9)."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.errors import KvlabError
from kvlab.sampling.params import MAX_SEED, MIN_TEMPERATURE, MIN_TOP_P, SamplingParams
from kvlab.sampling.sampler import Sampler


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": MAX_SEED + 1}, "seed"),  # the generator keeps 32 bits: wider seeds would repeat texts
        ({"seed": -1}, "seed"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"max_tokens": True}, "max_tokens"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_values_that_would_break_a_draw_are_refused(kwargs, word):
    with pytest.raises(KvlabError, match=word):
        SamplingParams(**kwargs)


def test_tiny_temperature_and_top_p_are_raised_to_their_floors():
    assert SamplingParams(temperature=1e-40).temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0).is_greedy  # 0 stays greedy
    assert SamplingParams(top_p=1e-300).top_p == MIN_TOP_P
    assert SamplingParams(temperature=0.5, top_p=0.5).temperature == 0.5


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 1e-40, "seed": MAX_SEED},
        {"top_p": 1e-300, "seed": 0},
        {"repetition_penalty": 0.01, "temperature": 0.01, "seed": 1},
        {"repetition_penalty": 100, "temperature": 100, "min_p": 1.0},
    ],
)
def test_every_accepted_extreme_draws_a_valid_token(kwargs):
    logits = torch.randn(512, generator=torch.Generator().manual_seed(0)) * 30
    history = torch.arange(0, 512, 3)
    sampler = Sampler(SamplingParams(**kwargs))
    tokens = {sampler(logits, history) for _ in range(5)}
    assert all(0 <= t < 512 for t in tokens)


def test_seeds_reproduce_and_differ_across_the_range():
    logits = torch.zeros(1000)

    def draws(seed):
        sampler = Sampler(SamplingParams(seed=seed))
        return [sampler(logits) for _ in range(8)]

    assert draws(0) == draws(0) and draws(MAX_SEED) == draws(MAX_SEED)
    assert draws(MAX_SEED) != draws(1) and draws(0) != draws(2**31)
