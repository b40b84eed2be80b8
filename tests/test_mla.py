"""DeepSeek-V3 (multi-head latent attention, sigmoid-routed experts) against transformers' own classes, on tiny
random checkpoints in float32.

q_lora: the query's low-rank path and DeepSeek's YaRN with its mscale softmax correction; no_q_lora: q_proj from
the hidden state and plain RoPE; grouped: 8 experts in 4 groups of which 2 are kept, top-3. Each has a dense
first layer, then MoE layers with an ungated shared expert and the routing correction bias. Checked: last-position
logits, greedy tokens of several prompts served together through the paged cache (chunked prefill, batched
decode, 40 tokens each), the absorbed decode against the rebuilt one, the cache's bytes per token against
`kvlab mem`'s (float32 and q8_0 latents), and prefix caching, preemption and n = 3 against the tokens alone.
"""

from __future__ import annotations

import pytest
import torch
from test_paged import run_all
from test_real import reference_greedy
from tiny import add_tiny_tokenizer
from tiny_deepseek import DEEPSEEK_KINDS, build_tiny_deepseek

from kvlab.backends import choose_decode_path, expected_decode_path
from kvlab.config import EngineConfig, MoE
from kvlab.config.layers import MLA
from kvlab.engine import LLMEngine
from kvlab.kv.cache import ContiguousKVCache
from kvlab.kv.formats import KVFormats
from kvlab.kv.paged import PagedKVCache
from kvlab.memory import kv_bytes_per_token
from kvlab.model.loader import load_model
from kvlab.runner.driver import ModelDriver
from kvlab.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=DEEPSEEK_KINDS)
def pair(request, tmp_path_factory):
    """(kind, folder, our LoadedModel, transformers' model) on the same tiny random DeepSeek-V3."""
    import transformers

    directory = build_tiny_deepseek(request.param, tmp_path_factory.mktemp(request.param))
    add_tiny_tokenizer(directory)
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return request.param, directory, load_model(directory), ref


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def test_the_config_describes_the_latent_and_the_routing(pair):
    kind, _, loaded, _ = pair
    layers = loaded.config.layers
    mla = layers[0].mixer
    assert isinstance(mla, MLA) and (mla.kv_lora_rank, mla.qk_rope_head_dim) == (48, 16) and mla.rope_interleaved
    assert mla.q_lora_rank == (None if kind == "no_q_lora" else 32)
    assert not isinstance(layers[0].mlp, MoE) and all(isinstance(layer.mlp, MoE) for layer in layers[1:])
    moe = layers[1].mlp
    routing = (moe.routing, moe.score_bias, moe.norm_topk_prob, moe.routed_scaling_factor)
    assert routing == ("sigmoid_topk", True, True, 2.5)
    assert (moe.shared_size, moe.shared_gate) == (32, False)
    assert (moe.num_groups, moe.top_k_groups, moe.top_k) == ((4, 2, 3) if kind == "grouped" else (1, 1, 2))


def test_last_position_logits_match_transformers(pair):
    kind, _, loaded, ref = pair
    ids = torch.tensor([prompt(40)])
    with torch.inference_mode():
        expected = ref(ids).logits[:, -1]
        got = ModelDriver(loaded.model).run(ids, ContiguousKVCache.for_model(loaded.config, 64))
    assert expected.std() > 0.5, "logits too flat to test anything"
    assert (got - expected).abs().max().item() < 1e-4, kind


def test_greedy_tokens_of_several_prompts_match_transformers(pair):
    """Four prompts served together (chunked prefill of 16, then batched decode steps over the latent cache)."""
    kind, _, loaded, ref = pair
    batch = [prompt(n, seed=n) for n in (3, 11, 20, 33)]
    engine = LLMEngine(loaded, None, EngineConfig(block_size=4, kv_memory_bytes=1 << 20, max_num_batched_tokens=16))
    assert engine.decode_path.backend is None  # the C step declines MLA; the modules decode
    assert run_all(engine, batch, GREEDY) == [reference_greedy(ref, p, 40) for p in batch], kind
    assert engine.kv.pool.check_integrity().used == 0


def test_absorbed_attention_equals_the_rebuilt_one(pair):
    """The same weights and cache, every layer absorbing kv_b into the query or rebuilding per-head K and V, for a
    prompt chunk and four decode steps after it."""
    kind, _, loaded, _ = pair
    ids = torch.tensor([prompt(24)])
    attns = [layer.attn for layer in loaded.model.layers]
    outs = {}
    try:
        for absorb in (True, False):
            for attn in attns:
                attn.absorb = absorb
            cache = ContiguousKVCache.for_model(loaded.config, 32)
            driver = ModelDriver(loaded.model)
            with torch.inference_mode():
                prefill = driver.run(ids[:, :-4], cache)
                decodes = [driver.run(ids[:, i : i + 1], cache) for i in range(20, 24)]
            outs[absorb] = torch.stack([prefill, *decodes])
    finally:
        for attn in attns:
            attn.absorb = None  # decode rows absorb, prompt chunks rebuild
    assert (outs[True] - outs[False]).abs().max().item() < 1e-4, kind


