"""Checking, before any work, that a command's optional pieces are installed, with a fitting hint.

Every command the README lists runs on a plain install (its packages are base dependencies); what is
checked here is a broken environment (a package uninstalled by hand) and the dev extra's pieces
(`kvlab lab --compare transformers`). The hint names the install command that fits how kvlab itself
was installed: from a checkout (editable, or the source tree on sys.path: `make install` or
`pip install -e DIR`), or a regular install (`pip install PACKAGE`).
"""

from __future__ import annotations

import importlib.util
import shlex
import sys
from pathlib import Path

from kvlab.errors import KvlabError

# the distribution that provides a module, where the names differ
DISTRIBUTIONS = {"yaml": "pyyaml"}


def require(module: str, needed_by: str, extra: str | None = None) -> None:
    """KvlabError unless `module` can be imported: "<needed_by> needs <module>, which is not installed
    here: <how to install it>". `extra`: the optional-dependency group of kvlab that brings it."""
    if importlib.util.find_spec(module) is not None:
        return
    raise KvlabError(f"{needed_by} needs {module}, which is not installed here: {install_hint(module, extra)}")


def install_hint(module: str, extra: str | None = None) -> str:
    """How to install `module` into this Python, fitting how kvlab was installed."""
    pip = f"{shlex.quote(sys.executable)} -m pip install"
    checkout = editable_checkout()
    if checkout is not None:
        target = shlex.quote(f"{checkout}[{extra}]" if extra else str(checkout))
        has_make = (checkout / "Makefile").is_file()
        make = f"`make install{'-dev' if extra == 'dev' else ''}` in {checkout}, or " if has_make else ""
        return f"run {make}`{pip} -e {target}`"
    return f"run `{pip} {shlex.quote(_requirement(module))}`"


def editable_checkout() -> Path | None:
    """The checkout kvlab runs from (an editable install, or a source tree on sys.path), else None."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "kvlab").is_dir() else None


def _requirement(module: str) -> str:
    """kvlab's own requirement for the module's distribution ("matplotlib>=3.7"), or its bare name."""
    from importlib import metadata  # only on the way to an error: it costs ~10 ms to import

    name = DISTRIBUTIONS.get(module, module)
    try:
        requires = metadata.requires("kvlab") or []
    except metadata.PackageNotFoundError:
        requires = []
    for line in requires:
        spec = line.split(";")[0].strip()
        if spec.lower().startswith(name.lower()) and spec[len(name) : len(name) + 1] in ("", ">", "<", "=", "~", "!", "["):
            return spec
    return name
