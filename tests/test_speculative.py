"""Speculative decoding on tiny random models: exact greedy output, the target's distribution when sampling,
the same text for the same seed, KV rollback that leaves the pool whole, and the errors bad input gets.

The draft model is the target with noise added to every weight: it agrees often, not always, so both
the accepted and the rejected paths run.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.config.speculative import SpeculativeConfig, from_flags
from kvlab.errors import KvlabError
from kvlab.spec_decode.metrics import SpecDecodingStats, expected_tokens_per_round, predicted_speedup
from kvlab.spec_decode.ngram_proposer import NgramProposer

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from tiny import build_tiny

    return build_tiny("llama", tmp_path_factory.mktemp("spec-target"))


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory):
    """The target's weights plus noise (30% of each tensor's spread): a draft that is right about half the time."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.3)
    directory = tmp_path_factory.mktemp("spec-draft")
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def plain(target):
    return LLM(target, max_num_seqs=8)


def prompts(seed: int = 0, repeat: int = 2) -> list[dict]:
    """Random prompts, each its own tokens repeated (something for prompt lookup to find), of several lengths."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(n)] * repeat} for n in (5, 17, 30, 9)]


def ngram(k: int, **extra) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, **extra}


def drafted(llm: LLM) -> SpecDecodingStats:
    return llm.engine.spec.stats


def check_pool(llm: LLM) -> None:
    engine = llm.engine
    ledger = engine.ledger()
    assert ledger.is_balanced and ledger.held_blocks == engine.kv.pool.check_integrity().used


# ---- configuration -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "unknown speculative method 'medusa'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in 1..16"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens must be an integer in 1..16"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens must be an integer"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
        ({"method": "ngram"}, 'needs "num_speculative_tokens"'),
        ({"method": "draft_model", "num_speculative_tokens": 2}, 'draft_model needs the draft "model"'),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "1 ≤ prompt_lookup_min ≤ prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, "unknown speculative config key 'k'"),
        ("{not json", "is not JSON"),
        ("[1, 2]", "is a JSON object"),
    ],
)
def test_bad_configs_are_refused_in_one_line(bad, message):
    with pytest.raises(KvlabError, match=message.replace("(", r"\(")) as e:
        SpeculativeConfig.parse(bad)
    assert "\n" not in str(e.value)


def test_flags_shorthands_make_the_config():
    assert from_flags(None, None, None) is None
    c = from_flags(None, "qwen2.5-coder-0.5b", 3)
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "qwen2.5-coder-0.5b", 3)
    c = from_flags('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}', None, 5)
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max) == ("ngram", 5, 3)
    with pytest.raises(KvlabError, match="needs a proposer"):
        from_flags(None, None, 4)


def test_a_draft_with_another_tokenizer_is_refused_at_load(tiny_chat_model, tmp_path):
    import json
    import shutil

    from tiny import build_tiny

    other = build_tiny("llama", tmp_path / "other", seed=3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_chat_model / name, other / name)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]  # two ordinary tokens swap ids: the same strings, other ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(KvlabError, match="has another tokenizer than the target") as e:
        LLM(tiny_chat_model, speculative_config={"model": str(other), "num_speculative_tokens": 2})
    assert "\n" not in str(e.value)


def test_mtp_is_refused_with_the_reason(target):
    with pytest.raises(KvlabError, match="has no MTP heads"):
        LLM(target, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


# ---- the proposer and the arithmetic -------------------------------------------------------------------


def test_prompt_lookup_takes_the_longest_suffix_and_its_latest_match():
    p = NgramProposer(1, 3)
    #            0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 2, 6, 7]
    assert p.propose(tokens, 2) == [1, 2]  # "6 7" last seen at 5..6, followed by 1 2 (not the earlier 8 9)
    assert p.propose([5, 6, 7, 8, 5, 6, 7], 3) == [8, 5, 6]  # the 3-gram 5 6 7
    assert p.propose([1, 2, 3], 2) == []  # nothing repeats
    assert NgramProposer(2, 2).propose([1, 2, 9, 2], 2) == []  # only a 1-gram matches: below prompt_lookup_min
    assert p.propose([256, 1, 0, 0, 1], 1) == [0]  # ids whose bytes overlap (256 = 00 01 00 00) match whole only


def test_speedup_formula_is_leviathans():
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
    assert predicted_speedup(0.7, 4, 0.3) == pytest.approx((1 - 0.7**5) / (0.3 * 2.2))
    s = SpecDecodingStats()
    s.observe(4, 2)
    s.observe(4, 4)
    s.observe(2, 0)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 10, 6)
    assert s.num_accepted_tokens_per_pos == [2, 2, 1, 1]
    assert s.acceptance_rate == 0.6 and s.mean_acceptance_length == 3.0
    assert s.per_position_acceptance_rate == [2 / 3, 2 / 3, 0.5, 0.5]


# ---- greedy: token for token -----------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_with_prompt_lookup_is_plain_decoding_token_for_token(plain, target, k):
    want = [o.token_ids for o in plain.generate(prompts(), GREEDY)]
    llm = LLM(target, max_num_seqs=8, speculative_config=ngram(k))
    got = llm.generate(prompts(), GREEDY)
    assert [o.token_ids for o in got] == want
    s = drafted(llm)
    assert s.num_accepted_tokens > 0 and s.num_accepted_tokens < s.num_draft_tokens  # both paths ran
    assert got[0].metrics.spec_decoding["num_drafts"] > 0
    check_pool(llm)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_with_a_draft_model_is_plain_decoding_token_for_token(plain, target, draft, k):
    want = [o.token_ids for o in plain.generate(prompts(1, repeat=1), GREEDY)]
    llm = LLM(target, max_num_seqs=8, speculative_config={"model": str(draft), "num_speculative_tokens": k})
    assert [o.token_ids for o in llm.generate(prompts(1, repeat=1), GREEDY)] == want
    s = drafted(llm)
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    check_pool(llm)
    assert not llm.engine.spec.draft.kv.block_tables  # every draft shadow freed with its request


def test_a_batch_mixing_speculating_and_plain_requests(plain, target, draft):
    """Greedy ones speculate; penalties, log-probabilities and short max_tokens decode plainly, in the same steps."""
    params = [GREEDY, SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_tokens=1, temperature=0), SamplingParams(max_tokens=25, temperature=0, logprobs=2,
                                                                          ignore_eos=True)]  # fmt: skip
    ps = prompts(2)
    want = [plain.generate(p, sp) for p, sp in zip(ps, params)]
    for config in (ngram(3), {"model": str(draft), "num_speculative_tokens": 3}):
        llm = LLM(target, max_num_seqs=8, speculative_config=config)
        streams = [llm.stream(p, sp) for p, sp in zip(ps, params)]
        for s in streams:
            s.start()
        got = [s.finish() for s in streams]
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert got[3].outputs[0].logprobs is not None and len(got[3].outputs[0].logprobs) == 25
        assert got[0].metrics.spec_decoding["num_drafts"] > 0
        assert got[1].metrics.spec_decoding["num_drafts"] == 0  # penalties: never drafted
        check_pool(llm)


def test_greedy_identity_through_prefix_hits_and_max_tokens_inside_drafts(plain, target):
    shared = prompts(3)[2]["prompt_token_ids"]  # 60 tokens: three whole blocks to share
    ps = [{"prompt_token_ids": shared + [7, 8, 9][: i + 1]} for i in range(3)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 17, 33)]
    want = [plain.generate(p, sp).token_ids for p, sp in zip(ps, params)]
    llm = LLM(target, max_num_seqs=8, speculative_config=ngram(5))
    got = [llm.generate(p, sp) for p, sp in zip(ps, params)]  # one after another: later ones hit the cache
    assert [o.token_ids for o in got] == want
    assert got[2].metrics.cached_prompt_tokens >= 48
    again = llm.generate(ps[2], params[2])  # its own generated blocks (accepted drafts' included) hit too
    assert again.token_ids == want[2]
    check_pool(llm)


def test_greedy_identity_under_preemption(plain, target, draft):
    many = prompts(4) + prompts(5)
    want = [o.token_ids for o in plain.generate(many, GREEDY)]
    for config in (ngram(4), {"model": str(draft), "num_speculative_tokens": 4}):
        # 24 blocks of 16 tokens: eight sequences of up to 100 tokens cannot all fit
        llm = LLM(target, max_num_seqs=8, max_model_len=128, kv_memory_bytes=24 * plain.engine.pool_plan.bytes_per_block,
                  speculative_config=config)  # fmt: skip
        assert llm.engine.kv.num_blocks == 24
        got = llm.generate(many, GREEDY)
        assert [o.token_ids for o in got] == want
        assert sum(o.metrics.num_preemptions for o in got) > 0
        check_pool(llm)


def test_sliding_window_layers_roll_back_too(tmp_path):
    from tiny import build_tiny

    path = build_tiny("gemma3", tmp_path / "gemma3")
    ps = prompts(6, repeat=3)
    want = [o.token_ids for o in LLM(path).generate(ps, GREEDY)]
    llm = LLM(path, speculative_config=ngram(4))
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == want
    assert drafted(llm).num_draft_tokens > 0
    check_pool(llm)


def test_the_pool_and_its_ledger_stay_whole_after_every_rollback(target, draft):
    llm = LLM(target, max_num_seqs=4, max_num_batched_tokens=24,
              speculative_config={"model": str(draft), "num_speculative_tokens": 5})  # fmt: skip
    engine = llm.engine
    for p in prompts(7):
        engine.add_request(p["prompt_token_ids"], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    rolled_back = 0
    while engine.has_unfinished_requests:
        engine.step()
        check_pool(llm)
        ledger = engine.ledger()
        assert ledger.tokens + ledger.unused_slots == engine.kv.block_size * sum(r.blocks for r in ledger.requests.values())
        for rid, kv in ledger.requests.items():  # no request holds a block past what it computed
            assert kv.blocks == engine.kv.blocks_for(engine.kv._requests[rid].num_computed_tokens)
        rolled_back = drafted(llm).num_draft_tokens - drafted(llm).num_accepted_tokens
    assert rolled_back > 0
    assert engine.kv.pool.check_integrity().used == 0
    assert not engine.spec.draft.kv.block_tables and engine.spec.draft.kv.pool.check_integrity().used == 0


# ---- sampling: the target's distribution, the seed's text ---------------------------------------------------


def test_sampled_prompt_lookup_gives_plain_decodings_text_for_the_same_seed(plain, target):
    llm = LLM(target, max_num_seqs=8, speculative_config=ngram(4))
    for sp in (SamplingParams(max_tokens=30, temperature=0.7, top_k=20, seed=3, ignore_eos=True),
               SamplingParams(max_tokens=30, temperature=0.5, top_p=0.9, min_p=0.05, seed=4, ignore_eos=True)):  # fmt: skip
        assert [o.token_ids for o in llm.generate(prompts(8, 3), sp)] == [
            o.token_ids for o in plain.generate(prompts(8, 3), sp)
        ]
    assert drafted(llm).num_accepted_tokens > 0


def test_sampled_draft_model_gives_the_same_text_for_the_same_seed(target, draft):
    config = {"model": str(draft), "num_speculative_tokens": 3}
    sp = SamplingParams(max_tokens=30, temperature=0.8, seed=11, ignore_eos=True)
    a = LLM(target, max_num_seqs=8, speculative_config=config)
    first = [o.token_ids for o in a.generate(prompts(9), sp)]
    assert [o.token_ids for o in a.generate(prompts(9), sp)] == first  # the same engine again
    b = LLM(target, max_num_seqs=2, speculative_config=config)  # another engine, other batches
    assert [o.token_ids for o in b.generate(prompts(9), sp)] == first
    alone = b.generate(prompts(9)[1], sp)
    assert alone.token_ids == first[1]
    other = SamplingParams(max_tokens=30, temperature=0.8, seed=12, ignore_eos=True)
    assert [o.token_ids for o in b.generate(prompts(9), other)] != first


def chi_square_p_value(counts: dict[int, int], probs: dict[int, float]) -> tuple[float, int]:
    """(p-value, degrees of freedom) of Pearson's test of `counts` against `probs` (categories of p > 0)."""
    n = sum(counts.values())
    assert set(counts) <= set(probs), "a token the target gives probability 0 was drawn"
    stat = sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in probs.items())
    dof = len(probs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2))), dof


