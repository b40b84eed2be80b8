"""Tokenizers for the models kvlab runs, built from a GGUF file's metadata or a `tokenizer.json` directory.

- `tokenizer.py`: the `Tokenizer` class (loading, encode/decode, special and stop ids, chat).
- `gguf_bpe.py`: rebuilding a byte-level BPE from GGUF `tokenizer.ggml.*` metadata the way llama.cpp does.
- `chat_template.py`: the sandboxed Jinja environment chat templates are rendered in.
"""

from kvlab.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer"]
