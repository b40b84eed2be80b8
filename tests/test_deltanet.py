"""Hybrid models (Gated DeltaNet + gated attention): Qwen3.5 and Qwen3-Next against transformers' own classes.

Tiny random float32 checkpoints (tests/tiny_hybrid.py). The chunked delta rule equals the recurrent form;
greedy tokens equal transformers' generate through the serving engine (paged KV for the attention layers,
a state slot per sequence for the recurrent ones), over prompts longer than a prefill chunk and 64 decoded
tokens; a request gives the same tokens through preemption, n = 3 and speculation (rejected drafts roll
the state back); the engine's bytes (KV blocks + state) are `kvlab mem`'s.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_paged import run_all
from test_real import reference_greedy
from tiny_hybrid import HYBRID_ARCHS, build_tiny_hybrid

from kvlab.config import EngineConfig, GatedDeltaNet, load_config
from kvlab.engine import LLMEngine
from kvlab.errors import KvlabError
from kvlab.llm import LLM
from kvlab.memory import kv_bytes
from kvlab.memory.kv import state_bytes
from kvlab.model.deltanet import delta_rule_chunked, delta_rule_recurrent, l2norm
from kvlab.model.loader import load_model
from kvlab.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def pair(request, tmp_path_factory):
    """(kind, folder, our LoadedModel, transformers' model) on the same tiny random hybrid."""
    import transformers

    directory = build_tiny_hybrid(request.param, tmp_path_factory.mktemp(request.param))
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return request.param, directory, load_model(directory), ref


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def test_the_chunked_delta_rule_is_the_recurrence():
    """Three chunks (64, 64, 22 tokens) from a random state against token-by-token updates."""
    g = torch.Generator().manual_seed(0)
    T, H, Dk, Dv = 150, 3, 16, 8
    q, k = (l2norm(torch.randn(T, H, Dk, generator=g)) for _ in range(2))
    v = torch.randn(T, H, Dv, generator=g)
    decay = -torch.rand(T, H, generator=g) * 2  # e^g in (e^-2, 1]
    beta = torch.rand(T, H, generator=g)
    S0 = torch.randn(H, Dk, Dv, generator=g)
    o_rec, S_rec, _ = delta_rule_recurrent(q, k, v, decay, beta, S0)
    o_chunk, S_chunk = delta_rule_chunked(q, k, v, decay, beta, S0)
    diff = max((o_rec - o_chunk).abs().max().item(), (S_rec - S_chunk).abs().max().item())
    print(f"chunked vs recurrent delta rule: max |difference| {diff:.2e} (outputs and final state)")
    assert diff < 1e-4


def test_the_config_names_the_layers(pair):
    kind, _, loaded, _ = pair
    labels = [layer.label for layer in loaded.config.layers]
    assert labels == ["linear_attention", "full_attention"] * 2
    attention = loaded.config.layers[1].mixer
    assert attention.output_gate and attention.qk_norm and loaded.config.rope.partial_rotary_factor == 0.25


@pytest.mark.parametrize("budget", [32, 256])  # prompts split over steps; the long one in one step (3 delta chunks)
def test_greedy_tokens_match_transformers(pair, budget):
    """Three prompts served together, one of 150 tokens (longer than a prefill chunk), 64 tokens each."""
    kind, _, loaded, ref = pair
    batch = [prompt(n, seed=n) for n in (5, 40, 150)]
    engine = LLMEngine(loaded, None, EngineConfig(block_size=4, kv_memory_bytes=1 << 21, max_num_batched_tokens=budget))
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    assert run_all(engine, batch, params) == [reference_greedy(ref, p, 64) for p in batch], kind
    assert engine.kv.pool.check_integrity().used == 0
    engine.kv.slots.check_integrity()
    assert not engine.kv.slots.of  # every state slot back


def lookup_prompts() -> list[dict]:
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(n)] * 2} for n in (5, 17, 30, 9)]


@pytest.fixture(scope="module")
def served(pair):
    """The pair, a plain LLM over it, and the plain greedy tokens of `lookup_prompts()`."""
    kind, directory, _, _ = pair
    plain = LLM(directory, max_num_seqs=8)
    return directory, plain, [o.token_ids for o in plain.generate(lookup_prompts(), GREEDY)]


