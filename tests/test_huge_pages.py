"""The weights a decode step streams, copied at load into huge pages (kvlab/model/huge_pages.py): the same
bytes and the same tokens, a tied table still one storage, what a token reads a part of left where it
loaded, nothing moved twice or where it is switched off, and the kernel asked for 2 MB pages."""

from __future__ import annotations

import pytest
import torch

from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine
from kvlab.model import huge_pages
from kvlab.model.huge_pages import in_huge_pages, into_huge_pages, streamed_tensors, thp_mode
from kvlab.model.loader import load_model
from kvlab.quant.linear import PackedEmbedding, PackedLinear
from kvlab.sampling import SamplingParams
from tiny import add_tiny_tokenizer, build_tiny, build_tiny_gguf


@pytest.fixture(scope="module")
def tied_gguf(tmp_path_factory):
    directory = build_tiny("llama-tied", tmp_path_factory.mktemp("tied") / "hf")
    add_tiny_tokenizer(directory)
    return build_tiny_gguf(directory, directory.parent / "m.gguf", "Q8_0")


@pytest.fixture(scope="module")
def untied_gguf(tmp_path_factory):
    directory = build_tiny("qwen2", tmp_path_factory.mktemp("untied") / "hf")
    add_tiny_tokenizer(directory)
    return build_tiny_gguf(directory, directory.parent / "m.gguf", lambda name: "Q5_0" if "ffn" in name else "Q8_0")


@pytest.fixture
def wanted(monkeypatch):
    """Whatever this kernel's mode: the move itself is the same code (madvise refused: 4 KB pages)."""
    monkeypatch.setattr(huge_pages, "huge_pages_wanted", lambda: True)


def greedy(loaded, n: int = 12) -> list[int]:
    engine = LLMEngine(loaded, None, EngineConfig(max_model_len=128, max_num_seqs=4))
    engine.add_request([5, 9, 33, 70, 2, 101], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    out = []
    while engine.has_unfinished_requests:
        out += [t for r in engine.step() for t in r.new_token_ids]
    return out


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in list(model.named_buffers()) + list(model.named_parameters())}


@pytest.mark.parametrize("which", ["tied_gguf", "untied_gguf"])
def test_the_same_bytes_and_tokens_from_huge_pages(which, request, wanted):
    path = request.getfixturevalue(which)
    before = load_model(path, huge_pages=False)
    tokens, values = greedy(before), snapshot(before.model)
    loaded = load_model(path, huge_pages=False)
    moved = into_huge_pages(loaded.model, least=0)
    streamed = streamed_tensors(loaded.model)
    assert moved >= sum(t.numel() * t.element_size() for t in streamed) and moved % 64 == 0
    assert all(in_huge_pages(t) for t in streamed)
    after = snapshot(loaded.model)
    assert after.keys() == values.keys() and all(torch.equal(after[k], values[k]) for k in values)
    assert loaded.weight_bytes == before.weight_bytes  # each tensor still once
    assert greedy(loaded) == tokens
    assert into_huge_pages(loaded.model, least=0) == 0  # already there: nothing copied twice


def test_a_tied_table_stays_one_storage_and_an_untied_one_stays_where_it_loaded(tied_gguf, untied_gguf, wanted):
    tied = load_model(tied_gguf, huge_pages=False)
    into_huge_pages(tied.model, least=0)
    table = next(m for m in tied.model.modules() if isinstance(m, PackedEmbedding)).packed_0
    head = tied.model.lm_head.packed()[0].data
    assert in_huge_pages(table) and table.data_ptr() == head.data_ptr()  # the head reads the table whole

    untied = load_model(untied_gguf, huge_pages=False)
    into_huge_pages(untied.model, least=0)
    table = next(m for m in untied.model.modules() if isinstance(m, PackedEmbedding)).packed_0
    assert not in_huge_pages(table)  # a token reads one row: the table stays in the file's map
    assert in_huge_pages(untied.model.lm_head.packed()[0].data)


