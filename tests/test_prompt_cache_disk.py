"""The prompt cache's disk tier (--prompt-cache-dir, kv/prompt_cache.py, kv/disk_tier.py).

Every case compares greedy tokens with a cold run (no tier, no prefix cache) of the same prompt, and
checks what the request says it took from memory and from disk, and what lies in the directory.
Tiny random models; the engine's prefill is chunked (max_num_batched_tokens) so that a prompt's
blocks are registered over several steps.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlab import LLM, SamplingParams
from kvlab.errors import KvlabError
from kvlab.kv.disk_tier import SUFFIX, VERSION_DIR

BS = 16
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = [(7 * i + 3) % 500 + 5 for i in range(150)]  # 9 whole blocks before the last token
OTHER = [(11 * i + 1) % 500 + 5 for i in range(150)]
OPTIONS = dict(max_num_batched_tokens=64, kv_memory_bytes=4 * 2**20)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny import build_tiny

    return build_tiny("llama", tmp_path_factory.mktemp("tiny-disk"))


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    from tiny import build_tiny

    return build_tiny("gemma3", tmp_path_factory.mktemp("tiny-gemma3-disk"))


@pytest.fixture(scope="module")
def cold(tiny_model, one_thread):
    """Greedy tokens of each prompt with no cache to reuse at all."""
    llm = LLM(tiny_model, enable_prefix_caching=False, **OPTIONS)
    return {name: llm.generate({"prompt_token_ids": p}, PARAMS).token_ids for name, p in
            (("prompt", PROMPT), ("other", OTHER))}  # fmt: skip


def open_llm(model, directory, **extra) -> LLM:
    return LLM(model, prompt_cache_dir=str(directory), **{**OPTIONS, **extra})


def run(llm: LLM, prompt=PROMPT, salt=None):
    if salt is None:
        return llm.generate({"prompt_token_ids": prompt}, PARAMS)
    # a salted request, as the server makes one (LLM has no salt argument)
    from kvlab.output.result import RequestOutput

    out = RequestOutput(prompt=None, prompt_token_ids=list(prompt))
    llm.engine.add_request(list(prompt), PARAMS, output=out, cache_salt=salt)
    while llm.engine.has_unfinished_requests:
        llm.engine.step()
    return out


def closed(llm: LLM) -> None:
    """The process ends: every queued block written, the threads stopped."""
    llm.engine.close()


def block_files(directory) -> list[Path]:
    return sorted(Path(directory, VERSION_DIR).glob(f"*/*{SUFFIX}"))


def test_restart_with_a_warm_dir_reads_the_prefix_from_disk(tiny_model, cold, tmp_path):
    first = open_llm(tiny_model, tmp_path)
    out = run(first)
    assert out.token_ids == cold["prompt"]
    assert out.metrics.cached_prompt_tokens == 0
    closed(first)
    # 9 prompt blocks + the blocks the answer filled (157 tokens computed: 9 whole blocks)
    assert len(block_files(tmp_path)) == 9
    first.engine.kv.pool.check_integrity()

    second = open_llm(tiny_model, tmp_path)
    out = run(second)
    assert out.token_ids == cold["prompt"]
    assert out.metrics.cached_prompt_tokens == 9 * BS  # every whole block before the last token
    assert out.metrics.cached_prompt_tokens_disk == 9 * BS
    assert out.metrics.timing_split()["cached_prompt_tokens_disk"] == 9 * BS
    assert second.engine.prompt_cache.stats.hits == 9
    # a third request in the same process finds them in memory: none from disk
    again = run(second)
    assert again.token_ids == cold["prompt"]
    # (the memory hit adds the run copied from the last, partial block, which is never on disk)
    assert (again.metrics.cached_prompt_tokens, again.metrics.cached_prompt_tokens_disk) == (len(PROMPT) - 1, 0)
    second.engine.kv.pool.check_integrity()
    closed(second)


# ---- helpers for the failure cases ------------------------------------------------------------------


def block_path(llm: LLM, i: int, prompt=PROMPT, salt=None) -> Path:
    """The file of block i of `prompt` (KV group 0) in `llm`'s tier."""
    from kvlab.kv.prefix_cache import hash_blocks, salted_root

    hashes = hash_blocks(prompt[: (i + 1) * BS], BS, [], salted_root(salt))
    store = llm.engine.prompt_cache.store
    return Path(store.path(store.name(llm.engine.kv.group_keys(hashes[i])[0])))