def target_probs(llm: LLM, ids: list[int], params: SamplingParams) -> dict[int, float]:
    """The target's own distribution of the token after `ids` under `params` (one plain forward)."""
    from kvlab.kv.cache import NoCache
    from kvlab.sampling.sampler import Sampler

    logits = llm.engine.runner.driver.run(torch.tensor([ids]), NoCache(llm.config.num_layers))[0]
    probs = Sampler(params).probabilities(logits)
    return {i: float(p) for i, p in enumerate(probs.tolist()) if p > 0}


def test_rejection_sampling_keeps_the_targets_distribution(target, draft):
    """4,000 seeded runs; the second token is the first one the verifier decides (accepted draft or
    resampled residual). Its frequencies, for each first token, against the target's own probabilities:
    Pearson's chi-square at 0.1% over all groups together. Seeds are fixed: the outcome is fixed too."""
    config = {"model": str(draft), "num_speculative_tokens": 2}
    llm = LLM(target, max_num_seqs=64, speculative_config=config)
    prompt = prompts(10, 1)[0]["prompt_token_ids"]
    sp = [SamplingParams(max_tokens=3, temperature=1.0, top_k=6, seed=s, ignore_eos=True) for s in range(4000)]
    engine = llm.engine
    for i, p in enumerate(sp):
        engine.add_request(prompt, p, request_id=f"r{i}")
    outs = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.output.token_ids
    s = drafted(llm)
    assert s.num_drafts >= 4000 and 0.2 < s.acceptance_rate < 0.9  # both the accepted and the rejected paths
    by_first: dict[int, dict[int, int]] = {}
    for tokens in outs.values():
        by_first.setdefault(tokens[0], {}).setdefault(tokens[1], 0)
        by_first[tokens[0]][tokens[1]] += 1
    stat_groups = 0
    p_values = []
    for first, counts in sorted(by_first.items()):
        if sum(counts.values()) < 300:
            continue
        probs = target_probs(llm, prompt + [first], sp[0])
        p_values.append(chi_square_p_value(counts, probs)[0])
        stat_groups += 1
    assert stat_groups >= 3
    # Fisher's method would combine them; a Bonferroni bound is enough: each at 0.1% / groups
    assert min(p_values) > 0.001 / stat_groups, p_values