class OracleProposer:
    """Drafts the plain greedy continuation with one draft spoiled at a position that moves round by round,
    so that 0..k drafts are accepted: every rollback depth of the state is taken."""

    def __init__(self, prompts: list[list[int]], wants: list[list[int]]):
        self.full = [p + w for p, w in zip(prompts, wants)]
        self.rounds = 0

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        full = next(f for f in self.full if f[: len(token_ids)] == token_ids)
        drafts = full[len(token_ids) : len(token_ids) + k]
        self.rounds += 1
        spoil = self.rounds % (k + 1)
        if spoil < len(drafts):
            drafts[spoil] = (drafts[spoil] + 1) % 500 + 3
        return drafts


@pytest.mark.parametrize("k", [1, 3, 4])
def test_speculation_rolls_the_state_back_to_the_last_accepted_draft(served, k):
    directory, _, want = served
    ps = lookup_prompts()
    llm = LLM(directory, max_num_seqs=8, speculative_config={"method": "ngram", "num_speculative_tokens": k})
    llm.engine.spec.ngram = OracleProposer([p["prompt_token_ids"] for p in ps], want)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == want
    s = llm.engine.spec.stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert all(rate > 0 for rate in s.per_position_acceptance_rate)  # every depth accepted sometimes


def test_prompt_lookup_speculation_gives_the_same_tokens(served):
    directory, _, want = served
    llm = LLM(directory, max_num_seqs=8, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                             "prompt_lookup_min": 1})  # fmt: skip
    assert [o.token_ids for o in llm.generate(lookup_prompts(), GREEDY)] == want
    assert llm.engine.spec.stats.num_draft_tokens > 0


def test_preemption_recomputes_the_state(served):
    directory, plain, _ = served
    rng = random.Random(1)
    many = lookup_prompts() + [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(n)]} for n in (50, 20, 41)]
    want = [o.token_ids for o in plain.generate(many, GREEDY)]
    plan = plain.engine.pool_plan
    budget = 24 * plan.bytes_per_block + 8 * plan.state.bytes_per_sequence  # 24 blocks: not all seven fit
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}):
        llm = LLM(directory, max_num_seqs=8, max_model_len=128, kv_memory_bytes=budget, speculative_config=spec)
        assert llm.engine.kv.num_blocks == 24
        got = llm.generate(many, GREEDY)
        assert [o.token_ids for o in got] == want
        assert sum(o.metrics.num_preemptions for o in got) > 0
        llm.engine.kv.slots.check_integrity()


def test_n_choices_fork_the_state(served):
    """Greedy n = 3: every choice continues from a copy of the prompt's state, so each is the plain text."""
    directory, plain, want = served
    out = plain.generate(lookup_prompts()[1], SamplingParams(n=3, max_tokens=40, temperature=0, ignore_eos=True))
    assert [c.token_ids for c in out.outputs] == [want[1]] * 3
    sampled = SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=5, ignore_eos=True)
    alone = [plain.generate(lookup_prompts()[2], SamplingParams(max_tokens=20, temperature=1.0, seed=5,
                                                                 ignore_eos=True)).token_ids]  # fmt: skip
    forked = plain.generate(lookup_prompts()[2], sampled).outputs
    assert forked[0].token_ids == alone[0]  # the first choice draws as a request alone


def test_engine_bytes_are_kvlab_mems(pair):
    """KV blocks of the attention layers at a block-aligned context, plus one state slot, per sequence."""
    _, directory, loaded, _ = pair
    config = load_config(directory)
    engine = LLMEngine(loaded, None, EngineConfig(block_size=16, kv_memory_bytes=1 << 22, max_num_seqs=4))
    plan = engine.pool_plan
    for context in (16, 160, 512):
        engine_bytes = plan.blocks_per_sequence(context) * plan.bytes_per_block + plan.state.bytes_per_sequence
        assert engine_bytes == kv_bytes(config, context, kv_dtype="float32") + state_bytes(config)
    assert engine.cache.states.nbytes() == 4 * state_bytes(config) == plan.state_nbytes
    assert engine.scheduler.config.max_num_seqs == 4  # the flag's seats, each with its slot
    assert sum(t.nbytes for t in engine.cache.tensors()) == plan.nbytes  # the blocks hold only attention layers


@pytest.mark.parametrize("name", ["qwen3.5-9b", "qwen3-next-80b-a3b"])
def test_real_shapes_plan_kvlab_mems_state(name):
    """The bundled configs in bfloat16: the plan's state per sequence and KV per token are the calculator's."""
    from kvlab.kv.pool_plan import plan_kv_pool
    from kvlab.memory import kv_bytes_per_token

    config = load_config(name)
    plan = plan_kv_pool(EngineConfig(max_model_len=4096, kv_memory_bytes=1 << 30, max_num_seqs=2), config,
                        torch.bfloat16, torch.device("cpu"))  # fmt: skip
    assert plan.state.bytes_per_sequence == state_bytes(config)
    assert plan.bytes_per_token == kv_bytes_per_token(config, kv_dtype="bfloat16")
    assert plan.nbytes + plan.state_nbytes <= 1 << 30


