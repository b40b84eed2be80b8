"""MTP speculation: Qwen3.5's and Qwen3-Next's own multi-token-prediction module as the proposer.

Tiny hybrids with random `mtp.*` tensors: greedy output is plain decoding's at k = 1..4; the drafts are what an
independent computation gives (transformers' final hidden states through the MTP module over a plain contiguous
cache), and what the same module written as a GGUF nextn block gives; a copy whose head agrees with the model by
construction (tests/tiny_hybrid.py: make_agreeing) has every draft accepted, from the folder and from GGUF.
Without MTP speculation the module is never loaded; other architectures' MTP blocks are refused in one line.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from tiny_hybrid import HYBRID_ARCHS, build_tiny_hybrid, make_agreeing

from kvlab.config import load_config
from kvlab.errors import KvlabError
from kvlab.kv.cache import ContiguousKVCache, build_metadata
from kvlab.llm import LLM
from kvlab.memory import count_params
from kvlab.model.mtp import load_mtp_head
from kvlab.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=HYBRID_ARCHS)
def folder(request, tmp_path_factory):
    return request.param, build_tiny_hybrid(request.param, tmp_path_factory.mktemp(request.param + "-mtp"), mtp=True)


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def prompts() -> list[dict]:
    rng = random.Random(0)
    return [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(n)]} for n in (5, 17, 30, 70)]


@pytest.fixture(scope="module")
def plain(folder):
    llm = LLM(folder[1], max_num_seqs=8)
    return llm, [o.token_ids for o in llm.generate(prompts(), GREEDY)]


def test_without_mtp_speculation_the_module_is_not_loaded(folder, plain):
    llm, _ = plain
    assert llm.loaded.config.mtp_layers and llm.engine.spec is None
    held = sum(p.numel() for p in llm.loaded.model.parameters())
    assert held == count_params(load_config(folder[1])).total  # the trunk's parameters, no mtp.*


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_with_mtp_is_plain_decoding(folder, plain, k):
    _, want = plain
    llm = LLM(folder[1], max_num_seqs=8, speculative_config=mtp(k))
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == want
    stats = llm.engine.spec.stats
    assert stats.num_draft_tokens > 0
    assert not llm.engine.spec.draft.kv.block_tables  # every shadow freed with its request
    report = llm.engine.spec.report()
    assert report.method == "mtp" and "α" in report.line()


def test_the_drafts_are_an_independent_computations(folder):
    """The first round's drafts of a prompt: transformers' post-norm hidden states of the prompt, fed with the
    next tokens through the MTP head over a plain contiguous cache, the head's own output fed back."""
    import transformers

    kind, directory = folder
    ids = prompts()[3]["prompt_token_ids"]
    llm = LLM(directory, speculative_config=mtp(3))
    engine = llm.engine
    engine.add_request(ids, GREEDY)
    engine.step()  # the prompt, its first token, then the first drafts
    request = engine.scheduler.running[0]
    drafts, first = list(request.spec_token_ids), request.all_token_ids[len(ids)]

    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    head = load_mtp_head(llm.loaded)
    with torch.inference_mode():
        h = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]  # [1, T, E], after the final norm
        cache = ContiguousKVCache.for_model(head.config, 128)
        tokens, expected = ids[1:] + [first], []
        for _ in range(3):
            n = len(tokens) - cache.length
            head.hidden_in = h[:, -n:]
            logits = head(torch.tensor([tokens[-n:]]), cache, build_metadata(cache.length, n, 1, "cpu"))
            cache.length += n
            expected.append(int(logits[0].argmax()))
            tokens.append(expected[-1])
            h = head.hidden_out
    assert drafts == expected, kind


def test_an_agreeing_head_has_every_draft_accepted(folder, tmp_path):
    kind, directory = folder
    agree = tmp_path / "agree"
    shutil.copytree(directory, agree)
    make_agreeing(agree)
    want = [o.token_ids for o in LLM(agree).generate(prompts(), GREEDY)]
    for k in (1, 4):
        llm = LLM(agree, max_num_seqs=8, speculative_config=mtp(k))
        assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == want
        s = llm.engine.spec.stats
        print(f"{kind} agreeing MTP head, k={k}: α {s.acceptance_rate:.3f} ({s.num_accepted_tokens}/{s.num_draft_tokens})")
        assert s.acceptance_rate >= 0.99


def first_drafts(source, ids: list[int], k: int = 3) -> list[int]:
    engine = LLM(source, speculative_config=mtp(k)).engine
    engine.add_request(ids, GREEDY)
    engine.step()  # the prompt, its first token, then the first drafts
    return list(engine.scheduler.running[0].spec_token_ids)


def test_a_gguf_files_nextn_block_drafts_what_the_folders_mtp_does(folder, tmp_path):
    """The folder written as llama.cpp does (blk.N.nextn.eh_proj / enorm / hnorm / shared_head_norm, the layer
    under its own names, norms + 1): the same drafts, and an agreeing copy's α of 1 from the file too."""
    from tiny_hybrid import build_tiny_hybrid_gguf

    kind, directory = folder
    gguf = build_tiny_hybrid_gguf(directory, tmp_path / "m.gguf", kind)
    ids = prompts()[3]["prompt_token_ids"]
    assert first_drafts(gguf, ids) == first_drafts(directory, ids), kind
    agree = tmp_path / "agree"
    shutil.copytree(directory, agree)
    make_agreeing(agree)
    llm = LLM(build_tiny_hybrid_gguf(agree, tmp_path / "agree.gguf", kind), speculative_config=mtp(4))
    llm.generate(prompts(), GREEDY)
    assert llm.engine.spec.stats.acceptance_rate >= 0.99


def test_llm_lets_the_files_parse_go_and_a_later_head_reads_the_file_again(folder, tmp_path):
    """LLM() keeps no parse of a GGUF file once its tokenizer and engine are built (resident metadata: the
    vocabulary as Python objects); an MTP head loaded later from the same model opens the file again and
    holds the same tensors as one loaded from the loader's own parse."""
    from tiny_hybrid import build_tiny_hybrid_gguf

    from kvlab.model.loader import load_model

    kind, directory = folder
    gguf = build_tiny_hybrid_gguf(directory, tmp_path / "m.gguf", kind)
    llm = LLM(gguf)
    assert llm.loaded.gguf is None
    parsed = load_model(gguf)
    assert parsed.gguf is not None
    later, first = load_mtp_head(llm.loaded).state_dict(), load_mtp_head(parsed).state_dict()
    assert later.keys() == first.keys() and len(first) > 0, kind
    for name, t in first.items():
        assert torch.equal(later[name], t), (kind, name)


def test_mtp_of_another_architecture_is_refused_in_one_line(tmp_path):
    """A llama GGUF with a nextn block: detected, counted, not run (tests/test_speculative.py checks the rest)."""
    from tiny import add_tiny_tokenizer, build_tiny, build_tiny_gguf

    llama = add_tiny_tokenizer(build_tiny("llama", tmp_path / "llama"))
    mtp_file = build_tiny_gguf(llama, tmp_path / "mtp.gguf", mtp_blocks=1)
    with pytest.raises(KvlabError, match="kvlab runs the MTP modules of") as e:
        LLM(mtp_file, speculative_config=mtp(1))
    assert "\n" not in str(e.value)


def test_a_hybrid_draft_model_is_refused_in_one_line(folder):
    with pytest.raises(KvlabError, match="has Gated DeltaNet layers") as e:
        LLM(folder[1], speculative_config={"model": str(folder[1]), "num_speculative_tokens": 2})
    assert "\n" not in str(e.value)
