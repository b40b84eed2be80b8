"""The documents cite only files that exist in the repository (or say what writes them)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITED = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|c|h|js|css|html|sh|png|toml))(?![\w/])")
# files a command writes or a reader brings, named as such in the text: never in the repository
WRITTEN = {"report.md", "kv.png", "my_script.py", "NAME.py", "difflib.py", "textwrap.py"}


def repository_files() -> set[str]:
    listed = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]  # tracked, and new files not ignored
    return set(subprocess.run(listed, cwd=ROOT, capture_output=True, text=True, check=True).stdout.split())


def exists(cited: str, files: set[str]) -> bool:
    if Path(cited).name in WRITTEN:
        return True
    # a path from the root, from kvlab/, or a short name a folder's line in the tree introduces
    return any(f == cited or f.endswith("/" + cited) for f in files)


def test_every_file_the_docs_cite_exists():
    files = repository_files()
    documents = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
    missing = []
    for doc in documents:
        for line in (ROOT / doc).read_text().splitlines():
            missing += [f"{doc}: {c}" for c in CITED.findall(line) if not exists(c, files)]
    assert not missing, "\n".join(missing)


def test_the_check_finds_a_missing_file():
    files = repository_files()
    assert exists("kvlab/sampling/draw.py", files) and exists("draw.py", files) and exists("pool.h", files)
    assert not exists("kvlab/sampling/nowhere.py", files) and not exists("shared/research/anchors.md", files)