@pytest.mark.parametrize("kv", ["float32", "q8_0", "bfloat16"])
def test_the_latent_cache_holds_what_kvlab_mem_counts(pair, kv):
    """One latent of kv_lora_rank + qk_rope_head_dim numbers per token and layer, no V: the engine's pool plan,
    an allocated paged cache and `kvlab mem` agree byte for byte (q8_0: 2 blocks of 34 bytes, rotated)."""
    _, _, loaded, _ = pair
    config = loaded.config
    formats = KVFormats.resolve(kv, model_dtype=torch.float32)
    cache = PagedKVCache.for_model(config, 4, 16, torch.float32, formats=formats)
    expected = config.num_layers * {"float32": 64 * 4, "q8_0": 2 * 34, "bfloat16": 64 * 2}[kv]
    assert cache.bytes_per_token() == PagedKVCache.bytes_per_token_for(config, torch.float32, formats) == expected
    assert kv_bytes_per_token(config, kv) == expected
    n = config.num_layers
    assert cache.v == [None] * n and len(cache.tensors()) == n * (2 if kv == "q8_0" else 1)  # K (+ scales) only
    engine = LLMEngine(loaded, None, EngineConfig(block_size=4, kv_memory_bytes=1 << 20, kv_cache_dtype=kv))
    assert engine.pool_plan.bytes_per_token == engine.cache.bytes_per_token() == expected  # what the pool is sized by


def test_q8_0_latents_stay_close_to_float32(pair):
    """The latent in Hadamard-rotated q8_0 blocks (64 numbers: one rotation block, two q8_0 blocks): logits
    within 0.15 of float32's (about 3 at the top), and the engine serves with it."""
    kind, _, loaded, _ = pair
    ids = torch.tensor([prompt(20, seed=5)])
    logits = {}
    for kv in ("float32", "q8_0"):
        cache = ContiguousKVCache.for_model(loaded.config, 32, formats=KVFormats.resolve(kv, model_dtype=torch.float32))
        with torch.inference_mode():
            logits[kv] = ModelDriver(loaded.model).run(ids, cache)
    assert 0 < (logits["q8_0"] - logits["float32"]).abs().max().item() < 0.15, kind
    engine = LLMEngine(loaded, None, EngineConfig(block_size=4, kv_memory_bytes=1 << 20, kv_cache_dtype="q8_0"))
    assert engine.cache.formats.rotate_k
    eight = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert len(run_all(engine, [prompt(20, seed=5)], eight)[0]) == 8


@pytest.mark.parametrize("pair", ["q_lora"], indirect=True)  # the bookkeeping does not depend on the query path
def test_prefix_hits_preemption_and_n3_give_the_tokens_alone(pair):
    _, _, loaded, _ = pair
    shared = prompt(24, seed=1)
    batch = [shared + prompt(5, seed=s) for s in (2, 3, 4)] + [prompt(30, seed=9)]
    alone = [run_all(LLMEngine(loaded, None, EngineConfig(block_size=4, kv_memory_bytes=1 << 20)), [p], GREEDY)[0]
             for p in batch]  # fmt: skip
    per_token = PagedKVCache.bytes_per_token_for(loaded.config, torch.float32)
    tight = EngineConfig(block_size=4, kv_memory_bytes=40 * 4 * per_token, max_num_batched_tokens=16, max_model_len=72)
    engine = LLMEngine(loaded, None, tight)
    outputs = finished(engine, [engine.add_request(p, GREEDY) for p in batch])
    assert [o.token_ids for o in outputs] == alone
    assert engine.scheduler.num_preemptions > 0 and any(o.cached_prompt_tokens for o in outputs)
    n3 = SamplingParams(n=3, max_tokens=40, temperature=0, ignore_eos=True)
    engine = LLMEngine(loaded, None, EngineConfig(block_size=4, kv_memory_bytes=1 << 20))
    (out,) = finished(engine, [engine.add_request(batch[0], n3)])
    assert [c.token_ids for c in out.outputs] == [alone[0]] * 3
    assert engine.kv.pool.check_integrity().used == 0


