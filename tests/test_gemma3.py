"""Gemma 3 on tiny random models against transformers' Gemma3ForCausalLM, in float32.

The windows (12 tokens, 3 blocks of 4) are shorter than the prompts, the layer kinds mixed (two KV
groups of sliding layers, one of full ones): last-position logits within 1e-4 and 32 greedy tokens
identical alone, with chunked prefill, after a prefix hit and in a batch of different lengths, through
the windowed paged cache; the same model converted to GGUF the way llama.cpp converts it (norms + 1,
its own 5:1 pattern and local rotary base) gives the same logits.
"""

from __future__ import annotations

import pytest
import torch
from test_paged import run_all
from test_real import reference_greedy
from tiny import add_tiny_tokenizer, build_tiny, build_tiny_gguf

from kvlab.config import EngineConfig, load_config
from kvlab.engine import LLMEngine
from kvlab.backends.cpu import CpuDecodeBackend
from kvlab.kv.cache import ContiguousKVCache
from kvlab.model.loader import load_model
from kvlab.runner.driver import ModelDriver
from kvlab.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest

WINDOW = 12
LAYERS = ["sliding_attention", "sliding_attention", "full_attention"] * 2
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(our LoadedModel, transformers' model) on the same tiny random Gemma 3."""
    import transformers

    directory = build_tiny("gemma3", tmp_path_factory.mktemp("gemma3"), window=WINDOW, layer_types=LAYERS)
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return load_model(directory), ref


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def hf_greedy(ref, ids: list[int], n: int = 32) -> list[int]:
    return reference_greedy(ref, ids, n)


def serve(loaded, batch: list[list[int]], check=None, **options) -> list[list[int]]:
    """Greedy tokens of every prompt, served together by the engine (4-token blocks), checked between steps."""
    engine = LLMEngine(loaded, None, EngineConfig(block_size=4, kv_memory_bytes=1 << 21, **options))

    def balanced(engine):
        ledger = engine.ledger()
        assert ledger.is_balanced and ledger.held_blocks == engine.kv.pool.check_integrity().used
        if check:
            check(engine)

    tokens = run_all(engine, batch, GREEDY, check=balanced)
    assert engine.kv.pool.check_integrity().used == 0
    return tokens


def test_the_config_carries_gemmas_facts(pair):
    loaded, _ = pair
    c = loaded.config
    assert [layer.mixer.window for layer in c.layers] == [WINDOW, WINDOW, None] * 2
    thetas = [layer.mixer.rope.theta if layer.mixer.rope else None for layer in c.layers]
    assert thetas == [10_000.0, 10_000.0, None] * 2
    assert c.rope.theta == 1_000_000.0 and c.embedding_scale == 64**0.5 and c.norm_offset == 1.0
    assert c.layers[0].mixer.scale == 24**-0.5 and c.final_logit_softcap == 30.0 and c.layers[0].norms == 4
    assert isinstance(CpuDecodeBackend.build(loaded.model), CpuDecodeBackend)  # four norms, GELU, windows: all in C


def test_last_position_logits_match_transformers_past_the_window(pair):
    loaded, ref = pair
    ids = torch.tensor([prompt(40)])
    with torch.inference_mode():
        expected = ref(ids).logits[:, -1]
        got = ModelDriver(loaded.model).run(ids, ContiguousKVCache.for_model(loaded.config, 64))
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 7}, {"windowed_kv": False}],
                         ids=["alone", "chunked-prefill", "full-cache"])  # fmt: skip
def test_32_greedy_tokens_match_transformers(pair, options):
    loaded, ref = pair
    ids = prompt(30, seed=1)
    assert serve(loaded, [ids], **options) == [hf_greedy(ref, ids)]


def test_a_batch_of_different_lengths_matches_transformers(pair):
    loaded, ref = pair
    batch = [prompt(n, seed=n) for n in (5, 13, 26, 40)]
    assert serve(loaded, batch, max_num_batched_tokens=32) == [hf_greedy(ref, p) for p in batch]


def test_a_prefix_hit_past_the_window_matches_transformers(pair):
    """The second prompt shares 36 tokens with the first: its sliding groups find the window's blocks cached."""
    loaded, ref = pair
    first = prompt(40, seed=3)
    second = first[:36] + prompt(6, seed=4)
    engine = LLMEngine(loaded, None, EngineConfig(block_size=4, kv_memory_bytes=1 << 21))
    outs = [run_all(engine, [ids], GREEDY)[0] for ids in (first, second)]
    assert engine.kv.stats.hits == 36
    assert outs == [hf_greedy(ref, first), hf_greedy(ref, second)]


