"""`--activation-quant int8` through the engine: every packed matrix interleaved, the C decode step
taking it, a request's tokens the same alone or among 16, the modules and the C step agreeing, and the
setting named (weight format, quality advice) and refused where it cannot apply."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch

from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine
from kvlab.errors import KvlabError
from kvlab.kernels import ThreadPolicy, quant
from kvlab.kv.cache import ContiguousKVCache
from kvlab.kv.formats import KVFormats
from kvlab.model.loader import load_model
from kvlab.quality.store import advice
from kvlab.quant.activations import activation_setting_of, with_int8_activations
from kvlab.quant.linear import PackedLinear
from kvlab.runner.driver import ModelDriver
from interleaved import assert_together_as_alone, mixed_gguf, prompts, run_all
from tiny import add_tiny_tokenizer, build_tiny, build_tiny_gguf

pytestmark = pytest.mark.skipif(not quant.available(), reason="no C compiler: no interleaved kernels")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def gguf_file(request, tmp_path_factory):
    return mixed_gguf(request.param, tmp_path_factory.mktemp(request.param))


def test_every_packed_matrix_is_interleaved_and_the_c_step_takes_them(gguf_file):
    exact = load_model(gguf_file)
    assert activation_setting_of(exact.model) is None
    loaded = with_int8_activations(exact)
    assert activation_setting_of(loaded.model) == "int8"
    layers = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    assert layers and all(f.endswith("x16") for m in layers for f in m.formats)
    assert "int8 activations" in loaded.weight_format
    engine = LLMEngine(loaded, None, EngineConfig(kv_memory_bytes=1 << 24))
    assert engine.decode_path.backend is not None, engine.decode_path.reason
    assert engine.scheduler.config.max_num_seqs == 128  # a step of any rows stays on the C step: the default seats


@pytest.mark.parametrize("n", [16, 48])
def test_requests_together_give_each_ones_tokens_alone_on_both_paths(gguf_file, n):
    """16 sequences, and 48: past the policy's max_kernel_rows (32), whose steps the C step still takes
    for a model all of GGUF blocks; the AMX tiles' 16 rows at a time, where the CPU has them. Each prompt
    is prefilled in a pass of its own (pack_prompts=False, as in test_real's): packed with others its
    logits differ from its lone prefill in the last bits, which rounding to 8 bits can make visible;
    what is compared is the batched decode step, whose rows are bit-independent."""
    loaded = with_int8_activations(load_model(gguf_file))
    assert_together_as_alone(loaded, n)


def test_int8_activations_stay_close_to_the_exact_products(gguf_file):
    """Not equal (the activations are rounded), but close: the logits of one pass agree to a few percent."""
    exact = load_model(gguf_file)
    rounded = with_int8_activations(load_model(gguf_file))
    ids = prompts(1)[0]
    a, b = (ModelDriver(m.model).append(ids, ContiguousKVCache.for_model(m.config, 64)) for m in (exact, rounded))
    assert not torch.equal(a, b)
    assert (a - b).abs().max() <= 0.05 * a.abs().max()


def test_a_model_without_blocks_is_refused_in_one_line(tmp_path):
    loaded = load_model(build_tiny("llama", tmp_path))
    with pytest.raises(KvlabError, match="GGUF block formats"):
        with_int8_activations(loaded)


def test_run_names_the_setting_and_quality_advice_asks_for_its_measurement(gguf_file, tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvlab", "run", str(gguf_file), "hello", "--max-tokens", "3",
                          "--json", "--activation-quant", "int8"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert "int8 activations" in result["weight_format"] and result["decode_path"] == "cpu-c"
    assert "--activation-quant int8" in out.stderr  # not measured yet: how to measure it
    bad = subprocess.run([sys.executable, "-m", "kvlab", "run", str(gguf_file), "hi", "--activation-quant", "int4"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    note = advice("m", tmp_path / "m.gguf", KVFormats.plain(torch.float32), activation_quant="int8")
    assert note and "kvlab quality m --activation-quant int8" in note.replace("  ", " ")


def test_the_lab_measures_the_setting_it_is_given(gguf_file, tmp_path, capsys):
    """`kvlab lab batching --activation-quant int8`: the engine's decode steps on the interleaved products
    (`kvlab serve --activation-quant int8`'s path), the setting in results.json and in the command that
    repeats the run; a model with no blocks is refused in one line."""
    from kvlab.cli import main

    quick = ["--quick", "--repeat", "1", "--no-progress", "--threads", "1"]
    out = tmp_path / "lab"
    assert main(["lab", "batching", "--model", str(gguf_file), "--out", str(out), "--activation-quant", "int8", *quick]) == 0
    results = json.loads((out / "results.json").read_text())
    assert "int8 activations" in results["model"]["weight_format"]
    assert results["settings"]["activation_quant"] == "int8" and "--activation-quant int8" in results["command"]
    steps = results["experiments"]["batching"]["decode_steps"]
    assert steps and all(p["pure_decode"] and p["backend_steps"] == p["timed_steps"] for p in steps), steps
    # the exact run into the same folder measures anew rather than keeping the int8 run's figures
    assert main(["lab", "phases", "--model", str(gguf_file), "--out", str(out), *quick]) == 0
    again = json.loads((out / "results.json").read_text())
    assert set(again["experiments"]) == {"phases"} and "int8" not in again["model"]["weight_format"]
    plain = build_tiny("llama", tmp_path / "plain")
    capsys.readouterr()
    bad = subprocess.run([sys.executable, "-m", "kvlab", "lab", "batching", "--model", str(plain), "--out",
                          str(tmp_path / "bad"), "--activation-quant", "int8", *quick],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "GGUF block formats" in bad.stderr, bad.stderr


@pytest.mark.parametrize("experts_type", ["Q8_0", "Q4_0"])
def test_experts_are_interleaved_too_and_sixteen_together_give_each_ones_tokens(tmp_path, experts_type):
    """A mixture of experts: every expert's blocks interleaved (stacked [E, items, item bytes]), the C step's
    expert products reading them, the same tokens alone and among 16 on both paths, close to exact."""
    from tiny_moe import build_tiny_moe, build_tiny_moe_gguf

    from kvlab.model.experts import Experts

    directory = add_tiny_tokenizer(build_tiny_moe("qwen3_moe", tmp_path / "moe"))
    path = build_tiny_moe_gguf(directory, tmp_path / "moe.gguf", experts_type=experts_type)
    loaded = with_int8_activations(load_model(path))
    banks = [m for m in loaded.model.modules() if isinstance(m, Experts)]
    assert banks and all(f == experts_type + "x16" for b in banks for fmts in b.formats.values() for f in fmts)
    assert activation_setting_of(loaded.model) == "int8"
    c_step = LLMEngine(loaded, None, EngineConfig(enable_prefix_caching=False))
    assert c_step.decode_path.backend is not None, c_step.decode_path.reason
    batch = prompts(16)
    alone = [run_all(c_step, [p])[0] for p in batch]
    assert run_all(c_step, batch) == alone
    modules = LLMEngine(loaded, None, EngineConfig(enable_prefix_caching=False), policy=ThreadPolicy(fused_decode=False))
    assert run_all(modules, batch) == alone
    exact = load_model(path)
    ids = prompts(1)[0]
    a, b = (ModelDriver(m.model).append(ids, ContiguousKVCache.for_model(m.config, 64)) for m in (exact, loaded))
    assert not torch.equal(a, b) and (a - b).abs().max() <= 0.05 * a.abs().max()


def _resident_kb(path) -> int:
    """This process's resident kB of its mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                inside = len(head) >= 6 and head[5] == str(path)
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_the_repacked_blocks_pages_leave_memory_and_nothing_else_changes(tmp_path, monkeypatch):
    """After repacking, the GGUF's pages that held the blocks are dropped from the process (madvise):
    read again, they come back from the file with the same bytes; memory not mapped from a file is
    never touched."""
    import numpy as np

    from kvlab.quant import activations

    path = tmp_path / "blocks.bin"
    values = np.arange(1 << 20, dtype=np.uint8) * 7
    values.tofile(path)
    with warnings.catch_warnings():  # read-only, as the loader's map of a GGUF
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        mapped = torch.from_numpy(np.asarray(np.memmap(path, dtype=np.uint8, mode="r")))
    assert int(mapped.sum()) == int(values.sum())  # every page read: resident
    before = _resident_kb(path)
    assert before >= 1000
    assert activations.release_file_pages([mapped[100:]]) >= (1 << 20) - 8192  # whole pages only
    assert _resident_kb(path) < before / 4
    assert torch.equal(mapped, torch.from_numpy(values))  # read again: the file's bytes
    anonymous = torch.from_numpy(values.copy())
    assert activations.release_file_pages([anonymous]) == 0 and torch.equal(anonymous, torch.from_numpy(values))

    released = []
    monkeypatch.setattr(activations, "release_file_pages",
                        lambda ts, files=None, real=activations.release_file_pages: released.append(real(ts, files)) or released[-1])  # fmt: skip
    directory = build_tiny("llama", tmp_path / "m", head_dim=32)
    add_tiny_tokenizer(directory)
    gguf = build_tiny_gguf(directory, tmp_path / "m.gguf", "Q8_0")
    with_int8_activations(load_model(gguf))
    assert released and sum(released) > 0


@pytest.mark.skipif(not quant.gated_prompt_rows(), reason="no AMX tiles for bfloat16, vpdpbusd or AVX2 here: no gated pass")
def test_a_prompts_gated_mlp_in_one_pass_gives_the_mlps_own_bits(gguf_file, monkeypatch):
    """A prompt of gated_prompt_rows() tokens or more: gate, up and the activation in one pass (the bfloat16
    tiles, vpdpbusd or AVX2; CpuOps.gated_product), the logits bit for bit those of the MLP's own
    product-then-activation."""
    from kvlab.backends.ops import CpuOps

    loaded = with_int8_activations(load_model(gguf_file))
    ids = torch.randint(3, 500, (quant.gated_prompt_rows() + 20,), generator=torch.Generator().manual_seed(4)).tolist()
    calls = []
    fused_product = CpuOps.gated_product
    monkeypatch.setattr(CpuOps, "gated_product", lambda self, *a: calls.append(1) or fused_product(self, *a))
    fused = ModelDriver(loaded.model).append(ids, ContiguousKVCache.for_model(loaded.config, 128))
    assert len(calls) == loaded.config.num_layers
    monkeypatch.setattr(CpuOps, "gated_product", lambda self, *a: None)
    apart = ModelDriver(loaded.model).append(ids, ContiguousKVCache.for_model(loaded.config, 128))
    assert torch.equal(fused, apart)


@pytest.mark.skipif(not quant.gated_prompt_rows(), reason="no AMX tiles for bfloat16, vpdpbusd or AVX2 here: no gated pass")
@pytest.mark.parametrize("setting", ["int8", "exact"])
def test_a_long_prompts_mlp_goes_in_slices_of_rows_with_the_bits_of_one_pass(gguf_file, monkeypatch, setting):
    """More rows than MLP_ROWS: a gated MLP of stored blocks takes them in slices of equal rows (gate·up,
    activation, down per slice, so that a slice's activations are still in cache for down), with int8
    activations every slice in the one-pass kernel; the logits bit for bit those of the whole pass at once
    (and, int8, of the MLP's own path)."""
    from kvlab.backends.ops import CpuOps
    from kvlab.model import layers

    loaded = load_model(gguf_file)
    if setting == "int8":
        loaded = with_int8_activations(loaded)
    least = quant.gated_prompt_rows()
    ids = torch.randint(3, 500, (4 * least + 30,), generator=torch.Generator().manual_seed(6)).tolist()
    calls = []
    fused_product = CpuOps.gated_product
    monkeypatch.setattr(CpuOps, "gated_product", lambda self, x, *a: calls.append(x.numel() // x.shape[-1]) or fused_product(self, x, *a))

    def logits():
        calls.clear()
        return ModelDriver(loaded.model).append(ids, ContiguousKVCache.for_model(loaded.config, 512))

    monkeypatch.setattr(layers, "MLP_ROWS", 2 * least)
    sliced = logits()
    assert len(calls) == 3 * loaded.config.num_layers  # 3 slices a layer, none under the pass's least rows
    assert min(calls) >= least and sum(calls[:3]) == len(ids)
    monkeypatch.setattr(layers, "MLP_ROWS", 1 << 20)
    whole = logits()
    assert calls == [len(ids)] * loaded.config.num_layers
    assert torch.equal(sliced, whole)
    if setting == "int8":
        monkeypatch.setattr(CpuOps, "gated_product", lambda self, *a: None)
        assert torch.equal(logits(), sliced)


def test_int8_prompt_passes_attend_on_bfloat16_tiles_where_their_products_go_in_bfloat16(gguf_file, monkeypatch):
    """The int8 setting marks every attention layer (prompt_bf16) where this machine's products go in
    bfloat16 from bf16_prompt_rows() rows; its prompt passes then ask for the tiles' attention, the exact
    setting never. A prompt of that many tokens: logits near the float32 attention's."""
    from kvlab.kernels import gemv
    from kvlab.model.transformer import Attention

    exact = load_model(gguf_file)
    assert not any(m.prompt_bf16 for m in exact.model.modules() if isinstance(m, Attention))
    loaded = with_int8_activations(load_model(gguf_file))
    layers = [m for m in loaded.model.modules() if isinstance(m, Attention)]
    assert layers and all(m.prompt_bf16 == (quant.bf16_prompt_rows() > 0) for m in layers)
    asked = []
    kernel = gemv.prompt_attention
    monkeypatch.setattr(gemv, "prompt_attention", lambda *a, bf16=False: asked.append(bf16) or kernel(*a, bf16=bf16))
    ids = torch.randint(3, 500, (80,), generator=torch.Generator().manual_seed(5)).tolist()
    tiles = ModelDriver(loaded.model).append(ids, ContiguousKVCache.for_model(loaded.config, 128))
    assert asked == [quant.bf16_prompt_rows() > 0] * len(layers)
    for m in layers:
        m.prompt_bf16 = False
    apart = ModelDriver(loaded.model).append(ids, ContiguousKVCache.for_model(loaded.config, 128))
    assert asked[len(layers):] == [False] * len(layers)
    assert (tiles - apart).abs().max() <= 0.05 * apart.abs().max()