def test_the_rule_itself_against_a_far_draft():
    """The verifier alone, with a draft distribution q far from p (most drafts rejected): 4,000 seeded
    draws of the first kept token follow p, not q."""
    from kvlab.request import Request
    from kvlab.sampling.sampler import BatchSampler
    from kvlab.spec_decode.rejection_sampler import RejectionSampler, _invert

    V = 8
    p_logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    q = torch.softmax(torch.tensor([-1.0, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0]), -1)
    counts: dict[int, int] = {}
    accepted = 0
    for seed in range(4000):
        sampler = BatchSampler(V)
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=4)
        r = Request("r", [1], params, max_tokens=4)
        state = sampler.state("r", params, [1])
        d = _invert(q, state.uniform())
        r.spec_token_ids = [d]
        tokens, a = RejectionSampler(sampler).verify(r, torch.stack([p_logits, p_logits]), q[None])
        counts[tokens[0]] = counts.get(tokens[0], 0) + 1
        accepted += a
    p = torch.softmax(p_logits, -1).tolist()
    p_value, _ = chi_square_p_value(counts, {i: x for i, x in enumerate(p)})
    assert p_value > 0.001
    assert 0.15 * 4000 < accepted < 0.6 * 4000


# ---- the interfaces: server, command line ---------------------------------------------------------------


