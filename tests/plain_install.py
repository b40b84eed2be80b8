"""Run kvlab commands as on a plain install (`pip install kvlab`, no extras): importing a package that
only an extra or the test environment brings fails here, as it would there.

    python tests/plain_install.py RESULTS.json ARGS.json    # ARGS: [[argv, stdin text or null], ...]

Each command runs in this process through kvlab.cli.main; RESULTS gets their exit codes in order.
"""

from __future__ import annotations

import importlib.abc
import io
import json
import re
import sys
from importlib import metadata
from pathlib import Path


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def base_distributions() -> set[str]:
    """kvlab and its base dependencies (pyproject.toml's, not a possibly stale egg-info's) with everything
    they require in turn, no extras."""
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    seen: set[str] = {"kvlab"}
    todo = [_name(r) for r in pyproject["project"]["dependencies"]]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            marker = line.partition(";")[2]
            if "extra" in marker or not _marker_holds(marker):
                continue
            todo.append(_name(line))
    return seen


def _marker_holds(marker: str) -> bool:
    if not marker.strip():
        return True
    try:
        from packaging.markers import Marker
    except ImportError:  # without packaging, count the requirement in (the stricter reading)
        return True
    return Marker(marker).evaluate()


def blocked_modules() -> set[str]:
    """Top-level modules installed here whose distributions are all outside the plain install."""
    allowed = base_distributions()
    blocked = set()
    for module, dists in metadata.packages_distributions().items():
        if module in sys.stdlib_module_names or module.startswith("_"):
            continue
        if not any(_name(d) in allowed for d in dists):
            blocked.add(module)
    return blocked


class PlainInstall(importlib.abc.MetaPathFinder):
    def __init__(self, blocked: set[str]):
        self.blocked = blocked

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.blocked:
            raise ModuleNotFoundError(f"No module named '{name}' (not part of a plain install)", name=name)
        return None


def main() -> None:
    results_path, args_path = sys.argv[1:3]
    blocked = blocked_modules()
    sys.meta_path.insert(0, PlainInstall(blocked))
    from kvlab.cli import main as kvlab

    codes = []
    for argv, stdin in json.loads(open(args_path).read()):
        sys.stdin = io.StringIO(stdin or "")
        try:
            codes.append(kvlab(argv))
        except SystemExit as e:  # argparse
            codes.append(e.code)
        sys.stdout.flush()
    with open(results_path, "w") as f:
        json.dump({"codes": codes, "blocked": sorted(blocked)}, f)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:  # the server runs as its own process, blocked the same way
        sys.meta_path.insert(0, PlainInstall(blocked_modules()))
        from kvlab.cli import main as kvlab

        sys.exit(kvlab(sys.argv[1:]))
    main()