def warm_dir(model, directory, prompt=PROMPT, salt=None, **extra) -> None:
    llm = open_llm(model, directory, **extra)
    run(llm, prompt, salt)
    closed(llm)


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_a_damaged_file_is_a_miss_removed_and_logged_once(tiny_model, cold, tmp_path, caplog, damage):
    warm_dir(tiny_model, tmp_path)
    llm = open_llm(tiny_model, tmp_path)
    bad = block_path(llm, 4)
    data = bad.read_bytes()
    if damage == "truncate":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "flip":  # one byte of K/V in the middle of the payload
        bad.write_bytes(data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0x10]) + data[len(data) // 2 + 1 :])
    elif damage == "empty":
        bad.write_bytes(b"")
    else:
        bad.write_bytes(os.urandom(len(data)))
    with caplog.at_level(logging.WARNING, logger="kvlab.kv.disk_tier"):
        out = run(llm)
    assert out.token_ids == cold["prompt"]
    # blocks 0-3 came from disk; the run stopped at the bad block, recomputed from there
    assert (out.metrics.cached_prompt_tokens, out.metrics.cached_prompt_tokens_disk) == (4 * BS, 4 * BS)
    assert llm.engine.prompt_cache.stats.bad_files == 1
    assert [r.message for r in caplog.records if "unusable" in r.message] and len(caplog.records) == 1
    closed(llm)
    assert bad.exists() and bad.read_bytes() == data  # recomputed and written again, whole
    llm.engine.kv.pool.check_integrity()


def test_another_fingerprint_never_reads_the_blocks(tiny_model, cold, tmp_path, caplog):
    warm_dir(tiny_model, tmp_path)
    # another KV format: other bytes, another fingerprint, other file names
    bf16 = open_llm(tiny_model, tmp_path, kv_cache_dtype="bfloat16")
    cold_bf16 = LLM(tiny_model, enable_prefix_caching=False, kv_cache_dtype="bfloat16", **OPTIONS)
    expected = cold_bf16.generate({"prompt_token_ids": PROMPT}, PARAMS).token_ids
    out = run(bf16)
    assert out.token_ids == expected
    assert (out.metrics.cached_prompt_tokens, bf16.engine.prompt_cache.stats.hits) == (0, 0)
    closed(bf16)
    # a float32 file put where the bfloat16 tier looks for block 0: its header names another fingerprint
    planted = LLM(tiny_model, prompt_cache_dir=str(tmp_path), kv_cache_dtype="bfloat16", **OPTIONS)
    target = block_path(planted, 0, prompt=OTHER)
    source = block_path(open_llm(tiny_model, tmp_path), 0)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(source.read_bytes())
    with caplog.at_level(logging.WARNING, logger="kvlab.kv.disk_tier"):
        out = run(planted, OTHER)
    assert out.token_ids == cold_bf16.generate({"prompt_token_ids": OTHER}, PARAMS).token_ids
    assert out.metrics.cached_prompt_tokens == 0
    assert planted.engine.prompt_cache.stats.bad_files == 1 and "another model" in caplog.text
    closed(planted)


def test_another_block_size_never_reads_the_blocks(tiny_model, tmp_path):
    warm_dir(tiny_model, tmp_path)
    llm = open_llm(tiny_model, tmp_path, block_size=32)
    expected = LLM(tiny_model, enable_prefix_caching=False, **OPTIONS, block_size=32).generate(
        {"prompt_token_ids": PROMPT}, PARAMS).token_ids
    out = run(llm)
    assert out.token_ids == expected and out.metrics.cached_prompt_tokens == 0
    closed(llm)


def test_a_salt_reads_only_its_own_blocks(tiny_model, cold, tmp_path):
    warm_dir(tiny_model, tmp_path, salt="tenant-a")
    assert len(block_files(tmp_path)) == 9
    llm = open_llm(tiny_model, tmp_path)
    for salt in ("tenant-b", None):  # another tenant, and no tenant: nothing of tenant-a's
        out = run(llm, salt=salt)
        assert out.token_ids == cold["prompt"]
        assert out.metrics.cached_prompt_tokens_disk == 0
    closed(llm)
    again = open_llm(tiny_model, tmp_path)
    out = run(again, salt="tenant-a")
    assert out.token_ids == cold["prompt"]
    assert out.metrics.cached_prompt_tokens_disk == 9 * BS
    closed(again)


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EROFS])
def test_a_full_disk_or_read_only_dir_stops_writing_with_one_line(tiny_model, cold, tmp_path, caplog, monkeypatch, error):
    from kvlab.kv import disk_tier

    warm_dir(tiny_model, tmp_path)  # blocks of PROMPT are there; reads go on
    before = {p: p.read_bytes() for p in block_files(tmp_path)}

    def refuse(src, dst):
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(disk_tier.os, "replace", refuse)
    llm = open_llm(tiny_model, tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvlab.kv.disk_tier"):
        out = run(llm)
        assert out.token_ids == cold["prompt"] and out.metrics.cached_prompt_tokens_disk == 9 * BS
        for _ in range(2):
            assert run(llm, OTHER).token_ids == cold["other"]
        closed(llm)
    assert len([r for r in caplog.records if "no more blocks are written" in r.message]) == 1
    assert not llm.engine.prompt_cache.store.writable
    assert {p: p.read_bytes() for p in block_files(tmp_path)} == before  # nothing half written
    assert not list(Path(tmp_path, VERSION_DIR, "tmp").iterdir())


def test_a_dir_that_cannot_be_written_is_refused_at_start(tiny_model, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(KvlabError, match="cannot write there"):
        LLM(tiny_model, prompt_cache_dir=str(blocker / "cache"), **OPTIONS)
    with pytest.raises(KvlabError, match="smaller than one block"):
        LLM(tiny_model, prompt_cache_dir=str(tmp_path), prompt_cache_size=1000, **OPTIONS)
    with pytest.raises(KvlabError, match="needs prefix caching"):
        LLM(tiny_model, prompt_cache_dir=str(tmp_path), enable_prefix_caching=False, **OPTIONS)


@pytest.mark.parametrize("flags, message", [
    (["--prompt-cache-dir", "{blocker}/cache"], "cannot write there"),
    (["--prompt-cache-dir", "{tmp}", "--prompt-cache-size", "lots"], "cannot read the size"),
    (["--prompt-cache-dir", "{tmp}", "--prompt-cache-size", "0"], "must be a positive size"),
    (["--prompt-cache-size", "1GiB"], "needs --prompt-cache-dir"),
    (["serve", "--prompt-cache-dir", "{blocker}/cache"], "cannot write there"),
    (["chat", "--prompt-cache-dir", "{blocker}/cache"], "cannot write there"),
])  # fmt: skip
def test_the_cli_refuses_bad_flags_in_one_line(tiny_model, tmp_path, flags, message):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    flags = [f.format(blocker=blocker, tmp=tmp_path) for f in flags]
    command = [flags.pop(0), str(tiny_model)] if flags[0] in ("serve", "chat") else ["run", str(tiny_model), "hi"]
    proc = subprocess.run([sys.executable, "-m", "kvlab", *command, *flags],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_size_bound_holds(tiny_model, cold, tmp_path):
    probe = open_llm(tiny_model, tmp_path / "probe")
    bound = 5 * probe.engine.prompt_cache.store.file_bytes + 100  # five block files
    closed(probe)
    llm = open_llm(tiny_model, tmp_path, prompt_cache_size=bound)
    for prompt, name in ((PROMPT, "prompt"), (OTHER, "other")):
        assert run(llm, prompt).token_ids == cold[name]
    closed(llm)
    files = block_files(tmp_path)
    assert sum(p.stat().st_size for p in files) <= bound and len(files) == 4  # evicted down to 90% of it
    assert llm.engine.prompt_cache.stats.evictions == 9 + 9 - 4
    again = open_llm(tiny_model, tmp_path, prompt_cache_size=bound)
    out = run(again, OTHER)  # OTHER's last blocks were kept, its first evicted: a miss, recomputed
    assert out.token_ids == cold["other"]
    closed(again)
    assert sum(p.stat().st_size for p in block_files(tmp_path)) <= bound


def test_blocks_evicted_from_memory_come_back_from_disk(tiny_model, cold, tmp_path):
    small = dict(max_model_len=200, kv_memory_bytes=16 * 12288)  # 16 blocks: one prompt at a time
    llm = open_llm(tiny_model, tmp_path, **small)
    assert llm.engine.kv.num_blocks == 16
    assert run(llm).token_ids == cold["prompt"]
    llm.engine.prompt_cache.flush()
    out = run(llm, OTHER)  # evicts PROMPT's blocks from the pool
    assert out.token_ids == cold["other"] and out.metrics.cached_prompt_tokens == 0
    assert llm.engine.kv.pool.num_evictions > 0
    out = run(llm)
    assert out.token_ids == cold["prompt"]
    assert out.metrics.cached_prompt_tokens_disk > 0
    assert out.metrics.cached_prompt_tokens >= out.metrics.cached_prompt_tokens_disk
    llm.engine.kv.pool.check_integrity()
    closed(llm)


def test_an_aborted_request_waiting_for_its_blocks_leaves_nothing_behind(tiny_model, cold, tmp_path):
    warm_dir(tiny_model, tmp_path)
    llm = open_llm(tiny_model, tmp_path)
    rid = llm.engine.add_request(list(PROMPT), PARAMS)
    assert llm.engine.prompt_cache.num_held == 1 and llm.engine.has_unfinished_requests
    out = llm.engine.abort_request(rid)
    assert out.finished and not llm.engine.has_unfinished_requests
    time.sleep(0.2)
    assert llm.engine.step() == []
    assert llm.engine.kv.pool.check_integrity().used == 0
    assert run(llm).token_ids == cold["prompt"]
    closed(llm)


@pytest.mark.parametrize("kv_dtype", ["q8_0", "fp8_e4m3", "bfloat16"])
def test_a_quantized_cache_restarts_from_its_own_bytes(tmp_path_factory, tmp_path, one_thread, kv_dtype):
    from tiny import build_tiny

    model = build_tiny("llama", tmp_path_factory.mktemp("tiny-hd32"), head_dim=32)
    options = dict(OPTIONS, kv_cache_dtype=kv_dtype)
    expected = LLM(model, enable_prefix_caching=False, **options).generate({"prompt_token_ids": PROMPT}, PARAMS)
    warm_dir(model, tmp_path, **options)
    llm = open_llm(model, tmp_path, **options)
    out = run(llm)
    assert out.token_ids == expected.token_ids
    assert out.metrics.cached_prompt_tokens_disk == 9 * BS
    closed(llm)


def test_a_sliding_window_model_restores_every_kv_group(tiny_gemma3, tmp_path, one_thread):
    expected = LLM(tiny_gemma3, enable_prefix_caching=False, **OPTIONS).generate({"prompt_token_ids": PROMPT}, PARAMS)
    first = open_llm(tiny_gemma3, tmp_path)
    groups = len(first.engine.kv.groups)
    assert groups > 1
    assert run(first).token_ids == expected.token_ids
    closed(first)
    assert len(block_files(tmp_path)) == 9 * groups  # every group's block of every whole prompt block
    llm = open_llm(tiny_gemma3, tmp_path)
    out = run(llm)
    assert out.token_ids == expected.token_ids
    assert out.metrics.cached_prompt_tokens == out.metrics.cached_prompt_tokens_disk == 9 * BS
    llm.engine.kv.pool.check_integrity()
    closed(llm)


# ---- other processes ------------------------------------------------------------------------------

WORKER = r"""
import json, sys, torch
torch.set_num_threads(1)
from kvlab import LLM, SamplingParams
model, directory, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
prompts = json.loads(sys.argv[4])
llm = LLM(model, prompt_cache_dir=directory, max_num_batched_tokens=64, kv_memory_bytes=4 * 2**20)
params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
for r in range(rounds if rounds > 0 else 10**9):
    for i, p in enumerate(prompts):
        p = p if rounds > 0 else [(t + r) % 500 + 5 for t in p]  # forever: new prompts, new blocks
        out = llm.generate({"prompt_token_ids": p}, params)
        print(json.dumps([i, out.token_ids]), flush=True)
llm.engine.close()
"""


def worker(model, directory, rounds, prompts) -> subprocess.Popen:
    import json

    return subprocess.Popen([sys.executable, "-c", WORKER, str(model), str(directory), str(rounds), json.dumps(prompts)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def all_files_sound(model, directory) -> int:
    """Every block file under the directory passes the tier's checks; returns how many there are."""
    import torch

    llm = open_llm(model, directory)
    store = llm.engine.prompt_cache.store
    row = torch.empty(store.payload_len, dtype=torch.uint8)
    files = block_files(directory)
    for path in files:
        with open(path, "rb") as f:
            start = f.read(12 + 4096)
        import json as _json
        import struct

        (n,) = struct.unpack("<I", start[8:12])
        key = bytes.fromhex(_json.loads(start[12 : 12 + n])["key"])
        assert store.name(key) == path.name
        assert store.read_into(key, row), path
    closed(llm)
    return len(files)


def test_two_processes_sharing_a_dir(tiny_model, cold, tmp_path):
    procs = [worker(tiny_model, tmp_path, 2, [PROMPT, OTHER]) for _ in range(2)]
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        import json

        results = [json.loads(line) for line in stdout.splitlines()]
        assert len(results) == 4
        for i, tokens in results:
            assert tokens == cold["prompt" if i == 0 else "other"]
    assert all_files_sound(tiny_model, tmp_path) == 18
    assert not list(Path(tmp_path, VERSION_DIR, "tmp").iterdir())


def test_kill_9_while_writing_leaves_no_torn_file(tiny_model, cold, tmp_path):
    proc = worker(tiny_model, tmp_path, 0, [PROMPT])
    try:
        deadline = time.time() + 120
        while len(block_files(tmp_path)) < 30 and time.time() < deadline:
            time.sleep(0.05)
    finally:
        proc.kill()  # SIGKILL: no atexit, no flush
        proc.communicate()
    assert len(block_files(tmp_path)) >= 30
    assert all_files_sound(tiny_model, tmp_path) >= 30  # a file is whole or absent
    assert not [p for p in Path(tmp_path, VERSION_DIR, "tmp").iterdir() if f".{proc.pid}." in p.name]
    llm = open_llm(tiny_model, tmp_path)
    assert run(llm).token_ids == cold["prompt"]
    assert run(llm, OTHER).token_ids == cold["other"]
    closed(llm)


# ---- the commands ------------------------------------------------------------------------------------

LONG_TEXT = "The capital of France is Paris. " * 12


def kvlab(*argv, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "kvlab", *argv], input=stdin, capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip


def test_run_reuses_a_long_fixed_prefix_across_invocations(tiny_chat_model, tmp_path):
    import json

    flags = ["--max-tokens", "6", "--json", "--threads", "1", "--prompt-cache-dir", str(tmp_path)]
    first = kvlab("run", str(tiny_chat_model), LONG_TEXT, *flags)
    assert first.returncode == 0, first.stderr
    second = kvlab("run", str(tiny_chat_model), LONG_TEXT + "What is it?", *flags)  # the same start, more after
    assert second.returncode == 0, second.stderr
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["cached_prompt_tokens"] == 0
    n = len(a["prompt_token_ids"])
    common = next((i for i, (x, y) in enumerate(zip(a["prompt_token_ids"], b["prompt_token_ids"])) if x != y), n)
    assert b["cached_prompt_tokens_disk"] == b["cached_prompt_tokens"] == common // BS * BS > 0
    cold = kvlab("run", str(tiny_chat_model), LONG_TEXT + "What is it?", *flags[:-2], "--no-prefix-caching")
    assert json.loads(cold.stdout)["token_ids"] == b["token_ids"]
    report = kvlab("run", str(tiny_chat_model), LONG_TEXT, *flags[:2], "--threads", "1", *flags[-2:])
    assert report.returncode == 0, report.stderr
    assert re.search(r"reused +\d+ of \d+ prompt tokens from the prefix cache: 0 from memory, \d+ from disk",
                     report.stderr)  # fmt: skip


def test_chat_resumes_after_a_restart_prefilling_only_the_new_turn(tiny_chat_model, tmp_path):
    flags = ["chat", str(tiny_chat_model), "--max-tokens", "6", "--threads", "1", "--prompt-cache-dir", str(tmp_path)]
    first = kvlab(*flags, stdin=LONG_TEXT + "\n")
    assert first.returncode == 0, first.stderr
    second = kvlab(*flags, stdin="And Italy?\n")
    assert second.returncode == 0, second.stderr
    assert "resuming the conversation of 2 messages" in second.stderr
    report = re.search(r"\[prefilled (\d+) new tokens, (\d+) reused from the cache \((\d+) from disk\)", second.stderr)
    assert report, second.stderr
    prefilled, reused, disk = map(int, report.groups())
    assert disk == reused > 0
    # what is prefilled again: the new turn and at most the old conversation's last, partial block (not on
    # disk), plus the tokens where the answer's text re-tokenizes differently
    assert prefilled < reused
    import json

    kept = json.loads(Path(tmp_path, "conversations", Path(tiny_chat_model).name + ".json").read_text())
    assert [t["role"] for t in kept["turns"]] == ["user", "assistant", "user", "assistant"]
    assert kept["turns"][2]["content"] == "And Italy?"


def test_metrics_count_the_disk_tier(tiny_model, cold, tmp_path):
    from kvlab.server.metrics import render

    warm_dir(tiny_model, tmp_path)
    llm = open_llm(tiny_model, tmp_path)
    assert "kvlab_prompt_cache_disk" not in render(LLM(tiny_model, **OPTIONS).engine, "tiny")  # no tier, no lines
    assert run(llm).token_ids == cold["prompt"]
    assert run(llm, OTHER).token_ids == cold["other"]
    llm.engine.prompt_cache.flush()
    text = render(llm.engine, "tiny")
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("kvlab_prompt_cache_disk"))
    value = {name.split("{")[0]: float(v) for name, v in samples.items()}
    file_bytes = llm.engine.prompt_cache.store.file_bytes
    assert value["kvlab_prompt_cache_disk_hits_total"] == 9
    assert value["kvlab_prompt_cache_disk_read_bytes_total"] == 9 * file_bytes
    assert value["kvlab_prompt_cache_disk_written_bytes_total"] == 9 * file_bytes  # OTHER's blocks
    assert value["kvlab_prompt_cache_disk_tokens_total"] == 9 * BS
    assert value["kvlab_prompt_cache_disk_misses_total"] == 1  # OTHER: its first block was nowhere
    assert value["kvlab_prompt_cache_disk_bytes"] == 18 * file_bytes
    assert value["kvlab_prompt_cache_disk_evictions_total"] == 0 and value["kvlab_prompt_cache_disk_writable"] == 1
    closed(llm)


def test_a_slow_read_does_not_stall_other_requests(tiny_model, cold, tmp_path, monkeypatch):
    """While one request's blocks are being read (the read held back here), another decodes step by step."""
    import threading

    warm_dir(tiny_model, tmp_path)
    llm = open_llm(tiny_model, tmp_path)
    store = llm.engine.prompt_cache.store
    gate, read_into = threading.Event(), store.read_into
    monkeypatch.setattr(store, "read_into", lambda key, row: gate.wait(60) and read_into(key, row))
    engine = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected_other = LLM(tiny_model, enable_prefix_caching=False, **OPTIONS).generate(
        {"prompt_token_ids": OTHER}, params).token_ids  # fmt: skip
    from kvlab.output.result import RequestOutput

    other, held = (RequestOutput(prompt=None, prompt_token_ids=list(p)) for p in (OTHER, PROMPT))
    engine.add_request(list(OTHER), params, output=other)
    engine.add_request(list(PROMPT), PARAMS, output=held)
    assert engine.prompt_cache.num_held == 1 and engine.num_waiting == 2  # one in the scheduler, one held
    for _ in range(20):  # the read is stuck: the other request is prefilled and decodes meanwhile
        engine.step()
    assert len(other.token_ids) >= 10 and not held.token_ids
    assert engine.prompt_cache.num_held == 1
    gate.set()
    while engine.has_unfinished_requests:
        engine.step()
    assert other.token_ids == expected_other
    assert held.token_ids == cold["prompt"]
    assert held.metrics.cached_prompt_tokens_disk == 9 * BS
    engine.kv.pool.check_integrity()
    closed(llm)


def test_a_request_with_prompt_logprobs_writes_nothing(tiny_model, tmp_path):
    """Such a request is salted by its own id (every prompt token through the model): its blocks are never
    found again, so none is written."""
    llm = open_llm(tiny_model, tmp_path)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    assert len(out.prompt_logprobs) == len(PROMPT)
    closed(llm)
    assert block_files(tmp_path) == [] and llm.engine.prompt_cache.stats.misses == 0
