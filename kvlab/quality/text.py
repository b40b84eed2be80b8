"""The text `kvlab quality` reads: real prose and code that every Python install carries, or a file.

The default corpus is the source of a fixed list of standard-library modules (code, comments and
long docstrings in English), read from this interpreter's own library directory, so it is there
offline and the same on every machine with the same Python. Its tokens are hashed into the result's
key: a different Python (different sources) is a different measurement.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

from kvlab.errors import KvlabError

# docstring-heavy modules first; enough for tens of thousands of tokens with any tokenizer
STDLIB_MODULES = ("textwrap.py", "difflib.py", "fractions.py", "statistics.py", "heapq.py", "calendar.py",
                  "shlex.py", "argparse.py", "inspect.py", "typing.py")  # fmt: skip


def stdlib_text(min_chars: int) -> tuple[str, str]:
    """(text, description): the listed modules' sources, concatenated until at least `min_chars`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, used = [], []
    for name in STDLIB_MODULES:
        path = root / name
        if not path.is_file():
            continue
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
        used.append(name)
        if sum(map(len, parts)) >= min_chars:
            break
    if not parts:
        raise KvlabError(f"no standard-library sources under {root} to read: give a text with --text FILE")
    return "\n\n".join(parts), f"Python {sysconfig.get_python_version()} standard library: {', '.join(used)}"


def file_text(path: str) -> tuple[str, str]:
    p = Path(path)
    if not p.is_file():
        raise KvlabError(f"--text {path}: no such file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KvlabError(f"--text {path}: not UTF-8 text") from None
    if not text.strip():
        raise KvlabError(f"--text {path}: the file is empty")
    return text, str(p)


def text_ids(tokenizer, num_tokens: int, path: str | None = None) -> tuple[list[int], str]:
    """The first `num_tokens` token ids of the text (all of a shorter --text file), and what it is."""
    if path is not None:
        text, what = file_text(path)
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        chars = 6 * num_tokens  # code runs 3-4 characters a token; read more, then cut at the token count
        while True:
            text, what = stdlib_text(chars)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) >= num_tokens or len(text) < chars:  # enough, or every listed module read
                break
            chars *= 2
    return ids[:num_tokens], what


def ids_digest(ids: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]
