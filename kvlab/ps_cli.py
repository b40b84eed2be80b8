"""`kvlab ps`: what a running `kvlab serve` holds, as `ollama ps` shows it: the model, its memory (weights
and KV pool), where it runs, the KV blocks in use and the requests in flight. It reads the server's
`GET /api/ps` (ollama's path; kvlab's fields under "kvlab")."""

from __future__ import annotations

import json
import os

from kvlab.deps import require
from kvlab.errors import KvlabError

DEFAULT_URL = "http://127.0.0.1:8000"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "ps", help="what a running kvlab server holds: model, memory, KV cache, requests",
        description="Ask a running `kvlab serve` what it holds (GET /api/ps): the model, the memory of its "
                    "weights and KV pool, the device, the KV blocks in use and the requests in flight.",
    )  # fmt: skip
    p.add_argument("--url", default=DEFAULT_URL, help="the server's address")
    p.add_argument("--api-key", help="Bearer key, if the server has one (default: $KVLAB_API_KEY)")
    p.add_argument("--json", action="store_true", help="print the server's answer as JSON")
    p.set_defaults(func=cmd_ps)


def cmd_ps(args) -> int:
    require("httpx", "kvlab ps")
    data = fetch(args.url.rstrip("/"), args.api_key or os.environ.get("KVLAB_API_KEY"))
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(table(data["models"]))
    return 0


def fetch(url: str, api_key: str | None) -> dict:
    """The server's /api/ps answer; a one-line KvlabError when there is no kvlab server there."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{url}/api/ps", headers=headers, timeout=10.0)
    except httpx.HTTPError as e:
        raise KvlabError(f"no kvlab server answers at {url} ({e}): start one with `kvlab serve MODEL`, "
                         "or give its address with --url") from None  # fmt: skip
    if response.status_code == 401:
        raise KvlabError(f"{url} wants an API key: pass --api-key (or set KVLAB_API_KEY)")
    if response.status_code == 404:
        raise KvlabError(f"{url} has no /api/ps: it is not a kvlab server (or an older one)")
    try:
        data = response.json()
        response.raise_for_status()
    except (ValueError, httpx.HTTPStatusError):
        raise KvlabError(f"{url}/api/ps answered {response.status_code} {response.reason_phrase}") from None
    if not isinstance(data, dict) or not isinstance(data.get("models"), list):
        raise KvlabError(f"{url}/api/ps did not answer with a list of models: not a kvlab server?")
    return data


def table(models: list[dict]) -> str:
    """One line per model, in ollama's columns plus the KV cache and the requests."""
    head = ["NAME", "SIZE", "PROCESSOR", "CONTEXT", "KV CACHE", "REQUESTS"]
    rows = [head]
    for m in models:
        k = m.get("kvlab", {})
        used, total = k.get("kv_blocks_used", 0), max(1, k.get("kv_blocks_total", 1))
        rows.append([
            m["name"],
            f"{m['size'] / 1e9:.2f} GB" if m["size"] >= 1e8 else f"{m['size'] / 1e6:.0f} MB",
            f"cpu, {_threads(k.get('threads'))}" if k.get("device") == "cpu" else k.get("device", "?"),
            f"{m.get('context_length', 0):,}",
            f"{used}/{total} blocks ({used / total:.0%}) of {k.get('kv_pool_bytes', 0) / 2**20:.0f} MiB",
            f"{k.get('requests_running', 0)} running, {k.get('requests_waiting', 0)} waiting",
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["   ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines) if models else "\n".join(lines) + "\n(the server holds no model)"


def _threads(n) -> str:
    """"1 thread", "4 threads"; "? threads" when the server does not say."""
    return f"{n} thread{'' if n == 1 else 's'}" if n is not None else "? threads"
