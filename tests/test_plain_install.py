"""Every command in the README's table runs on a plain install (no extras): each is run for real, in
processes where a package only an extra or the tests bring cannot be imported (tests/plain_install.py).

The server runs as its own such process; `kvlab ps` and `kvlab bench serve --url` are pointed at it
(the README's first user hit `ModuleNotFoundError: httpx` there), and it must log each request.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvlab import hub

ROOT = Path(__file__).resolve().parents[1]
HELPER = Path(__file__).with_name("plain_install.py")


def readme_commands() -> set[str]:
    """The commands of the README's table: `kvlab bench serve`, `kvlab run`, ..."""
    text = (ROOT / "README.md").read_text()
    table = text.split("## Commands", 1)[1].split("\n\n", 2)[1]
    found = set()
    for row in table.splitlines()[2:]:
        words = row.split("`")[1].split()  # `kvlab run MODEL "prompt"` → kvlab, run, MODEL, ...
        found.add(" ".join(w for w in words[1:3] if w.islower() and w.isalpha()))
    return found


def invocations(model: Path, gguf: Path, tmp: Path, url: str) -> dict[str, list]:
    """For each README command, the runs that exercise it: [argv, standard input]."""
    tiny = ["--threads", "1", "--max-model-len", "256", "--kv-memory", "1MiB"]
    return {
        "list": [[["list"], None]],
        "pull": [[["pull", hub.DEFAULT_MODEL], None]],  # a file of the right size is there: "already pulled"
        "show": [[["show", str(gguf)], None]],
        "rm": [[["rm", hub.DEFAULT_MODEL], None]],
        "run": [[["run", str(model), "hi", "--max-tokens", "2", *tiny], None]],
        "chat": [[["chat", str(model), "--max-tokens", "2", *tiny], "hi\n/bye\n"]],
        "mem": [[["mem", "qwen3-0.6b", "--plot", str(tmp / "kv.png")], None]],
        "lab": [[["lab", "cache", "--model", str(model), "--quick", "--repeat", "1", "--threads", "1", "--no-progress",
                  "--out", str(tmp / "lab")], None]],  # fmt: skip
        "quality": [[["quality", str(model), "--kv-cache-dtype", "bfloat16", "--tokens", "64", "--window", "32",
                      "--threads", "1"], None]],  # fmt: skip
        "check": [[["check", str(model), "--kv-cache-dtype", "float32", "--num-prompts", "2", "--prompt-tokens", "8",
                    "--max-tokens", "2", "--threads", "1"], None]],  # fmt: skip
        "serve": [],  # the server process itself
        "ps": [[["ps", "--url", url], None]],
        "bench serve": [[["bench", "serve", "--url", url, "--num-requests", "2", "--concurrency", "2",
                          "--prompt-len", "4", "--output-len", "2"], None]],  # fmt: skip
    }


def start_server(model: Path, env: dict) -> tuple[subprocess.Popen, str, queue.Queue]:
    cmd = [sys.executable, str(HELPER), "serve", str(model), "--port", "0", "--kv-memory", "1MiB",
           "--max-model-len", "256", "--threads", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    seen = []
    while True:
        line = lines.get(timeout=120)
        seen.append(line)
        found = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        if found:
            return proc, found.group(1), lines
        assert proc.poll() is None, "".join(seen)


def test_every_readme_command_runs_without_extras(tiny_chat_model, tmp_path):
    from tiny import build_tiny_gguf

    gguf = build_tiny_gguf(tiny_chat_model, tmp_path / "tiny.gguf")
    home = tmp_path / "home"
    pulled = hub.model_path(hub.DEFAULT_MODEL).relative_to(hub.kvlab_home())
    (home / pulled).parent.mkdir(parents=True)
    with open(home / pulled, "wb") as f:  # sparse, the registry's size: `pull` finds it pulled
        f.truncate(hub.REGISTRY[hub.DEFAULT_MODEL].size_bytes)
    env = {**os.environ, "KVLAB_HOME": str(home), "MPLBACKEND": "Agg"}
    server, url, server_log = start_server(tiny_chat_model, env)
    try:
        runs = invocations(tiny_chat_model, gguf, tmp_path, url)
        assert set(runs) == readme_commands()  # a new README row needs a run here
        args = [run for name in runs for run in runs[name]]
        (tmp_path / "args.json").write_text(json.dumps(args))
        done = subprocess.run([sys.executable, str(HELPER), str(tmp_path / "results.json"), str(tmp_path / "args.json")],
                              env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        results = json.loads((tmp_path / "results.json").read_text())
        assert "transformers" in results["blocked"] and "pytest" in results["blocked"]  # the guard was on
        failed = [(argv, code) for (argv, _), code in zip(args, results["codes"]) if code != 0]
        assert not failed, (failed, done.stderr[-3000:])
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
    assert server.returncode == 0
    log = "".join(server_log.get() for _ in range(server_log.qsize()))
    assert re.search(r'"POST /v1/completions" 200 stream, \d+ prompt tokens.* → 2, TTFT \d+ ms', log), log
    assert (tmp_path / "kv.png").stat().st_size > 5000 and (tmp_path / "lab" / "cache.png").is_file()
    assert not (home / pulled).exists()  # `rm` removed it


@pytest.mark.parametrize("module", ["matplotlib", "httpx", "fastapi", "uvicorn"])
def test_what_the_commands_import_is_a_base_dependency(module):
    import tomllib

    sys.path.insert(0, str(HELPER.parent))
    from plain_install import blocked_modules

    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(req.startswith(module) for req in base), module
    assert module not in blocked_modules()


def test_a_missing_piece_is_named_before_any_work(monkeypatch, capsys, tiny_chat_model):
    import importlib.util

    from kvlab.cli import main
    from kvlab.model import loader

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("the model was loaded before the check"))
    assert main(["lab", "phases", "--model", str(tiny_chat_model), "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kvlab lab (its plots) needs matplotlib, which is not installed here" in err
    assert f"-m pip install -e {ROOT}" in err  # this checkout's own install command
