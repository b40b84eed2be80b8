"""Quantized KV caches: the formats' round trips, paged against contiguous, blocks moved with their scales,
prefix hits and preemption, and the bytes allocated against `kvlab mem`, for every format."""

from __future__ import annotations

import re

import pytest
import torch

from kvlab.config import EngineConfig, load_config
from kvlab.engine import LLMEngine
from kvlab.errors import KvlabError
from kvlab.kernels import ThreadPolicy
from kvlab.kv.cache import ContiguousKVCache
from kvlab.kv.formats import KV_FORMATS, KVFormats, kv_format
from kvlab.kv.manager import BlockCopy
from kvlab.memory import kv_bytes, kv_bytes_per_token
from kvlab.model.loader import load_model
from kvlab.runner.driver import ModelDriver
from kvlab.sampling import SamplingParams
from test_paged import prompts, run_all
from tiny import build_tiny

QUANTIZED = ["q8_0", "q4_0", "fp8_e4m3"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(build_tiny("qwen3", tmp_path_factory.mktemp("qwen3")))  # head_dim 32: one q-block


@pytest.mark.parametrize("name", QUANTIZED)
def test_round_trip_within_the_formats_error_bound(name):
    fmt = kv_format(name, torch.float32)
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0)) * torch.tensor([0.01, 1.0, 30.0])[:, None]
    x[1, 2] = 0  # an all-zero vector: no division by zero
    back = fmt.decode(fmt.encode(x), torch.float32)
    assert back.shape == x.shape and torch.equal(back[1, 2], torch.zeros(64))
    blocks = x.reshape(5, 3, 2, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    err = (back - x).reshape(5, 3, 2, 32).abs()
    bound = {"q8_0": amax / 127 * 0.51, "q4_0": amax / 8 * 1.01, "fp8_e4m3": x.abs().reshape(5, 3, 2, 32) / 16 + 1e-7}[name]
    if name == "fp8_e4m3":  # relative: 3 mantissa bits (and the smallest normal of the scaled vector)
        bound = bound + x.abs().amax(-1, keepdim=True).reshape(5, 3, 1, 1) / 448 * 2**-6
    assert (err <= bound + 1e-6).all(), (err - bound).max()


def test_storage_sizes_are_llama_cpps_blocks():
    assert kv_format("q8_0", torch.float32).bytes_per_vector(64) == 2 * 34
    assert kv_format("q4_0", torch.float32).bytes_per_vector(64) == 2 * 18
    assert kv_format("fp8_e4m3", torch.float32).bytes_per_vector(64) == 64 + 4
    with pytest.raises(KvlabError, match="q8_0"):
        kv_format("int3", torch.float32)


@pytest.mark.parametrize("rotation", ["auto", "off"])
@pytest.mark.parametrize("name", QUANTIZED + ["bfloat16"])
def test_paged_and_contiguous_caches_give_identical_logits(loaded, name, rotation):
    formats = KVFormats.resolve(name, model_dtype=torch.float32, rotation=rotation)
    ids = prompts(1, seed=3)[0] + prompts(1, seed=4)[0]
    config = EngineConfig(enable_prefix_caching=False, kv_cache_dtype=name, kv_rotation=rotation)
    engine = LLMEngine(loaded, None, config,
                       policy=ThreadPolicy(fused_decode=False))  # fmt: skip
    engine.add_request(ids, GREEDY)
    contiguous = ContiguousKVCache.for_model(loaded.config, 64, formats=formats)
    driver, fed = ModelDriver(loaded.model), ids
    for _ in range(4):
        plan = engine.scheduler.schedule()
        paged = engine.runner.forward(engine.runner.prepare_inputs(plan))[0]
        expected = driver.append(fed, contiguous)
        assert torch.equal(paged, expected), name
        token = int(expected.argmax())
        from kvlab.scheduler import StepResult

        engine.scheduler.update(plan, StepResult({engine.scheduler.running[0].request_id: [token]}))
        fed = [token]


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_block_copy_moves_the_scales_with_the_codes(loaded, name):
    engine = LLMEngine(loaded, None, EngineConfig(kv_cache_dtype=name, kv_memory_bytes=1 << 20))
    cache = engine.cache
    assert len(cache.tensors()) == 2 * 2 * len(cache._k)  # codes and scales, for K and V
    for t in cache.tensors():
        t[3].copy_(torch.randint(0, 100, t[3].shape).to(t.dtype))
    cache.apply([BlockCopy(src=3, dst=5, num_tokens=cache.block_size)])
    for t in cache.tensors():
        assert torch.equal(t[5], t[3])


@pytest.mark.parametrize("name", QUANTIZED)
def test_prefix_hits_and_preemption_keep_the_tokens(loaded, name):
    """With quantized blocks, a prefix hit reads blocks another request wrote and a preempted request
    recomputes its own: both quantize the same floats, so the tokens are those of a plain run."""
    first = prompts(2, seed=5)[1]  # 17 tokens: a full block to find later
    batch = [first + [7, 8, 9], first + [4]] + prompts(6, seed=6)  # the hits first, before eviction
    plain_engine = LLMEngine(loaded, None, EngineConfig(kv_cache_dtype=name, enable_prefix_caching=False))
    plain = run_all(plain_engine, [first]) + run_all(plain_engine, batch)
    per_token = engine_bytes_per_token(loaded, name)
    tight = EngineConfig(kv_cache_dtype=name, max_model_len=64, kv_memory_bytes=10 * 16 * per_token, max_num_seqs=8)
    engine = LLMEngine(loaded, None, tight)
    assert run_all(engine, [first]) + run_all(engine, batch) == plain
    assert engine.scheduler.num_preemptions > 0 and engine.kv.stats.hits > 0
    assert engine.kv.pool.check_integrity().used == 0 and engine.ledger().is_balanced


def engine_bytes_per_token(loaded, name: str) -> int:
    from kvlab.kv.paged import PagedKVCache

    return PagedKVCache.bytes_per_token_for(loaded.config, torch.float32, KVFormats.resolve(name))


@pytest.mark.parametrize("k, v", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0"), ("fp8_e4m3", "float16"),
                                  ("float32", "bfloat16")])  # fmt: skip
