"""`kvlab quality` and its guard: KL divergence against float32 KV (exactly 0 for a setting against
itself), the Hadamard rotation, the results kept per model, and the line `kvlab run` prints."""

from __future__ import annotations

import json

import pytest
import torch

from kvlab.cli import main
from kvlab.kernels import ThreadPolicy
from kvlab.kv.formats import KVFormats, Rotated, hadamard, kv_format
from kvlab.model.loader import load_model
from kvlab.quality import store
from kvlab.quality.measure import Candidate, measure, passes, verdict, windows_of
from tiny import build_tiny

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int\n    y: int\n" * 12


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return load_model(build_tiny("qwen3", tmp_path_factory.mktemp("qwen3")))  # head_dim 32: one q-block


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_HOME", str(tmp_path))
    return tmp_path


def _ids(n=300, seed=0):
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_setting_against_itself_is_exactly_zero(qwen3):
    policy = ThreadPolicy(threads=1)
    q8 = KVFormats.resolve("q8_0")
    same = measure(Candidate("q8_0", qwen3, q8, policy), [Candidate("q8_0 again", qwen3, q8, policy)],
                   _ids(), window=128, chunk=48, bos=1)[0]  # fmt: skip
    assert same.mean_kld == 0 and same.max_kld == 0 and same.same_top_p == 1.0 and same.ppl == same.ppl_ref
    assert same.tokens == 300  # every text token is predicted: each window starts with BOS
    assert same.verdict == "ok"


def test_a_coarser_cache_costs_more_and_rotation_changes_what_is_stored(qwen3):
    policy = ThreadPolicy(threads=1)
    ref = Candidate("float32", qwen3, KVFormats.plain(torch.float32), policy)
    cands = [Candidate(n, qwen3, KVFormats.resolve(n, rotation="off"), policy) for n in ("bfloat16", "q8_0", "q4_0")]
    cands.append(Candidate("q4_0 rotated", qwen3, KVFormats.resolve("q4_0", rotation="on"), policy))
    bf16, q8, q4, q4r = measure(ref, cands, _ids(200, 1), window=200, chunk=64, bos=1)
    assert 0 < bf16.mean_kld < q8.mean_kld < q4.mean_kld  # fewer bits, further from the reference
    assert q4r.mean_kld != q4.mean_kld and q4r.mean_kld > 0
    assert all(0 <= r.same_top_p <= 1 and r.p99_kld <= r.max_kld for r in (bf16, q8, q4, q4r))


def test_windows_start_with_bos_and_cover_the_text():
    ids = list(range(10, 30))
    ws = windows_of(ids, 8, bos=1)
    assert all(w[0] == 1 and len(w) <= 8 for w in ws)
    assert [t for w in ws for t in w[1:]] == ids


def test_verdicts_follow_the_stated_thresholds():
    assert verdict(0.004, 0.98) == "ok"
    assert verdict(0.004, 0.96) == "caution"  # both conditions hold, or it is not ok
    assert verdict(0.02, 0.95) == "caution"
    assert verdict(0.05, 0.99) == "unsafe"
    assert verdict(0.001, 0.85) == "unsafe"


