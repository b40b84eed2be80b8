"""Launching tensor parallelism: the `LLM` API, `kvlab run` and `kvlab serve` under torchrun at 2 ranks
answer what one process answers; what cannot run tensor-parallel says so in one line.

The torchrun cases launch `python -m torch.distributed.run --standalone` (a free rendezvous port, so
tests running side by side do not meet) with the worktree's code first on the path; gloo, 2 processes,
the tiny random llama with its tokenizer.
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
import time
from pathlib import Path

import httpx
import pytest

from kvlab import LLM
from kvlab.cli import main
from kvlab.errors import KvlabError

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
SMALL = ["--threads", "1", "--kv-memory", "1MiB", "--max-model-len", "256"]


def torchrun_cmd(*args: str, world: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), *args]


def run(cmd: list[str], timeout: float = 240, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in ENV.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout, **kwargs)


# ---- the offline API ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_llm_at_two_ranks_gives_every_rank_the_outputs_of_one_process(tiny_chat_model, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    done = run([sys.executable, "tests/tp_llm.py", str(tiny_chat_model), str(one)])  # no torchrun: a world of 1
    assert done.returncode == 0, done.stderr[-3000:]
    done = run(torchrun_cmd("tests/tp_llm.py", str(tiny_chat_model), str(two)))
    assert done.returncode == 0, done.stderr[-3000:]
    single = json.loads((one / "rank0.json").read_text())
    ranks = [json.loads((two / f"rank{r}.json").read_text()) for r in (0, 1)]
    # greedy and seeded: as one process draws them; every rank returns the same outputs
    assert ranks[0]["tokens"][:-1] == single["tokens"][:-1] and ranks[0]["text"][:-1] == single["text"][:-1]
    # the last request samples without a seed: random from run to run, but the same on both ranks
    assert ranks[1]["tokens"] == ranks[0]["tokens"] and ranks[1]["text"] == ranks[0]["text"]
    assert all(len(t) == 12 for t in ranks[0]["tokens"])
    assert ranks[0]["prefix_hit_tokens"] > 0  # the last greedy prompt starts with the first
    # each rank holds half the KV cache (4 query heads and 2 KV heads: one KV head each) and a share of the weights
    assert [r["kv_bytes_per_token"] * 2 for r in ranks] == [single["kv_bytes_per_token"]] * 2
    assert all(r["weight_bytes"] < single["weight_bytes"] for r in ranks)


def test_llm_with_ranks_but_no_torchrun_says_how_to_launch(tiny_chat_model, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(KvlabError, match=r"tensor_parallel_size=2 needs 2 processes: launch with torchrun --nproc-per-node 2"):
        LLM(tiny_chat_model, tensor_parallel_size=2)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(KvlabError, match=r"does not match the 3 processes torchrun launched"):
        LLM(tiny_chat_model, tensor_parallel_size=2)


# ---- kvlab run ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_kvlab_run_at_two_ranks_prints_what_one_process_prints_once(tiny_chat_model):
    model, prompt = str(tiny_chat_model), "The capital of France is"
    single = run([sys.executable, "-m", "kvlab", "run", model, prompt, "--max-tokens", "16", *SMALL])
    assert single.returncode == 0, single.stderr
    # the prompt on standard input: rank 0 reads it and hands it to the other rank
    tp = run(torchrun_cmd("-m", "kvlab", "run", model, "-", "--max-tokens", "16", "-tp", "2", *SMALL), input=prompt)
    assert tp.returncode == 0, tp.stderr[-3000:]
    assert tp.stdout == single.stdout and single.stdout.strip()
    assert tp.stderr.count("── ") == 1 and "× 2 ranks" in tp.stderr  # one report, rank 0's
    tp = run(torchrun_cmd("-m", "kvlab", "run", model, prompt, "--max-tokens", "16", "--json",
                          "--tensor-parallel-size", "2", *SMALL))  # fmt: skip
    assert tp.returncode == 0, tp.stderr[-3000:]
    lines = tp.stdout.splitlines()
    single = run([sys.executable, "-m", "kvlab", "run", model, prompt, "--max-tokens", "16", "--json", *SMALL])
    assert len(lines) == 1 and json.loads(lines[0])["tensor_parallel_size"] == 2
    assert json.loads(lines[0])["token_ids"] == json.loads(single.stdout)["token_ids"]


@pytest.mark.parametrize("argv, says", [
    (["run", "MODEL", "hi", "-tp", "2"], "--tensor-parallel-size 2 needs 2 processes: launch with torchrun --nproc-per-node 2 -m kvlab"),
    (["serve", "MODEL", "--port", "0", "-tp", "2"], "--tensor-parallel-size 2 needs 2 processes"),
    (["run", "MODEL", "hi", "-tp", "0"], "--tensor-parallel-size must be at least 1, got 0"),
    (["chat", "MODEL", "-tp", "2"], "kvlab chat runs in one process"),
])  # fmt: skip
def test_what_cannot_run_tensor_parallel_is_one_line_and_exit_2(tiny_chat_model, monkeypatch, capsys, argv, says):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main([str(tiny_chat_model) if a == "MODEL" else a for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err  # before anything loads: no plan, no report
    assert err[0].startswith("kvlab: error: ") and says in err[0]


def test_a_world_that_does_not_match_is_one_line_and_exit_2(tiny_chat_model, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun --nproc-per-node 2 would set it
    monkeypatch.setenv("RANK", "0")
    for argv, says in ((["-tp", "3"], "--tensor-parallel-size 3 does not match the 2 processes"),
                       ([], "--tensor-parallel-size 1 does not match the 2 processes")):  # fmt: skip
        code = main(["run", str(tiny_chat_model), "hi", *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and says in err[0], err


# ---- kvlab serve, and a rank that stops answering ----------------------------------------------------------


def ranks_of(torchrun_pid: int) -> dict[int, int]:
    """torchrun's workers, rank → pid: its descendants with RANK in their environment."""
    parents = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit():
                parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:  # gone meanwhile
            continue
    family, out = {torchrun_pid}, {}
    for _ in range(4):  # children, grandchildren, ...
        family |= {pid for pid, parent in parents.items() if parent in family}
    for pid in family - {torchrun_pid}:
        try:
            env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
            command = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        except OSError:
            continue
        if "RANK" in env and "-m" in command and command[command.index("-m") + 1] == "kvlab":  # not a helper
            out[int(env["RANK"])] = pid
    return out