def test_nothing_moves_when_switched_off_or_too_small(untied_gguf, monkeypatch):
    monkeypatch.setenv("KVLAB_HUGE_PAGES", "0")
    loaded = load_model(untied_gguf)
    assert into_huge_pages(loaded.model, least=0) == 0
    assert not any(in_huge_pages(t) for t in streamed_tensors(loaded.model))
    monkeypatch.setattr(huge_pages, "huge_pages_wanted", lambda: True)
    assert into_huge_pages(loaded.model) == 0  # a tiny model: less than one huge page of weights
    assert into_huge_pages(loaded.model, least=0) > 0


def test_the_kernels_mode_is_read_from_its_file(tmp_path):
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    assert thp_mode(tmp_path / "enabled") == "madvise"
    (tmp_path / "enabled").write_text("[never]\n")
    assert thp_mode(tmp_path / "enabled") == "never"
    assert thp_mode(tmp_path / "missing") is None


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="this kernel gives no transparent huge pages")
def test_the_region_is_backed_by_huge_pages():
    """A region of 8 MB, filled: the kernel's count of this process's anonymous huge pages grows."""

    def anon_huge_kb() -> int:
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))

    before = anon_huge_kb()
    region = huge_pages._region(8 << 20)
    region.fill_(1)
    assert region.data_ptr() % (2 << 20) == 0 and int(region[::4096].sum()) == 2048
    grown = anon_huge_kb() - before
    assert 2048 <= grown <= 8192 + 4096  # at least one 2 MB page (compaction may leave some 4 KB ones)


def test_int8_moves_the_repacked_matrices_and_load_leaves_them_to_it(untied_gguf, monkeypatch):
    """with_activation_setting moves what it repacked; load_model(huge_pages=False) first, as LLM does
    for that setting, so that the blocks it replaces are not copied for nothing."""
    from kvlab.kernels import quant
    from kvlab.quant.activations import with_int8_activations

    if not quant.available():
        pytest.skip("no C compiler: no interleaved kernels")
    tokens = greedy(with_int8_activations(load_model(untied_gguf, huge_pages=False)))  # nothing moved: too small
    monkeypatch.setattr(huge_pages, "huge_pages_wanted", lambda: True)
    monkeypatch.setattr(huge_pages, "HUGE_PAGE", 4096)  # a tiny model's weights are worth a region here
    loaded = load_model(untied_gguf, huge_pages=False)
    assert not any(in_huge_pages(t) for t in streamed_tensors(loaded.model))
    int8 = with_int8_activations(loaded)
    repacked = [p.data for m in int8.model.modules() if isinstance(m, PackedLinear) for p in m.packed()]
    assert repacked and all(in_huge_pages(t) for t in repacked)  # made there by the repacking (HugeArena)
    assert greedy(int8) == tokens


def test_the_arena_makes_tensors_side_by_side_in_its_regions(monkeypatch):
    monkeypatch.setattr(huge_pages, "huge_pages_wanted", lambda: True)
    arena = huge_pages.HugeArena(chunk=4 << 20)
    made = [arena.empty((1000, 37)), arena.empty((3, 5), dtype=torch.float32), arena.empty((4 << 20,))]
    assert all(in_huge_pages(t) and t.data_ptr() % 64 == 0 and t.is_contiguous() for t in made)
    assert made[1].dtype == torch.float32 and made[1].shape == (3, 5)
    assert made[1].data_ptr() == made[0].data_ptr() + 37056  # 37,000 bytes, to the next cache line
    assert made[2].untyped_storage().data_ptr() != made[0].untyped_storage().data_ptr()  # past the chunk: a new one
    for i, t in enumerate(made):
        t.fill_(i + 1)
    assert [int(t.view(-1)[0]) for t in made] == [1, 2, 3] and int(made[0].sum()) == 37000  # no overlap
    monkeypatch.setattr(huge_pages, "huge_pages_wanted", lambda: False)
    assert not in_huge_pages(huge_pages.HugeArena().empty((64, 64)))


def test_without_memory_for_a_region_the_weights_stay_and_the_arena_falls_back(untied_gguf, wanted, monkeypatch):
    def refused(size):
        raise OSError("Cannot allocate memory")

    monkeypatch.setattr(huge_pages, "_region", refused)
    loaded = load_model(untied_gguf, huge_pages=False)
    assert into_huge_pages(loaded.model, least=0) == 0 and greedy(loaded)
    arena = huge_pages.HugeArena()
    t = arena.empty((4, 4))
    assert t.shape == (4, 4) and not in_huge_pages(t) and not arena.on
