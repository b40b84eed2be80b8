"""GGUF files: our reader, the name mapping and llama.cpp's q/k reordering, on tiny converted models."""

from __future__ import annotations

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.errors import KvlabError
from kvlab.gguf_file import GGUFFile
from kvlab.kv.cache import ContiguousKVCache
from kvlab.model.loader import load_model
from kvlab.runner.driver import ModelDriver
from tiny import add_tiny_tokenizer, build_tiny, build_tiny_gguf


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "llama-tied"])
def converted(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    build_tiny(request.param, directory)
    add_tiny_tokenizer(directory)
    return request.param, directory, build_tiny_gguf(directory, directory / "model.gguf")


def logits(loaded, ids):
    return ModelDriver(loaded.model).run(ids, ContiguousKVCache.for_model(loaded.config, ids.shape[1]))


def test_reader_agrees_with_gguf_package(converted):
    import gguf

    _, _, path = converted
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    assert set(ours.tensors) == {t.name for t in theirs.tensors}
    for t in theirs.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(reversed([int(d) for d in t.shape]))
        assert info.nbytes == int(t.n_bytes) and info.ggml_type == int(t.tensor_type)
        assert (ours.raw(t.name).reshape(-1) == t.data.reshape(-1).view("uint8")).all()
    assert ours.metadata["general.architecture"] == theirs.fields["general.architecture"].contents()
    assert ours.metadata["tokenizer.ggml.tokens"] == theirs.fields["tokenizer.ggml.tokens"].contents()


def test_gguf_model_equals_the_safetensors_model(converted):
    kind, directory, path = converted
    a, b = load_model(directory), load_model(path)
    assert a.config.num_layers == b.config.num_layers and a.config.tie_word_embeddings == b.config.tie_word_embeddings
    assert a.config.qkv_bias == b.config.qkv_bias and a.config.qk_norm == b.config.qk_norm
    ids = torch.randint(5, 300, (1, 25), generator=torch.Generator().manual_seed(0))
    assert torch.equal(logits(a, ids), logits(b, ids)), kind


def test_quantized_gguf_is_close(converted, tmp_path):
    _, directory, _ = converted
    q8 = build_tiny_gguf(directory, tmp_path / "q8.gguf", quant="Q8_0")
    assert GGUFFile(q8).tensors["blk.0.attn_q.weight"].type_name == "Q8_0"
    ids = torch.randint(5, 300, (1, 25), generator=torch.Generator().manual_seed(1))
    full, quant = logits(load_model(directory), ids), logits(load_model(q8), ids)
    assert (full - quant).abs().max() < 0.05 * full.abs().max()


def test_llm_on_gguf_matches_llm_on_directory(converted):
    _, directory, path = converted
    p = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    a, b = LLM(directory), LLM(path)
    assert a.encode("The capital of France") == b.encode("The capital of France")
    assert a.generate("The capital of France", p).text == b.generate("The capital of France", p).text
    msgs = [{"role": "user", "content": "hi"}]
    assert a.chat(msgs, p).token_ids == b.chat(msgs, p).token_ids


def test_truncated_and_corrupt_files_are_user_errors(converted, tmp_path):
    _, _, path = converted
    data = path.read_bytes()
    for cut in (10, 200, len(data) // 2, len(data) - 1):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(KvlabError):
            load_model(bad)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 300)
    with pytest.raises(KvlabError, match="not a valid GGUF"):
        GGUFFile(junk)