class Server:
    """`kvlab serve` (or a torchrun job of it) on a free port, in a session of its own; its stderr lines as they come."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT,
                                     env=env or ENV, start_new_session=True)  # fmt: skip
        self.lines: queue.Queue = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 180
        while True:
            line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            found = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
            if found:
                self.url = found.group(1)
                return

    def _read(self):
        for line in self.proc.stderr:
            self.err.append(line)
            self.lines.put(line)

    def ranks(self) -> dict[int, int]:
        return ranks_of(self.proc.pid)

    def stop(self) -> None:
        kill(self.proc)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=120)


def kill_when_done(rank0: int, stopped: int, timeout: float = 120) -> None:
    """SIGKILL the stopped rank once rank 0 has ended (exited, or a zombie torchrun has yet to reap):
    torchrun would otherwise give it 30 s (its fixed shutdown grace) to take a SIGTERM it cannot run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{rank0}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except OSError:  # gone
            break
        time.sleep(0.1)
    try:
        os.kill(stopped, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill(proc: subprocess.Popen) -> None:
    """A job and its ranks, if still there: torchrun starts each rank in a session of its own."""
    if proc.poll() is None:
        for pid in ranks_of(proc.pid).values():
            os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


REQUESTS = [
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}),
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0.8, "seed": 3,
                         "n": 2}),  # a prefix hit, and a fork  # fmt: skip
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 10, "temperature": 0}),
]