def finished(engine: LLMEngine, ids: list) -> list:
    """Step `engine` until done; the RequestOutput of each request id, in order."""
    done = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output
    return [done[i] for i in ids]


def test_no_decode_backend_takes_mla_and_each_says_why(pair):
    _, _, loaded, _ = pair
    path = choose_decode_path(loaded.model)
    assert path.backend is None and "MLAttention" in path.reason
    assert "MLA" in expected_decode_path(loaded.config).reason


@pytest.mark.parametrize("pair", ["no_q_lora"], indirect=True)  # speculation only adds rows to the same cache
def test_prompt_lookup_speculation_gives_plain_decodings_tokens(pair):
    """Drafted tokens verified as k + 1 decode rows over the latent cache, rejected ones truncated from it."""
    from kvlab import LLM

    _, directory, _, _ = pair
    repeated = [{"prompt_token_ids": prompt(n, seed=n) * 2} for n in (6, 13)]
    plain = [o.token_ids for o in LLM(directory, max_num_seqs=4).generate(repeated, GREEDY)]
    spec = LLM(directory, max_num_seqs=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                              "prompt_lookup_min": 1})  # fmt: skip
    assert [o.token_ids for o in spec.generate(repeated, GREEDY)] == plain
    stats = spec.engine.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # drafts both kept and rolled back


def test_the_bytes_held_are_the_files_and_kvlab_mems(pair):
    """Latent projections, the routing bias and the ungated shared expert included (MTP blocks left out)."""
    from kvlab.config import load_config
    from kvlab.memory import weight_bytes

    kind, directory, loaded, _ = pair
    estimate = weight_bytes(load_config(directory))
    assert estimate.exact and loaded.weight_bytes == estimate.bytes, kind


def test_a_latent_q8_0_cannot_tile_is_refused_in_one_line(tmp_path):
    """kv_lora_rank 40 + rope 16 = 56 numbers: not whole blocks of 32, so q8_0 (and its rotation) cannot hold it."""
    from kvlab.errors import KvlabError

    directory = build_tiny_deepseek("no_q_lora", tmp_path / "m", kv_lora_rank=40, num_hidden_layers=2)
    loaded = load_model(directory)
    with pytest.raises(KvlabError, match="whole blocks of 32, got 56") as e:
        LLMEngine(loaded, None, EngineConfig(block_size=4, kv_memory_bytes=1 << 20, kv_cache_dtype="q8_0"))
    assert "\n" not in str(e.value)


def test_rotary_channels_in_halves_when_the_config_says_so(tmp_path):
    """rope_interleave False: transformers rotates (i, i + d/2) pairs, and so does kvlab (no de-interleave)."""
    import transformers

    directory = build_tiny_deepseek("grouped", tmp_path / "m", rope_interleave=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    loaded = load_model(directory)
    assert not loaded.config.layers[0].mixer.rope_interleaved
    ids = torch.tensor([prompt(30, seed=3)])
    with torch.inference_mode():
        expected = ref(ids).logits[:, -1]
        got = ModelDriver(loaded.model).run(ids, ContiguousKVCache.for_model(loaded.config, 32))
    assert (got - expected).abs().max().item() < 1e-4


def test_q8_0_weights_keep_kv_b_in_blocks_and_absorb_the_same(tmp_path):
    """--quantization q8_0: every projection in blocks, kv_b included (expanded once for absorption)."""
    from kvlab.quant.linear import PackedLinear

    directory = build_tiny_deepseek("q_lora", tmp_path / "m", kv_lora_rank=64, v_head_dim=32, num_hidden_layers=2)
    full, q8 = load_model(directory), load_model(directory, quantization="q8_0")
    assert isinstance(q8.model.layers[1].attn.kv_b_proj, PackedLinear)
    ids = torch.tensor([prompt(24, seed=4)])
    outs = []
    for loaded, absorb in ((full, None), (q8, None), (q8, True)):
        for layer in loaded.model.layers:
            layer.attn.absorb = absorb
        with torch.inference_mode():
            outs.append(ModelDriver(loaded.model).run(ids, ContiguousKVCache.for_model(loaded.config, 32)))
    for layer in q8.model.layers:
        layer.attn.absorb = None
    assert (outs[0] - outs[1]).abs().max() < 0.1 * outs[0].abs().max()
    assert (outs[1] - outs[2]).abs().max().item() < 1e-4


def test_show_names_the_latent_in_place_of_kv_heads(pair):
    from kvlab.show import model_facts, render

    _, directory, _, _ = pair
    text = render(model_facts(str(directory)))
    assert "4 (latent attention: one latent of 64 numbers cached)" in text and "a MLA mixer" in text