def test_a_hybrid_gets_fewer_seats_by_default_each_with_its_state_slot():
    """Every seat holds a state slot whatever it runs, so a hybrid's default is 32, not the dense 128."""
    from kvlab.config.engine import DEFAULT_MAX_NUM_SEQS, RECURRENT_MAX_NUM_SEQS
    from kvlab.kv.pool_plan import plan_kv_pool

    cpu, options = torch.device("cpu"), {"max_model_len": 4096, "kv_memory_bytes": 8 << 30}
    hybrid = plan_kv_pool(EngineConfig(**options), load_config("qwen3.5-9b"), torch.bfloat16, cpu)
    assert hybrid.max_num_seqs == hybrid.num_state_slots == RECURRENT_MAX_NUM_SEQS == 32
    assert hybrid.state_nbytes == 32 * state_bytes(load_config("qwen3.5-9b"))
    dense = plan_kv_pool(EngineConfig(**options), load_config("qwen3-0.6b"), torch.bfloat16, cpu)
    assert dense.max_num_seqs == DEFAULT_MAX_NUM_SEQS and dense.num_state_slots == 0
    given = plan_kv_pool(EngineConfig(max_num_seqs=5, **options), load_config("qwen3.5-9b"), torch.bfloat16, cpu)
    assert given.max_num_seqs == given.num_state_slots == 5


def test_decode_steps_run_on_the_c_backend(pair):
    from kvlab.backends import choose_decode_path, expected_decode_path

    path = choose_decode_path(pair[2].model)
    assert path.backend is not None, path.reason
    assert expected_decode_path(pair[2].config).name == path.name == "cpu-c"


def test_an_uneven_head_grouping_is_one_line(tmp_path):
    import json
    import shutil

    src = build_tiny_hybrid("qwen3_5", tmp_path / "ok")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["linear_num_value_heads"] = 3
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KvlabError, match="3 value heads for 2 key heads") as e:
        load_model(bad)
    assert "\n" not in str(e.value)


def test_the_reference_engine_on_a_contiguous_cache_gives_transformers_tokens(pair):
    """The single-sequence oracle (and kvlab check, the lab): a state slot per batch row of the contiguous cache."""
    from kvlab.output.result import RequestMetrics
    from kvlab.reference import ReferenceEngine

    kind, _, loaded, ref = pair
    ids, params = prompt(100, seed=3), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for use_cache in (True, False):  # without a cache every pass recomputes from position 0
        got = list(ReferenceEngine(loaded, use_cache=use_cache).generate(ids, params, RequestMetrics()))
        assert got == reference_greedy(ref, ids, 20), (kind, use_cache)


def test_a_contiguous_cache_cannot_rewind_a_state_in_one_line(pair):
    from kvlab.kv.cache import ContiguousKVCache
    from kvlab.runner.driver import ModelDriver

    loaded = pair[2]
    cache, driver = ContiguousKVCache.for_model(loaded.config, 64), ModelDriver(loaded.model)
    driver.run(torch.tensor([prompt(10)]), cache)
    cache.truncate(5)
    with pytest.raises(KvlabError, match="cannot go back to 5") as e:
        driver.run(torch.tensor([prompt(3)]), cache)
    assert "\n" not in str(e.value)


def test_serves_plan_prints_the_kv_pool_and_the_state_pool(pair, capsys):
    from kvlab.cli import build_parser
    from kvlab.engine_cli import check_model_args, engine_options
    from kvlab.server.cli import print_plan

    _, directory, _, _ = pair
    args = build_parser().parse_args(["serve", str(directory), "--kv-memory", "4MiB", "--max-model-len", "256",
                                      "--dtype", "float32", "--max-num-seqs", "8"])  # fmt: skip
    check_model_args(args)
    plan = print_plan(args, engine_options(args))[0]
    err = capsys.readouterr().err
    assert "KV pool" in err and "state pool" in err and f"8 sequences × {state_bytes(load_config(directory)):,} B" in err
    assert plan.nbytes + plan.state_nbytes <= 4 << 20


