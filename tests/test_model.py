"""The hand-written decoder against transformers on tiny random models of every architecture."""

from __future__ import annotations

import pytest
import torch

from kvlab.kv.cache import ContiguousKVCache, NoCache
from kvlab.model.loader import load_model
from kvlab.runner.driver import ModelDriver
from tiny import ARCHS, build_tiny


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    """(kind, our LoadedModel, transformers model) on the same weights."""
    import transformers

    directory = build_tiny(request.param, tmp_path_factory.mktemp(request.param))
    ours = load_model(directory)
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return request.param, ours, ref


def prompt_ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (1, n), generator=g)


def run(model, ids: torch.Tensor, cache, logits_index=None) -> torch.Tensor:
    """One pass through the model's one driver: planned, run, committed."""
    return ModelDriver(model).run(ids, cache, logits_index=logits_index)


def greedy(model, ids: list[int], steps: int, cache) -> list[int]:
    """Our greedy loop: prefill once, then one token per forward."""
    out = []
    logits = run(model, torch.tensor([ids]), cache)
    for _ in range(steps):
        token = int(logits[0].argmax())
        out.append(token)
        logits = run(model, torch.tensor([[token]]), cache)
    return out


def greedy_no_cache(model, ids: list[int], steps: int) -> list[int]:
    seq = list(ids)
    for _ in range(steps):
        seq.append(int(run(model, torch.tensor([seq]), NoCache.for_model(model.config))[0].argmax()))
    return seq[len(ids) :]


def test_last_position_logits_match_transformers(pair):
    kind, ours, ref = pair
    ids = prompt_ids(40)
    with torch.inference_mode():
        expected = ref(ids).logits[:, -1]
        got = run(ours.model, ids, ContiguousKVCache.for_model(ours.config, 64))
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4, kind


def test_all_position_logits_match_transformers(pair):
    kind, ours, ref = pair
    ids = prompt_ids(17, seed=1)
    with torch.inference_mode():
        expected = ref(ids).logits
        got = run(ours.model, ids, ContiguousKVCache.for_model(ours.config, 32), logits_index=torch.arange(17))
    assert (got - expected).abs().max().item() < 1e-4, kind


def test_32_greedy_tokens_match_transformers_generate(pair):
    kind, ours, ref = pair
    ids = prompt_ids(12, seed=2)
    with torch.inference_mode():
        expected = ref.generate(
            ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, 12:].tolist()
    cache = ContiguousKVCache.for_model(ours.config, 64)
    assert greedy(ours.model, ids[0].tolist(), 32, cache) == expected, kind


def test_cached_and_uncached_generation_identical(pair):
    kind, ours, _ = pair
    ids = prompt_ids(9, seed=3)[0].tolist()
    cache = ContiguousKVCache.for_model(ours.config, 64)
    assert greedy(ours.model, ids, 24, cache) == greedy_no_cache(ours.model, ids, 24), kind


def test_chunked_prefill_matches_one_pass(pair):
    """Prefilling in two chunks (a chat turn after a cached prefix) gives the same logits."""
    _, ours, _ = pair
    ids = prompt_ids(30, seed=4)
    whole = run(ours.model, ids, ContiguousKVCache.for_model(ours.config, 32))
    two = ContiguousKVCache.for_model(ours.config, 32)
    run(ours.model, ids[:, :18], two)
    rest = run(ours.model, ids[:, 18:], two)
    assert (whole - rest).abs().max().item() < 1e-5


def test_cache_element_count_is_the_formula(pair):
    _, ours, _ = pair
    c = ours.config
    for tokens in (1, 77, 512):
        cache = ContiguousKVCache.for_model(c, tokens)
        assert cache.numel() == c.num_layers * 2 * c.num_kv_heads * c.head_dim * tokens
        assert cache.nbytes() == cache.numel() * 4
    batch = ContiguousKVCache.for_model(c, 10, batch_size=3)
    assert batch.numel() == 3 * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 10


def test_batched_forward_matches_single_sequences(pair):
    """B sequences through one forward give each sequence's own logits (the lab's batching)."""
    _, ours, _ = pair
    ids = torch.cat([prompt_ids(8, seed=s) for s in range(3)])  # [3, 8]
    cache = ContiguousKVCache.for_model(ours.config, 16, batch_size=3)
    together = run(ours.model, ids, cache)
    step = run(ours.model, ids[:, :1], cache)
    for b in range(3):
        single = ContiguousKVCache.for_model(ours.config, 16)
        alone = run(ours.model, ids[b : b + 1], single)
        assert (together[b] - alone[0]).abs().max().item() < 1e-4
        alone_step = run(ours.model, ids[b : b + 1, :1], single)
        assert (step[b] - alone_step[0]).abs().max().item() < 1e-4


def test_cache_reserve_keeps_contents(pair):
    """Growing the cache mid-sequence (a long chat) keeps what it holds: same tokens as a big cache."""
    _, ours, _ = pair
    ids = prompt_ids(10, seed=5)[0].tolist()
    small = ContiguousKVCache.for_model(ours.config, 10)
    logits = run(ours.model, torch.tensor([ids]), small)
    small.reserve(30)
    assert small.max_len >= 30 and small.length == 10
    continued = [int(logits[0].argmax())]
    for _ in range(12):
        logits = run(ours.model, torch.tensor([[continued[-1]]]), small)
        continued.append(int(logits[0].argmax()))
    big = ContiguousKVCache.for_model(ours.config, 64)
    assert greedy(ours.model, ids, 13, big) == continued


def test_bfloat16_runs_and_mostly_agrees(pair):
    """16-bit weights: same shapes, logits close to float32 (not identical)."""
    _, ours, _ = pair
    low = load_model(ours.path, dtype="bfloat16")
    ids = prompt_ids(10, seed=6)
    c32 = ContiguousKVCache.for_model(ours.config, 16)
    a = run(ours.model, ids, c32)
    c16 = ContiguousKVCache.for_model(low.config, 16, dtype=torch.bfloat16)
    b = run(low.model, ids, c16)
    assert low.model.dtype == torch.bfloat16 and c16.nbytes() * 2 == c32.nbytes()
    assert b.dtype == torch.float32 and b.shape == a.shape
    assert (a - b).abs().max().item() < 0.1 * a.abs().max().item()


def test_materialized_attention_matches_sdpa(pair):
    """Both attention implementations agree, in one-pass prefill, chunked prefill and decode."""
    _, ours, _ = pair
    ids = prompt_ids(24, seed=7)

    def attend_with(name):
        ours.model.set_attention(name)
        try:
            cache = ContiguousKVCache.for_model(ours.config, 32)
            return torch.stack([run(ours.model, chunk, cache) for chunk in (ids[:, :16], ids[:, 16:22], ids[:, 22:23], ids[:, 23:])])
        finally:
            ours.model.set_attention("sdpa")

    assert (attend_with("sdpa") - attend_with("materialized")).abs().max().item() < 1e-4
