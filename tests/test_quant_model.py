"""Models whose matrices stay in block formats: the GGUF's own blocks, and float models quantized at load.

The packed layers' answers are checked against the same model with its blocks expanded to floats (the
dequantized path computes with exactly those values; only the order of the sums differs).
"""

from __future__ import annotations

import pytest
import torch

from kvlab.config import load_config
from kvlab.kv.cache import ContiguousKVCache
from kvlab.memory import weight_bytes
from kvlab.model import loader
from kvlab.model.loader import load_model
from kvlab.quant.linear import PackedEmbedding, PackedLinear
from kvlab.runner.driver import ModelDriver
from tiny import add_tiny_tokenizer, build_tiny, build_tiny_gguf

MIXED = {"attn_q.weight": "Q4_0", "attn_k.weight": "Q5_0", "attn_v.weight": "Q8_0", "ffn_down.weight": "Q4_1",
         "token_embd.weight": "Q8_0", "output.weight": "F16"}  # fmt: skip


def mixed(name: str) -> str:
    """A Q4_K_M-like mix: each kind of matrix its own format; the rest Q5_0."""
    return next((fmt for suffix, fmt in MIXED.items() if name.endswith(suffix)), "Q5_0")


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-tied"])
def files(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    build_tiny(request.param, directory)
    add_tiny_tokenizer(directory)
    return request.param, directory, build_tiny_gguf(directory, directory / "mixed.gguf", quant=mixed)


@pytest.fixture
def native(monkeypatch):
    """Keep blocks stored even where the C kernels are not built (the reference dequantization then serves)."""
    monkeypatch.setattr(loader, "native_blocks_supported", lambda device: True)


def logits(loaded, ids: torch.Tensor, index=None) -> torch.Tensor:
    return ModelDriver(loaded.model).run(ids, ContiguousKVCache.for_model(loaded.config, ids.shape[1]), logits_index=index)


def test_a_gguf_keeps_its_blocks_and_computes_what_their_floats_compute(files, native):
    kind, _, path = files
    packed, expanded = load_model(path), load_model(path, dequantize=True)
    qkv = packed.model.layers[0].attn.qkv_proj
    assert isinstance(qkv, PackedLinear) and qkv.formats == ["Q4_0", "Q5_0", "Q8_0"]
    assert isinstance(packed.model.embed_tokens, PackedEmbedding)
    assert packed.weight_format.endswith("(as stored)") and expanded.weight_format == "float32"
    ids = torch.randint(5, 300, (1, 21), generator=torch.Generator().manual_seed(3))
    a, b = logits(packed, ids, torch.arange(21)), logits(expanded, ids, torch.arange(21))
    assert (a - b).abs().max() <= 1e-5 * b.abs().max(), kind


def test_the_bytes_held_are_the_files_and_the_calculators(files, native):
    _, _, path = files
    packed = load_model(path)
    calculated = weight_bytes(load_config(path))
    assert calculated.exact and packed.weight_bytes == calculated.bytes  # blocks, scales and F32 vectors, as stored
    assert packed.weight_bytes < load_model(path, dequantize=True).weight_bytes / 3


def test_a_float_model_quantized_at_load_stays_close_to_it(files):
    kind, directory, _ = files
    full, q8 = load_model(directory), load_model(directory, quantization="q8_0")
    assert q8.weight_format == "q8_0 (quantized at load)"
    assert all(f == "Q8_0" for m in q8.model.modules() if isinstance(m, PackedLinear) for f in m.formats)
    if kind == "llama-tied":  # one table serves the lookup and the LM head
        assert q8.model.lm_head.packed_0 is q8.model.embed_tokens.packed_0
    ids = torch.randint(5, 300, (1, 17), generator=torch.Generator().manual_seed(4))
    a, b = logits(full, ids), logits(q8, ids)
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    q4 = load_model(directory, quantization="q4_0")
    assert q8.weight_bytes < full.weight_bytes / 3 and q4.weight_bytes < q8.weight_bytes


def test_an_unknown_quantization_is_one_clear_error(files):
    from kvlab.errors import KvlabError

    _, directory, _ = files
    with pytest.raises(KvlabError, match="q8_0, q4_0"):
        load_model(directory, quantization="q3_x")


def test_a_block_type_kvlab_cannot_compute_with_is_named_with_its_tensor(tmp_path, native):
    """IQ4_NL (a non-linear 4-bit table) is not among kvlab's formats: the error names type and tensor,
    and points at --dequantize, which the gguf package can serve for it."""
    import gguf
    import numpy as np

    from kvlab.errors import KvlabError

    directory = tmp_path / "m"
    build_tiny("llama", directory)
    add_tiny_tokenizer(directory)
    path = build_tiny_gguf(directory, tmp_path / "f.gguf")
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    for field in reader.fields.values():  # the same metadata
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        data = np.array(t.data)
        if t.name == "blk.1.ffn_up.weight":  # [160, 64]: two blocks of 32 per row, 18 bytes each
            writer.add_tensor(t.name, np.zeros((160, 36), np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(KvlabError, match=r"blk\.1\.ffn_up\.weight is stored as IQ4_NL.*--dequantize"):
        load_model(tmp_path / "iq.gguf")
    assert load_model(tmp_path / "iq.gguf", dequantize=True).weight_format == "float32"


def test_the_servers_memory_plan_plans_the_bytes_the_packed_model_holds(files, native, capsys):
    from kvlab.cli import build_parser
    from kvlab.engine_cli import check_model_args, engine_options, open_llm
    from kvlab.server.cli import print_plan

    _, _, path = files
    for extra in ([], ["--dequantize"], ["--quantization", "q8_0"]):
        args = build_parser().parse_args(["serve", str(path), "--kv-memory", "1MiB", "--max-model-len", "256", *extra])
        check_model_args(args)  # as `kvlab serve` does first: --dtype auto becomes the dtype it means
        options = engine_options(args)
        _, planned = print_plan(args, options)
        llm = open_llm(args, **options)
        if extra == ["--quantization", "q8_0"]:  # the calculator's estimate: vectors counted at 16 bits, ours are 32
            assert abs(planned - llm.loaded.weight_bytes) < 0.05 * planned
        else:
            assert planned == llm.loaded.weight_bytes, extra
    capsys.readouterr()


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"])
def test_an_embedding_lookup_gives_the_references_rows_on_every_device_path(fmt):
    """PackedEmbedding dequantizes the rows it reads with its device's ops (on a CPU the C kernels): the
    reference's bits, for one row, a decode step's few, and a prompt's many, repeated ids included."""
    from kvlab.backends.ops import ops_for
    from kvlab.kernels import ThreadPolicy
    from kvlab.quant.formats import FORMATS
    from kvlab.quant.linear import PackedTensor

    from quant_blocks import random_blocks

    g = torch.Generator().manual_seed(7)
    rows, width = 300, 512
    table = torch.from_numpy(random_blocks(fmt, rows, width, seed=7))
    emb = PackedEmbedding(PackedTensor(fmt, (rows, width), table))
    for ids in (torch.tensor([[17]]), torch.tensor([[3], [250], [3]]), torch.randint(0, rows, (2, 40), generator=g)):
        want = FORMATS[fmt].dequantize(table.index_select(0, ids.reshape(-1)), width).view(*ids.shape, width)
        assert torch.equal(emb(ids), want)  # outside any driver: the reference's own ops
        with ops_for("cpu").applied(ThreadPolicy(threads=2), ids.numel()):
            assert torch.equal(emb(ids), want)
