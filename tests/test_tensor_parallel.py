"""Tensor parallelism over gloo, 2 processes on this machine, tiny random models: the same answers as one.

Each case launches `torchrun --nproc-per-node N tests/tp_worker.py`: last-position logits within 1e-5,
the same greedy and seeded tokens for a batch with a prefix hit and preemption, each rank's KV bytes
per token as the calculator says for what one rank holds, and a rank that dies ending the job clearly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab.config import load_config
from kvlab.errors import KvlabError
from kvlab.memory import kv_bytes_per_token, window_bytes_per_token
from kvlab.parallel import shard_config
from tiny import build_tiny
from tiny_moe import MOE_ARCHS, build_tiny_moe

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("tp_worker.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")


def launch(directory: Path, world: int, out: Path, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    cmd = [str(TORCHRUN), "--nproc-per-node", str(world), "--master-port", str(29500 + os.getpid() % 1000),
           str(WORKER), str(directory), str(out), *extra]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "qwen2_moe", "gpt_oss"])
def runs(request, tmp_path_factory):
    """Dense models, and mixtures of experts: Qwen2-MoE (a gated shared expert, a dense layer), gpt-oss
    (expert biases, sinks, sliding layers): every expert split over the ranks, the router whole."""
    if request.param in MOE_ARCHS:
        directory = build_tiny_moe(request.param, tmp_path_factory.mktemp(request.param))
    else:
        directory = build_tiny(request.param, tmp_path_factory.mktemp(request.param))
    out = {}
    for world in (1, 2):
        path = directory / f"tp{world}.json"
        done = launch(directory, world, path, "--kv-tokens", "192")  # small: some requests are preempted
        assert done.returncode == 0, done.stderr[-3000:]
        out[world] = json.loads(path.read_text())
    return request.param, directory, out


def test_logits_and_tokens_are_those_of_one_process(runs):
    kind, _, out = runs
    one, two = out[1][0], out[2][0]
    assert max(abs(a - b) for a, b in zip(one["logits"], two["logits"])) <= 1e-5 * max(map(abs, one["logits"]))
    assert two["tokens"][:-1] == one["tokens"][:-1], kind  # greedy and seeded: as one process draws them
    # the last request samples without a seed: random from run to run, but the same on every rank
    assert out[2][1]["tokens"] == two["tokens"]
    assert two["preemptions"] > 0 and two["prefix_hit_tokens"] > 0  # the batch exercised both
    # each rank's shard runs the C decode step, its all-reduces inside it (shared memory, one host)
    assert [rank["decode_path"] for rank in out[2]] == [["cpu-c", None]] * 2 == [one["decode_path"]] * 2


def test_every_rank_holds_the_calculators_share_of_the_kv_cache(runs):
    _, directory, out = runs
    config = load_config(directory)
    for world in (1, 2):
        local = shard_config(config, world)  # every layer's share (the pool holds sliding layers' blocks too)
        expected = kv_bytes_per_token(local, "float32") + window_bytes_per_token(local, "float32")
        assert [r["kv_bytes_per_token"] for r in out[world]] == [expected] * world
    assert out[2][0]["kv_bytes_per_token"] * 2 == out[1][0]["kv_bytes_per_token"]


def test_query_heads_that_do_not_divide_are_refused_with_the_sizes_that_would():
    config = load_config({"model_type": "llama", "vocab_size": 100, "hidden_size": 576, "intermediate_size": 1536,
                          "num_hidden_layers": 2, "num_attention_heads": 9, "num_key_value_heads": 3,
                          "max_position_embeddings": 2048})  # fmt: skip
    with pytest.raises(KvlabError, match=r"9 query heads.*\(1, 3, 9\)"):
        shard_config(config, 2)
    assert shard_config(config, 3).num_kv_heads == 1


def test_kv_heads_fewer_than_ranks_are_replicated():
    config = load_config({"model_type": "qwen2", "vocab_size": 100, "hidden_size": 256, "intermediate_size": 512,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
                          "max_position_embeddings": 2048})  # fmt: skip
    local = shard_config(config, 2)
    assert (local.num_heads, local.num_kv_heads) == (2, 1)  # each rank keeps the one KV head
    assert kv_bytes_per_token(local, "float32") == kv_bytes_per_token(config, "float32")


def test_a_rank_that_dies_ends_the_job_with_a_clear_error(tmp_path):
    directory = build_tiny("qwen2", tmp_path / "m")
    done = launch(directory, 2, tmp_path / "out.json", "--die-after-steps", "3", "--timeout", "20", timeout=120)
    assert done.returncode != 0
    assert not (tmp_path / "out.json").exists()
    assert "exitcode  : 17" in done.stderr or "exit code 17" in done.stderr.lower() or "17" in done.stderr


def test_a_rank_that_stops_answering_ends_the_job_within_its_timeout(tmp_path):
    directory = build_tiny("qwen2", tmp_path / "m")
    done = launch(directory, 2, tmp_path / "out.json", "--hang-after-steps", "3", "--timeout", "8", timeout=120)
    assert done.returncode != 0 and not (tmp_path / "out.json").exists()
    assert "stopped answering within 8 s" in done.stderr


@pytest.mark.real
def test_qwen_coder_at_two_ranks_gives_the_tokens_of_one(real_model, tmp_path):
    """The real Qwen2.5-Coder-0.5B (14 query, 2 KV heads; Q5_0/Q6_K/Q4_K/Q8_0 blocks split at block
    boundaries or expanded): 64 greedy tokens on the raw and chat prompts, world 2 against world 1."""
    from kvlab.tokenizer import Tokenizer
    from test_real import CHATS, RAW_PROMPTS

    path = real_model("qwen2.5-coder-0.5b")
    tok = Tokenizer.load(path)
    ids = [tok.encode(p) for p in RAW_PROMPTS] + [tok.encode_chat(m, add_generation_prompt=True) for m in CHATS]
    (tmp_path / "prompts.json").write_text(json.dumps(ids))
    tokens = {}
    for world in (1, 2):
        out = tmp_path / f"tp{world}.json"
        done = launch(path, world, out, "--prompts", str(tmp_path / "prompts.json"), timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        tokens[world] = json.loads(out.read_text())[0]["tokens"]
    assert tokens[2] == tokens[1]