def test_sliding_blocks_go_back_to_the_pool_while_the_request_runs(pair):
    loaded, _ = pair
    seen = []

    def check(engine):  # a sliding group holds at most its window (W − 1 = 11 tokens) rounded out, plus one block
        for rid, tables in engine.kv.block_tables.items():
            request = engine.kv._requests[rid]
            for group, table in zip(engine.kv.groups, tables):
                held = [b for b in table if b >= 0]
                if group.window:
                    assert len(held) <= -(-(WINDOW - 1) // 4) + 1, (request.num_computed_tokens, table)
                    seen.append(table.count(-1))
                else:
                    assert len(held) == -(-request.num_computed_tokens // 4)

    serve(loaded, [prompt(30, seed=5)], check=check)
    assert max(seen) > 10  # most of a 62-token sequence's sliding blocks were released


def test_the_gguf_conversion_gives_the_same_logits(tmp_path):
    """llama.cpp's Gemma 3 GGUF: norm weights + 1 (read as x̂ · w), ffn_norm as the MLP's input norm,
    the 5:1 pattern and local base 10,000 hard-coded; its q·k scale is 1/√head_dim."""
    import transformers

    directory = build_tiny("gemma3", tmp_path, query_pre_attn_scalar=32)  # 5:1 layers, window 20
    add_tiny_tokenizer(directory)
    path = build_tiny_gguf(directory, tmp_path / "gemma3.gguf")
    config = load_config(path)
    assert config.architecture == "gemma3" and config.norm_offset == 0.0 and config.final_logit_softcap == 30.0
    assert [layer.mixer.window for layer in config.layers] == [20] * 5 + [None]
    ours = load_model(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.tensor([prompt(45, seed=6)])
    with torch.inference_mode():
        expected = ref(ids).logits[:, -1]
        got = ModelDriver(ours.model).run(ids, ContiguousKVCache.for_model(ours.config, 64))
    assert (got - expected).abs().max().item() < 1e-4


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    """A tiny Gemma 3 with a tokenizer and no chat template: a base model, as gemma3-270m is."""
    import json

    directory = add_tiny_tokenizer(build_tiny("gemma3", tmp_path_factory.mktemp("gemma3-base")))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_a_base_model_refuses_chat_in_one_line_and_completes_raw_prompts(base_model, capsys):
    from kvlab.cli import main

    assert main(["run", str(base_model), "Hello", "--chat", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "no chat template" in err and len(err.strip().splitlines()) == 1
    assert main(["run", str(base_model), "Hello", "--max-tokens", "2", "--temperature", "0"]) == 0


def test_the_server_answers_completions_and_refuses_chat_with_an_openai_400(base_model):
    from loopback import serving

    from kvlab import LLM

    with serving(LLM(base_model, max_model_len=128)) as server:
        assert server.complete("Hello")["choices"][0]["text"] is not None
        r = server.post("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 400
        error = r.json()["error"]
        assert "no chat template" in error["message"] and error["type"] == "invalid_request_error"
        server.assert_still_serving()


def test_a_mistral_whose_every_layer_slides_matches_transformers(tmp_path):
    """One KV group, all of it sliding: its blocks are released too, and the tokens are transformers'."""
    import transformers

    config = transformers.MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=10,
                                        max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    loaded = load_model(tmp_path)
    ids = prompt(25, seed=7)
    assert serve(loaded, [ids], max_num_batched_tokens=8) == [hf_greedy(ref, ids)]


def test_gemmas_sentencepiece_is_rebuilt_from_gguf_metadata():
    """Merges recovered in the pieces' order (not their scores), spaces as ▁, runs of spaces respelled,
    unknown characters as byte pieces, control tokens whole."""
    from kvlab.tokenizer.gguf_spm import build_gemma_bpe, recover_merges

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<0x41>", "\u2581", "a", "b", "ab", "\u2581ab",
              "  ", "\u2581a"]  # fmt: skip
    meta = {"general.architecture": "gemma3", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.scores": [0.0] * len(tokens), "tokenizer.ggml.token_type": [3] * 5 + [6] + [1] * 7}  # fmt: skip
    vocab = {t: i for i, t in enumerate(["\u2581\u2581" if t == "  " else t for t in tokens])}
    assert recover_merges(vocab) == [("a", "b"), ("\u2581a", "b"), ("\u2581", "ab"), ("\u2581", "\u2581"), ("\u2581", "a")]
    tok = build_gemma_bpe(meta, "test.gguf")
    # ab ▁ ▁ ab: (▁, ab) ranks before (▁, ▁); "A" is no piece: its byte
    assert tok.encode("ab  ab<start_of_turn>A", add_special_tokens=False).ids == [9, 6, 10, 4, 5]
    assert tok.decode([9, 11, 9, 5]) == "ab  abA"  # the respelled run of spaces decodes to spaces
