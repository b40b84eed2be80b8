"""Tokenizers for the models kvlab runs, built from a GGUF file's metadata or a `tokenizer.json` directory.

- `tokenizer.py`: the `Tokenizer` class (loading, encode/decode, special and stop ids, chat).
- `gguf_bpe.py`: rebuilding a byte-level BPE from GGUF `tokenizer.ggml.*` metadata the way llama.cpp does.
- `chat_template.py`: the sandboxed Jinja environment chat templates are rendered in.
"""

from kvlab.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer", "load_tokenizer"]


def load_tokenizer(loaded) -> Tokenizer | None:
    """A loaded model's tokenizer (model/loader.py's LoadedModel), or None for a directory without one
    (tiny test models)."""
    if loaded.gguf is not None:  # the loader's parse of the file: its vocabulary is not read twice
        return Tokenizer.from_gguf_file(loaded.gguf)
    if loaded.path.is_dir() and not (loaded.path / "tokenizer.json").is_file():
        return None
    return Tokenizer.load(loaded.path)