def test_allocated_bytes_equal_the_calculator_for_every_format(loaded, k, v):
    config = load_config(loaded.path)
    formats = KVFormats.resolve(cache_type_k=k, cache_type_v=v)
    for tokens, batch in [(1, 1), (77, 3)]:
        cache = ContiguousKVCache.for_model(config, tokens, batch_size=batch, formats=formats, device="meta")
        assert cache.nbytes() == kv_bytes(config, tokens, batch, kv_dtype=(k, v))
    assert cache.bytes_per_token() == kv_bytes_per_token(config, (k, v))
    engine = LLMEngine(loaded, None, EngineConfig(cache_type_k=k, cache_type_v=v, kv_memory_bytes=1 << 20))
    assert engine.pool_plan.bytes_per_token == kv_bytes_per_token(config, f"{k}:{v}")
    assert engine.cache.nbytes() == engine.pool_plan.num_blocks * engine.pool_plan.bytes_per_block


@pytest.mark.real
@pytest.mark.parametrize("model", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_real_models_caches_equal_the_calculator_in_every_format(real_model, model):
    path = real_model(model)
    config = load_config(path)
    for name in KV_FORMATS:
        cache = ContiguousKVCache.for_model(config, 1000, formats=KVFormats.resolve(name), device="meta")
        assert cache.nbytes() == kv_bytes(config, 1000, kv_dtype=name), name


def test_kvlab_mem_sizes_keys_and_values_apart_and_per_rank(capsys):
    import json

    from kvlab.cli import main
    from kvlab.config.shard import shard_config

    args = ["mem", "qwen2.5-coder-0.5b-instruct", "--context", "8192", "--json"]
    assert main(args + ["--cache-type-k", "q8_0", "--cache-type-v", "q4_0"]) == 0
    report = json.loads(capsys.readouterr().out)  # one model: one report
    config = load_config("qwen2.5-coder-0.5b-instruct")
    cache = ContiguousKVCache.for_model(config, 8192, formats=KVFormats.resolve(cache_type_k="q8_0", cache_type_v="q4_0"),
                                        device="meta")  # fmt: skip
    assert report["kv_dtype"] == "q8_0:q4_0" and report["kv_bytes"] == cache.nbytes()
    assert main(args + ["--kv-dtype", "q8_0", "--tensor-parallel-size", "2"]) == 0
    per_rank = json.loads(capsys.readouterr().out)["kv_bytes"]
    rank = ContiguousKVCache.for_model(shard_config(config, 2), 8192, formats=KVFormats.resolve("q8_0"), device="meta")
    assert per_rank == rank.nbytes() == kv_bytes(config, 8192, kv_dtype="q8_0") // 2


@pytest.mark.parametrize("name, least", [("q8_0", 1.8), ("q4_0", 3.4), ("fp8_e4m3", 1.7)])  # fp8: 36 B per 32-number vector
def test_the_servers_plan_says_how_many_more_tokens_than_float16(tmp_path, capsys, name, least):
    from kvlab.cli import build_parser
    from kvlab.engine_cli import check_model_args, engine_options
    from kvlab.server.cli import print_plan

    model = build_tiny("qwen3", tmp_path)
    serve = ["serve", str(model), "--kv-memory", "4MiB", "--max-model-len", "256", "--dtype", "float32"]
    plans = {}
    for dtype in (name, "float16"):
        args = build_parser().parse_args(serve + ["--kv-cache-dtype", dtype])
        check_model_args(args)
        plans[dtype] = print_plan(args, engine_options(args))[0]
    err = capsys.readouterr().err
    assert plans[name].num_tokens / plans["float16"].num_tokens >= least and plans[name].nbytes <= 4 << 20
    line = next(line for line in err.splitlines() if "the tokens of float16 in these bytes" in line)
    gain, theirs = re.search(r"([\d.]+)× the tokens.*\([\d,]+ vs ([\d,]+);", line).groups()
    assert float(gain) >= least and f"({plans[name].num_tokens:,} vs" in line
    assert abs(int(theirs.replace(",", "")) - plans["float16"].num_tokens) <= plans["float16"].block_size
    assert "has not been measured" in err  # and how to measure it