def test_runs_footer_names_the_state_beside_the_kv_cache(pair, capsys):
    from kvlab.cli import main

    _, directory, _, _ = pair
    assert main(["run", str(directory), "Hi", "--max-tokens", "3", "--threads", "1", "--dtype", "float32"]) == 0
    err = capsys.readouterr().err
    config = load_config(directory)
    recurrent = sum(isinstance(layer.mixer, GatedDeltaNet) for layer in config.layers)
    assert f"state      {state_bytes(config) / 2**20:.2f} MiB for this sequence ({recurrent} Gated DeltaNet" in err, err


@pytest.mark.parametrize("tiled", [False, True])
def test_the_c_decode_step_is_the_modules(tiled):
    """kernels/deltanet.c against the PyTorch recurrence: 3 sequences in slots 4, 0, 2 of a pool of 5."""
    import torch.nn.functional as F

    from kvlab.kernels import deltanet as deltanet_c
    from kvlab.model.deltanet import delta_step

    g = torch.Generator().manual_seed(1)
    Hk, H, Dk, Dv, K = 2, 4, 16, 8, 4
    C = 2 * Hk * Dk + H * Dv
    mixed, w = torch.randn(3, C, generator=g), torch.randn(C, K, generator=g) * 0.5
    decay, beta = -torch.rand(3, H, generator=g), torch.rand(3, H, generator=g)
    conv, ssm = torch.randn(5, C, K - 1, generator=g), torch.randn(5, H, Dk, Dv, generator=g)
    slots = torch.tensor([4, 0, 2])
    if not deltanet_c.applies(conv, ssm, 3):
        pytest.skip("the C kernels are not built here")
    conv2, ssm2 = conv.clone(), ssm.clone()
    got = deltanet_c.decode(mixed.clone(), decay, beta, w, conv2, ssm2, slots, Hk, tiled)

    window = torch.cat([conv[slots], mixed[:, :, None]], dim=2)
    xc = F.silu((window * w).sum(-1))
    q, k, v = xc.split((Hk * Dk, Hk * Dk, H * Dv), dim=-1)
    spread = (lambda x: x.repeat(1, H // Hk, 1)) if tiled else (lambda x: x.repeat_interleave(H // Hk, dim=1))
    q = spread(l2norm(q.reshape(3, Hk, Dk))) * Dk**-0.5
    k = spread(l2norm(k.reshape(3, Hk, Dk)))
    want, S = delta_step(ssm[slots], q, k, v.reshape(3, H, Dv), decay, beta)
    assert (got - want).abs().max() < 1e-5
    assert (ssm2[slots] - S).abs().max() < 1e-5 and torch.equal(conv2[slots], window[:, :, 1:])
    untouched = torch.tensor([1, 3])
    assert torch.equal(ssm2[untouched], ssm[untouched]) and torch.equal(conv2[untouched], conv[untouched])


def test_lab_context_on_a_hybrid_counts_its_recurrent_layers_and_judges_by_the_bytes(tmp_path, capsys):
    """Seed 000's claim for hybrids: the step grows only with the attention layers' cache. The lab's run
    names the recurrent layers, and the verdict compares the step's growth with what its bytes predict."""
    import json

    from tiny_hybrid import build_tiny_hybrid

    from kvlab.cli import main
    from kvlab.lab.context import verdict

    directory = build_tiny_hybrid("qwen3_5", tmp_path / "h")
    capsys.readouterr()
    assert main(["lab", "context", "-m", str(directory), "--quick", "-o", str(tmp_path / "out")]) == 0
    data = json.loads((tmp_path / "out" / "results.json").read_text())["experiments"]["context"]
    config = load_config(directory)
    assert data["num_layers"] == config.num_layers
    assert data["recurrent_layers"] == sum(isinstance(layer.mixer, GatedDeltaNet) for layer in config.layers) > 0

    def point(context, ms, kv):
        return {"context": context, "step": {"median_s": ms / 1e3}, "kv_bytes_read": kv,
                "weight_bytes_read": 100e6, "kv_share": kv / (kv + 100e6), "slowdown": ms / 40}  # fmt: skip

    flat = {"recurrent_layers": 3, "num_layers": 4, "points": [point(10, 40, 1e5), point(4000, 42, 6e6)]}
    assert verdict(flat).startswith("Held: 3 of 4 layers keep a constant state")
    grows = {**flat, "points": [point(10, 40, 1e5), point(4000, 80, 6e6)]}  # twice as slow for 6% more bytes
    assert verdict(grows).startswith("Did not hold")