def test_hadamard_is_orthonormal_and_its_own_inverse():
    for d in (32, 64, 96, 128, 256):
        h = hadamard(torch.eye(d))
        assert torch.allclose(h @ h.T, torch.eye(d), atol=1e-6) and torch.equal(h, h.T)
    x = torch.randn(7, 3, 128, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(hadamard(hadamard(x)), x, atol=1e-6)
    assert torch.equal(hadamard(x)[4, 1], hadamard(x[4, 1][None])[0])  # the same bits in any batch


def test_rotation_spreads_an_outlier_so_q8_0_keeps_the_small_values():
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * 0.05
    x[:, 5] = 40.0  # one huge channel, as Qwen2.5's keys have
    plain, rot = kv_format("q8_0", torch.float32), Rotated("q8_0", kv_format("q8_0", torch.float32))
    err_plain = (plain.decode(plain.encode(x), torch.float32) - x).pow(2).mean()
    err_rot = (rot.decode(rot.encode(x), torch.float32) - x).pow(2).mean()
    assert err_rot < err_plain / 2
    assert rot.bytes_per_vector(128) == plain.bytes_per_vector(128)  # the same bytes


def test_rotation_is_on_for_block_formats_unless_turned_off():
    assert KVFormats.resolve("q8_0").rotate_k and KVFormats.resolve("q4_0").rotate_v
    mixed = KVFormats.resolve(cache_type_k="q8_0", cache_type_v="fp8_e4m3")
    assert mixed.rotate_k and not mixed.rotate_v and mixed.description == "K q8_0, V fp8_e4m3, K rotated"
    assert not KVFormats.resolve("fp8_e4m3").rotate and KVFormats.resolve("fp8_e4m3", rotation="on").rotate_k
    assert not KVFormats.resolve("q8_0", rotation="off").rotate
    assert not KVFormats.resolve("bfloat16").rotate and KVFormats.resolve("bfloat16", rotation="on").rotate_v
    assert KVFormats.resolve("q8_0").description == "q8_0, rotated"
    with pytest.raises(Exception, match="auto, on, off"):
        KVFormats.resolve("q8_0", rotation="sideways")


def test_a_window_goes_as_a_prompt_then_decode_sized_passes_when_asked(qwen3, monkeypatch):
    assert passes(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert passes(10, 4, then=2) == [(0, 4), (4, 6), (6, 8), (8, 10)]
    assert passes(3, 4, then=2) == [(0, 3)]
    policy = ThreadPolicy(threads=1)
    ref = Candidate("float32", qwen3, KVFormats.plain(torch.float32), policy)
    q8 = Candidate("q8_0", qwen3, KVFormats.resolve("q8_0"), policy)
    sizes, logits = [], Candidate.logits

    def seen(self, ids, cache):
        sizes.append(len(ids))
        return logits(self, ids, cache)

    monkeypatch.setattr(Candidate, "logits", seen)
    got = measure(ref, [q8], _ids(200, 2), window=120, chunk=64, bos=1, then=8)[0]
    assert got.tokens == 200 and got.mean_kld > 0
    # the two windows (BOS and 119 tokens, BOS and 81): a prompt of 64, then passes of 8, for both models
    assert sizes == [n for n in [64] + [8] * 7 for _ in range(2)] + [n for n in [64, 8, 8, 2] for _ in range(2)]


def test_kvlab_quality_of_a_setting_against_itself_via_the_cli(capsys, tiny_chat_model, tmp_path, home):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    code = main(["quality", str(tiny_chat_model), "--kv-cache-dtype", "float32", "--text", str(text),
                 "--tokens", "400", "--window", "128", "--chunk", "50", "--threads", "1", "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["mean_kld"] == 0 and out["p99_kld"] == 0 and out["same_top_p"] == 1.0
    assert out["ppl"] == out["ppl_ref"] and out["verdict"] == "ok" and out["tokens"] > 100
    assert {"mean_kld", "p99_kld", "same_top_p", "ppl_ref", "ppl", "tokens", "verdict"} <= set(out)
    kept = list((home / "quality").glob("*.json"))
    assert len(kept) == 1 and "K float V float" in kept[0].read_text()


def test_kvlab_quality_reads_a_table_and_refuses_bad_input(capsys, tiny_chat_model, tmp_path, home):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    code = main(["quality", str(tiny_chat_model), "--kv-cache-dtype", "bfloat16", "--text", str(text),
                 "--tokens", "200", "--window", "100", "--threads", "1", "--no-save"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "mean KLD" in out and "same top" in out and "verdict" in out
    assert not (home / "quality").exists()  # --no-save
    assert main(["quality", str(tiny_chat_model), "--tokens", "1"]) == 2
    assert "--tokens must be at least 2" in capsys.readouterr().err
    assert main(["quality", str(tiny_chat_model), "--decode-chunk", "0"]) == 2
    assert "--decode-chunk must be at least 1" in capsys.readouterr().err
    assert main(["quality", str(tiny_chat_model), "--text", str(tmp_path / "absent.txt")]) == 2
    err = capsys.readouterr().err
    assert "absent.txt" in err and "Traceback" not in err


def _keep(path, formats, verdict_, mean=0.2, same=0.6):
    store.save(path, store.setting_key(formats, "as stored"), "t0",
               {"mean_kld": mean, "same_top_p": same, "verdict": verdict_})  # fmt: skip


def test_advice_warns_about_unsafe_and_says_how_to_measure_the_unmeasured(home, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    q4 = KVFormats.resolve("q4_0")
    assert store.advice("m", model, KVFormats.plain(torch.float32)) is None  # nothing lossy
    note = store.advice("m", model, q4)
    assert "not been measured" in note and "kvlab quality m --kv-cache-dtype q4_0" in note
    note = store.advice("m", model, KVFormats.resolve("q8_0", cache_type_v="q4_0", rotation="off"))
    assert "--cache-type-k q8_0 --cache-type-v q4_0 --kv-rotation off" in note
    assert "--kv-rotation" not in store.advice("m", model, KVFormats.resolve("fp8_e4m3"))  # the default
    _keep(model, q4, "unsafe")
    assert store.advice("m", model, q4).startswith("warning: q4_0, rotated measured unsafe")
    assert "not been measured" in store.advice("m", model, KVFormats.resolve("q4_0", rotation="off"))
    _keep(model, q4, "ok", 0.001, 0.99)
    assert store.advice("m", model, q4) is None  # the newest measurement counts


def test_kvlab_run_prints_the_kept_verdict(capsys, tiny_chat_model, home):
    code = main(["run", str(tiny_chat_model), "Hi", "--max-tokens", "2", "--kv-cache-dtype", "float16"])
    assert code == 0 and "quality" not in capsys.readouterr().err  # a float cache: nothing to say
    # tiny head_dim 16 cannot hold q8_0 blocks: the quantization at load stands in for a lossy setting
    code = main(["run", str(tiny_chat_model), "Hi", "--max-tokens", "2", "--quantization", "q8_0"])
    err = capsys.readouterr().err
    assert "has not been measured" in err and "--quantization q8_0" in err


def test_the_python_api_takes_the_kv_settings(tiny_chat_model):
    from kvlab import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    plain = LLM(tiny_chat_model).generate(["The cat"], greedy)[0].outputs[0].token_ids
    llm = LLM(tiny_chat_model, kv_cache_dtype="fp8_e4m3", kv_rotation="on")
    assert llm.engine.pool_plan.formats.description == "fp8_e4m3, rotated"
    assert len(llm.generate(["The cat"], greedy)[0].outputs[0].token_ids) == len(plain) == 6
    half = LLM(tiny_chat_model, cache_type_k="float32", cache_type_v="bfloat16")
    assert half.engine.pool_plan.formats.name == "K float32, V bfloat16"


def test_fp8_where_torch_lacks_it_is_one_clear_error(monkeypatch):
    from kvlab.errors import KvlabError

    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(KvlabError, match="lacks"):
        kv_format("fp8_e4m3", torch.float32)