def test_the_server_exports_vllms_counters_and_refuses_bad_input_with_a_400(tiny_chat_model):
    from loopback import serving

    llm = LLM(tiny_chat_model, speculative_config=ngram(3))
    plain_llm = LLM(tiny_chat_model)
    body = {"model": "tiny", "prompt": "The capital of France is Paris. The capital of France is",
            "max_tokens": 24, "temperature": 0, "ignore_eos": True}  # fmt: skip
    with serving(plain_llm) as s:
        want = s.post("/v1/completions", body).json()["choices"][0]["text"]
        r = s.post("/v1/completions", {**body, "num_speculative_tokens": 2})  # this server does not speculate
        assert r.status_code == 400 and r.json()["error"]["param"] == "num_speculative_tokens"
        assert "does not speculate" in r.json()["error"]["message"]
    with serving(llm) as s:
        r = s.post("/v1/completions", body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        assert r.json()["kvlab"]["spec_decoding"]["num_drafts"] > 0
        off = s.post("/v1/completions", {**body, "num_speculative_tokens": 0}).json()
        assert off["choices"][0]["text"] == want and off["kvlab"]["spec_decoding"]["num_drafts"] == 0
        for bad in (5, -1, "2", 1.5):
            r = s.post("/v1/completions", {**body, "num_speculative_tokens": bad})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "num_speculative_tokens" and err["type"] == "invalid_request_error"
        text = s.get("/metrics").text
        stats = llm.engine.spec.stats
        assert f'kvlab_spec_decode_num_drafts_total{{model_name="tiny"}} {stats.num_drafts}' in text
        assert f'kvlab_spec_decode_num_draft_tokens_total{{model_name="tiny"}} {stats.num_draft_tokens}' in text
        assert f'kvlab_spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {stats.num_accepted_tokens}' in text
        first = stats.num_accepted_tokens_per_pos[0]
        assert f'kvlab_spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="0"}} {first}' in text
        assert stats.num_drafts > 0


def kvlab(*args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "kvlab", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--speculative-config", '{"method": "eagle9", "num_speculative_tokens": 2}'], "unknown speculative method"),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'], "num_speculative_tokens must be"),
        (["--num-speculative-tokens", "3"], "needs a proposer"),
        (["--speculative-config", "{method: ngram}"], "is not JSON"),
    ],
)
def test_the_command_line_refuses_bad_speculation_in_one_line_with_exit_2(target, flags, message):
    r = kvlab("run", str(target), "hi", "--max-tokens", "2", *flags)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_kvlab_run_prints_the_speculative_line(tiny_chat_model):
    r = kvlab("run", str(tiny_chat_model), "The capital of France is Paris. The capital of France is", "--max-tokens",
              "30", "--ignore-eos", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if x.startswith("speculative ngram"))
    assert "α" in line and "mean acceptance length" in line and "speedup predicted" in line
    # one decode rate in the footer (its decode line); the speculative line's rate is the plain steps', labelled
    assert line.count("tok/s") <= 1 and ("tok/s" not in line or "tok/s without drafts" in line), line
    import json

    # the target as its own draft: greedy, every draft is accepted
    r = kvlab("run", str(tiny_chat_model), "The capital", "--json", "--max-tokens", "12", "--ignore-eos",
              "--speculative-model", str(tiny_chat_model), "--num-speculative-tokens", "2")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)["speculative"]
    assert d["num_speculative_tokens"] == 2 and d["num_drafts"] > 0 and d["acceptance_rate"] == 1.0