def answers(server: Server) -> list:
    out = []
    for path, body in REQUESTS:
        r = server.post(path, {"model": "tiny", **body})
        assert r.status_code == 200, r.text
        out.append([(c.get("text") or c["message"]["content"], c["finish_reason"]) for c in r.json()["choices"]])
        out.append(r.json()["usage"]["completion_tokens"])
    return out


@pytest.mark.slow
def test_kvlab_serve_at_two_ranks_answers_what_one_process_answers(tiny_chat_model):
    model = str(tiny_chat_model)
    single = Server([sys.executable, "-m", "kvlab", "serve", model, "--port", "0", "--served-model-name", "tiny", *SMALL])
    try:
        expected = answers(single)
    finally:
        single.stop()
    tp = Server(torchrun_cmd("-m", "kvlab", "serve", model, "--port", "0", "--served-model-name", "tiny", "-tp", "2",
                             *SMALL))  # fmt: skip
    try:
        assert answers(tp) == expected
        assert "".join(tp.err).count("memory plan") == 1 and "per rank of 2" in "".join(tp.err)
        ranks = tp.ranks()
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[0], signal.SIGTERM)  # rank 0 stops as one server does, and tells rank 1 to stop
        assert tp.proc.wait(60) == 0, "".join(tp.err)[-3000:]
        assert "kvlab serve: stopped" in "".join(tp.err)
    finally:
        tp.stop()


@pytest.mark.slow
def test_a_rank_that_stops_answering_ends_the_server_in_one_line(tiny_chat_model):
    model = str(tiny_chat_model)
    tp = Server(torchrun_cmd("-m", "kvlab", "serve", model, "--port", "0", "-tp", "2", *SMALL),
                env={**ENV, "KVLAB_TP_TIMEOUT_S": "5"})  # fmt: skip
    try:
        ranks = tp.ranks()
        os.kill(ranks[1], signal.SIGSTOP)  # alive, but it never reaches the next collective
        started = time.monotonic()
        try:
            r = tp.post("/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 4})
            assert r.status_code >= 500
        except httpx.TransportError:
            pass  # the server went down with the request
        kill_when_done(ranks[0], ranks[1])
        tp.proc.wait(120)
        assert time.monotonic() - started < 90
        err = "".join(tp.err)
        line = next(x for x in err.splitlines() if x.startswith("kvlab serve: the engine stopped"))
        assert "RankFailed" in line and "stopped answering within 5 s" in line, err[-3000:]
        rank0 = err[: err.index(line)]
        assert "Traceback" not in rank0, rank0[-3000:]  # torchrun's own report comes after it
    finally:
        tp.stop()


@pytest.mark.slow
def test_a_rank_that_stops_answering_ends_kvlab_run_in_one_line(tiny_chat_model):
    cmd = torchrun_cmd("-m", "kvlab", "run", str(tiny_chat_model), "hello", "--max-tokens", "480", "--ignore-eos",
                       "-tp", "2", *SMALL[:4], "--max-model-len", "512")  # fmt: skip
    env = {k: v for k, v in ENV.items() if k not in ("WORLD_SIZE", "RANK")}
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, start_new_session=True,
                           env={**env, "KVLAB_TP_TIMEOUT_S": "5"})  # fmt: skip
    try:
        assert job.stdout.read(1)  # rank 0 has begun to print its answer: both ranks are generating
        ranks = ranks_of(job.pid)
        os.kill(ranks[1], signal.SIGSTOP)
        threading.Thread(target=kill_when_done, args=(ranks[0], ranks[1]), daemon=True).start()
        _, err = job.communicate(timeout=120)
        err = err.decode(errors="replace")
        kvlab_lines = [x for x in err.splitlines() if x.startswith("kvlab:")]  # torchrun adds "kvlab FAILED"
        assert job.returncode != 0 and len(kvlab_lines) == 1, err[-3000:]
        assert kvlab_lines[0].startswith("kvlab: error: rank 0: ") and "stopped answering within 5 s" in kvlab_lines[0]
        assert "Traceback" not in err[: err.index(kvlab_lines[0])]
    finally:
        kill(job)
