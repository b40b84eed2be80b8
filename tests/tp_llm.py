"""Run by torchrun in tests/test_tp_launch.py: the offline API at N ranks, every rank the same script.

    torchrun --nproc-per-node N tests/tp_llm.py MODEL_DIR OUT_DIR

Each rank writes OUT_DIR/rank{R}.json: the token ids and text of a batch of greedy, seeded and unseeded
requests, its KV bytes per token and weight bytes (its own shard's).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from kvlab import LLM, SamplingParams

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time", "The capital of France is a city"]


def main() -> int:
    model, out = sys.argv[1], Path(sys.argv[2])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    llm = LLM(model, threads=1, max_model_len=128, kv_memory_bytes=256 * 1024, max_num_batched_tokens=16,
              tensor_parallel_size=world)  # fmt: skip
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)
    unseeded = SamplingParams(max_tokens=12, temperature=0.9, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy) + [llm.generate(PROMPTS[0], seeded), llm.generate(PROMPTS[1], unseeded)]
    result = {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "text": [o.text for o in outs],
        "kv_bytes_per_token": llm.engine.pool_plan.bytes_per_token,
        "weight_bytes": llm.loaded.weight_bytes,
        "prefix_hit_tokens": llm.engine.kv.stats.hits,
    }
    (out / f"rank{llm.group.rank}.json").write_text(json.dumps(result))
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
