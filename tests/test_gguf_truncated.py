"""A GGUF file cut short anywhere (a download or copy that stopped) is one line that says "truncated",
never struct's or numpy's message."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvlab.errors import KvlabError
from kvlab.gguf_file import GGUFFile


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    """Every kind of header field the reader walks: scalars, a string, arrays of strings (some
    multi-byte UTF-8) and of numbers, and two tensors."""
    import gguf

    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_string("general.name", "small — ünïcode")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "héllo", "wörld", "日本", "▁the"])
    writer.add_array("tokenizer.ggml.scores", [0.0, -1.0, -2.0, -3.0, -4.0])
    writer.add_tensor("token_embd.weight", np.arange(5 * 4, dtype=np.float32).reshape(5, 4))
    writer.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _open_cut(whole: bytes, size: int, tmp_path: Path) -> str:
    cut = tmp_path / f"cut{size}.gguf"
    cut.write_bytes(whole[:size])
    with pytest.raises(KvlabError) as e:
        GGUFFile(cut)
    return str(e.value)


def test_the_whole_file_reads(small_gguf):
    f = GGUFFile(small_gguf)
    assert f.metadata["tokenizer.ggml.tokens"] == ["<s>", "héllo", "wörld", "日本", "▁the"]
    assert f.metadata["general.name"] == "small — ünïcode"
    assert f.dequantize("token_embd.weight").tolist() == np.arange(20, dtype=np.float32).reshape(5, 4).tolist()


def test_a_file_cut_anywhere_says_truncated(small_gguf, tmp_path):
    whole = small_gguf.read_bytes()
    tensors = GGUFFile(small_gguf).tensors.values()
    data_start, data_end = min(t.offset for t in tensors), max(t.offset + t.nbytes for t in tensors)
    # every cut inside the header (the magic, the counts, each key, value, string and tensor entry),
    # then a few inside the tensor data
    cuts = [*range(0, data_start + 1), data_start + 8, data_end - 16, data_end - 1]
    for size in cuts:
        message = _open_cut(whole, size, tmp_path)
        assert "truncated" in message, (size, message)
        assert "\n" not in message and "unpack" not in message and "buffer" not in message, (size, message)
        assert str(tmp_path / f"cut{size}.gguf") in message


def test_a_cut_in_the_header_says_where_the_file_ends(small_gguf, tmp_path):
    whole = small_gguf.read_bytes()
    message = _open_cut(whole, 40, tmp_path)
    assert message.endswith("is truncated: its header runs past the end of the file (40 bytes); "
                            "pull or download it again")  # fmt: skip


def test_a_file_that_is_not_gguf_is_not_called_truncated(tmp_path):
    for name, data in [("text.gguf", b"this is not a gguf file at all" * 10), ("short.gguf", b"GGML")]:
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(KvlabError, match="not a valid GGUF file") as e:
            GGUFFile(path)
        assert "truncated" not in str(e.value)