# ---- MTP heads: detected, kept out of the trunk and the KV pool, reported ----------------------------------------


def test_mtp_blocks_in_a_gguf_are_detected_and_kept_out_of_the_trunk(tiny_chat_model, tmp_path):
    from tiny import build_tiny_gguf

    from kvlab.config import load_config

    plain_file = build_tiny_gguf(tiny_chat_model, tmp_path / "plain.gguf")
    mtp_file = build_tiny_gguf(tiny_chat_model, tmp_path / "mtp.gguf", mtp_blocks=1)
    config, plain_config = load_config(mtp_file), load_config(plain_file)
    assert len(config.mtp_layers) == 1 and config.mtp_layers[0].mtp
    assert config.num_layers == plain_config.num_layers == 3  # block_count 4 in the file: 3 trunk blocks
    llm = LLM(mtp_file)
    assert len(llm.loaded.model.layers) == 3
    base = LLM(plain_file)
    assert llm.engine.pool_plan.bytes_per_token == base.engine.pool_plan.bytes_per_token  # no KV for the MTP block
    greedy = SamplingParams(max_tokens=8, temperature=0)
    assert llm.generate("The capital", greedy).token_ids == base.generate("The capital", greedy).token_ids
    with pytest.raises(KvlabError, match="has 1 MTP layer"):
        LLM(mtp_file, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    r = kvlab("run", str(mtp_file), "The capital", "--max-tokens", "3")
    assert r.returncode == 0 and "MTP heads  1 layer(s)" in r.stderr, r.stderr
    r = kvlab("mem", str(mtp_file))
    assert r.returncode == 0 and "1 MTP layer" in r.stdout + r.stderr, r.stdout + r.stderr


def test_adaptive_speculation_keeps_the_output(plain, target, draft):
    """Adaptive speculation stops drafting for a request whose acceptance loses by the measured costs;
    whatever it decides, the greedy text is plain decoding's."""
    want = [o.token_ids for o in plain.generate(prompts(12), GREEDY)]
    llm = LLM(target, max_num_seqs=8, speculative_config={"model": str(draft), "num_speculative_tokens": 4,
                                                          "adaptive": True})  # fmt: skip
    assert [o.token_ids for o in llm.generate(prompts(12), GREEDY)] == want
    check_pool(llm)


def test_row_costs_interpolate_and_never_reach_zero():
    from kvlab.spec_decode import RowCosts

    costs = RowCosts()
    assert costs.estimate(4) is None
    costs.observe(2, 0.010)
    assert costs.estimate(8) == 0.010  # one point: flat
    costs.observe(6, 0.030)
    assert costs.estimate(4) == pytest.approx(0.020)  # between: linear
    assert costs.estimate(10) == pytest.approx(0.050)  # past: the last slope
    assert 0 < costs.estimate(1) <= 0.010  # before: below the first, above zero
    costs.observe(6, 0.020)  # a new measurement moves the average, not replaces it
    assert costs.estimate(6) == pytest.approx(0.027)


def test_the_draft_model_stores_kv_as_the_target_does_or_says_why_not(tmp_path):
    from tiny import build_tiny

    target = build_tiny("llama", tmp_path / "target", head_dim=32)
    draft = build_tiny("llama", tmp_path / "draft", seed=1, head_dim=32)
    config = {"model": str(draft), "num_speculative_tokens": 2}
    llm = LLM(target, kv_cache_dtype="q8_0", speculative_config=config)
    assert llm.engine.spec.draft.cache.formats == llm.engine.cache.formats  # q8_0, rotated: the target's
    assert llm.engine.cache.formats.k.name == "q8_0" and drafted_output(llm)
    narrow = build_tiny("llama", tmp_path / "narrow", seed=1)  # head_dim 16: no q8_0 block of 32 fits
    with pytest.raises(KvlabError, match="cannot hold the target's KV cache"):
        LLM(target, kv_cache_dtype="q8_0", speculative_config={"model": str(narrow), "num_speculative_tokens": 2})


def drafted_output(llm: LLM) -> bool:
    out = llm.generate(prompts()[0], GREEDY)
    return len(out.token_ids) == GREEDY.max_tokens and drafted(llm).num_drafts > 0
