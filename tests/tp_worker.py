"""Run by torchrun in tests/test_tensor_parallel.py: one rank's view of a model served tensor-parallel.

    torchrun --nproc-per-node N tests/tp_worker.py MODEL_DIR OUT.json [--kv-tokens N] [--die-after-steps K]

Rank 0 writes its last-position logits, the greedy and seeded tokens of a batch (prompts of different
lengths, a shared prefix, a KV pool small enough to preempt), and each rank's KV bytes per token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine
from kvlab.kv.cache import ContiguousKVCache
from kvlab.kv.paged import PagedKVCache
from kvlab.model.loader import load_model
from kvlab.parallel import shard_model, tensor_parallel
from kvlab.runner.driver import ModelDriver
from kvlab.sampling import SamplingParams


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    batch = [torch.randint(5, 400, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (6,), generator=g)]
    return batch + [batch[0] + [11, 12, 13, 14]]  # the last one finds the first one's blocks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--kv-tokens", type=int, default=4096, help="the KV pool's size in tokens, on every rank")
    ap.add_argument("--die-after-steps", type=int, help="rank 1 exits abruptly after this many steps")
    ap.add_argument("--hang-after-steps", type=int, help="rank 1 stops answering after this many steps")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--prompts", help="a JSON list of prompts (token ids): 64 greedy tokens each, in one batch")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    group = tensor_parallel(world, timeout_s=args.timeout)
    loaded = shard_model(load_model(args.model), group)
    ids = torch.randint(5, 400, (1, 30), generator=torch.Generator().manual_seed(0))
    logits = ModelDriver(loaded.model).run(ids, ContiguousKVCache.for_model(loaded.config, 64))
    kv_bytes = args.kv_tokens * PagedKVCache.bytes_per_token_for(loaded.config, loaded.model.dtype)
    config = EngineConfig(max_model_len=256 if args.prompts else 128, max_num_batched_tokens=24, kv_memory_bytes=kv_bytes, max_num_seqs=8)
    engine = LLMEngine(loaded, None, config)
    if args.prompts:  # a real model's prompts
        greedy = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        rids = [engine.add_request(p, greedy) for p in json.loads(Path(args.prompts).read_text())]
    else:
        rids = [engine.add_request(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)) for p in prompts()]
        rids.append(engine.add_request(prompts()[1], SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True)))
        rids.append(engine.add_request(prompts()[2], SamplingParams(max_tokens=12, temperature=0.9, ignore_eos=True)))
    done, steps = {}, 0
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output.token_ids
        steps += 1
        if args.die_after_steps and group.rank == 1 and steps == args.die_after_steps:
            os._exit(17)  # a rank that dies mid-job, without a word
        if args.hang_after_steps and group.rank == 1 and steps == args.hang_after_steps:
            time.sleep(3600)  # a rank alive but stuck: the others' next collective must give up
    engine.kv.pool.check_integrity()
    result = {
        "logits": logits[0].tolist(),
        "tokens": [done[r] for r in rids],
        "kv_bytes_per_token": engine.pool_plan.bytes_per_token,
        "preemptions": engine.scheduler.num_preemptions,
        "prefix_hit_tokens": engine.kv.stats.hits,
        "decode_path": [engine.decode_path.name, engine.decode_path.reason],
    }
    results = [None] * group.world_size
    if group.world_size > 1:
        import torch.distributed as dist

        dist.all_gather_object(results, result)
    else:
        results = [result]
    if group.rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
