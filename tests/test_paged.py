"""The paged KV cache against the contiguous one, on tiny random models of every architecture.

The single-sequence engine (contiguous cache) is the oracle: the serving engine must produce the
same greedy tokens alone, in a batch, with chunked prefill, with prefix-cache hits, and after
preemption.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine
from kvlab.kernels import ThreadPolicy
from kvlab.reference import ReferenceEngine
from kvlab.runner.driver import ModelDriver
from kvlab.scheduler import StepResult
from kvlab.kv.cache import ContiguousKVCache
from kvlab.model.loader import load_model
from kvlab.output.result import RequestMetrics
from kvlab.sampling import SamplingParams
from tiny import ARCHS, build_tiny

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
LENGTHS = (5, 17, 33, 1, 40, 9, 16, 23)  # shorter and longer than a block, exactly one, a single token


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest


@pytest.fixture(scope="module", params=ARCHS)
def loaded(request, tmp_path_factory):
    return load_model(build_tiny(request.param, tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def loaded_two(request, tmp_path_factory):
    """The scheduling paths on two architectures (with and without q/k norms and a set head_dim)."""
    return load_model(build_tiny(request.param, tmp_path_factory.mktemp(request.param)))


def prompts(n: int = len(LENGTHS), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (length,), generator=g).tolist() for length in LENGTHS[:n]]


def reference(loaded, ids: list[int], params=GREEDY) -> list[int]:
    return list(ReferenceEngine(loaded).generate(ids, params, RequestMetrics()))


def run_all(engine: LLMEngine, batch: list[list[int]], params=GREEDY, check=None) -> list[list[int]]:
    """Add every prompt, step until done (calling `check(engine)` between steps); token ids in order."""
    ids = [engine.add_request(p, params) for p in batch]
    done = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output
        if check:
            check(engine)
    return [done[i].token_ids for i in ids]


def test_single_sequence_logits_are_bit_identical_to_the_contiguous_cache(loaded):
    """The same modules over either cache (the fused decode step, tested apart, computes attention in C)."""
    engine = LLMEngine(loaded, None, EngineConfig(enable_prefix_caching=False), policy=ThreadPolicy(fused_decode=False))
    ids = prompts(1, seed=3)[0] + prompts(1, seed=4)[0]
    engine.add_request(ids, GREEDY)
    request = engine.scheduler.waiting[0]
    contiguous = ContiguousKVCache.for_model(loaded.config, 64)
    fed = ids
    driver = ModelDriver(loaded.model)
    for _ in range(6):
        plan = engine.scheduler.schedule()
        paged = engine.runner.forward(engine.runner.prepare_inputs(plan))[0]
        expected = driver.append(fed, contiguous)
        assert torch.equal(paged, expected)
        token = int(expected.argmax())
        engine.scheduler.update(plan, StepResult({request.request_id: [token]}))
        fed = [token]


def test_alone_and_batched_greedy_tokens_match_the_contiguous_engine(loaded):
    batch = prompts()
    expected = [reference(loaded, p) for p in batch]
    engine = LLMEngine(loaded, None, EngineConfig(enable_prefix_caching=False))
    assert [run_all(engine, [p])[0] for p in batch] == expected
    assert run_all(engine, batch) == expected


def test_chunked_prefill_prefix_hits_and_separate_prompt_passes_give_the_same_tokens(loaded_two):
    loaded = loaded_two
    batch = prompts(6, seed=1)
    expected = [reference(loaded, p) for p in batch]
    for config in (
        EngineConfig(max_num_batched_tokens=7, max_num_seqs=4),  # prompts split over many steps
        EngineConfig(pack_prompts=False),  # prompt chunks in forwards of their own
    ):
        engine = LLMEngine(loaded, None, config)
        assert run_all(engine, batch) == expected, config
        assert run_all(engine, batch) == expected, "second run: every prompt a prefix-cache hit"
        assert engine.kv.stats.hits > 0


def test_preemption_reproduces_the_unpreempted_output(loaded_two):
    loaded = loaded_two
    batch = prompts(6, seed=2)
    sampled = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    roomy = LLMEngine(loaded, None, EngineConfig(enable_prefix_caching=False))
    expected_greedy, expected_sampled = run_all(roomy, batch), run_all(roomy, batch, sampled)
    # 6 blocks of 16 tokens hold 2 or 3 of these sequences at a time: the rest wait or are preempted
    tight = EngineConfig(max_model_len=64, kv_memory_bytes=6 * 16 * _bytes_per_token(loaded), enable_prefix_caching=False)
    for params, expected in ((GREEDY, expected_greedy), (sampled, expected_sampled)):
        engine = LLMEngine(loaded, None, tight)
        assert engine.kv.num_blocks == 6
        assert run_all(engine, batch, params, check=_balanced) == expected
        assert engine.scheduler.num_preemptions > 0
        assert engine.kv.pool.check_integrity().used == 0


def _bytes_per_token(loaded) -> int:
    c = loaded.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4


def _balanced(engine: LLMEngine) -> None:
    ledger = engine.ledger()
    assert ledger.is_balanced, ledger
    engine.kv.pool.check_integrity()


def test_materialized_attention_reads_through_the_paged_cache(loaded_two):
    loaded = loaded_two
    batch = prompts(4, seed=5)
    expected = [reference(loaded, p) for p in batch]
    loaded.model.set_attention("materialized")
    try:
        engine = LLMEngine(loaded, None, EngineConfig(max_num_batched_tokens=20))
        assert run_all(engine, batch) == expected
    finally:
        loaded.model.set_attention("sdpa")


def test_uninitialised_pool_memory_never_leaks_into_attention(loaded_two):
    """The pool starts uninitialised; a decode batch reads (masked) past short sequences' ends. Every
    block is zeroed when allocated, so even a pool full of NaN gives the right tokens."""
    loaded = loaded_two
    batch = prompts(5, seed=8)
    engine = LLMEngine(loaded, None, EngineConfig(max_num_batched_tokens=24))
    for t in engine.cache.k + engine.cache.v:
        t.fill_(float("nan"))
    assert run_all(engine, batch) == [reference(loaded, p) for p in batch]
    assert run_all(engine, batch) == [reference(loaded, p) for p in batch]  # with prefix hits and copies


def test_a_burst_of_fresh_prompts_attends_as_one_batch_with_each_ones_own_numbers(loaded, monkeypatch):
    """Fresh prompts of one length attend in one call (runner._fresh_runs): the logits are bit for bit those
    of a call per prompt (Gemma 3's 24 tokens pass its 20-token window: the windowed mask broadcasts over
    the batch), and the greedy tokens the contiguous engine's."""
    import kvlab.runner.model_runner as model_runner

    g = torch.Generator().manual_seed(8)
    batch = [torch.randint(3, 512, (24,), generator=g).tolist() for _ in range(4)]

    def first_pass_logits() -> torch.Tensor:
        engine = LLMEngine(loaded, None, EngineConfig(enable_prefix_caching=False),
                           policy=ThreadPolicy(fused_decode=False))  # fmt: skip
        for p in batch:
            engine.add_request(p, GREEDY)
        inputs = engine.runner.prepare_inputs(engine.scheduler.schedule())
        sizes = [grp.batch_size for grp in inputs.passes[0].meta.kv_groups[0].groups]
        return engine.runner.forward(inputs), sizes

    together, sizes = first_pass_logits()
    assert sizes == [4]
    monkeypatch.setattr(model_runner, "_fresh_runs", lambda chunks: [[c] for c in chunks])
    alone, sizes = first_pass_logits()
    assert sizes == [1, 1, 1, 1]
    assert torch.equal(together, alone)
    monkeypatch.undo()
    expected = [reference(loaded, p) for p in batch]
    assert run_all(LLMEngine(loaded, None, EngineConfig(enable_prefix_caching=False)), batch) == expected
