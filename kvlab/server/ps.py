"""GET /api/ps: what this server holds, in the shape of ollama's /api/ps (read by `kvlab ps`).

ollama's fields (name, model, size, size_vram, context_length, details) with kvlab's own under
"kvlab": the weights and the KV pool in bytes, the pool's blocks, the device and threads, and the
requests in flight. Read live from the engine, as /metrics is; nothing here changes state.
"""

from __future__ import annotations

import time
from typing import Any


def ps_payload(llm, model_name: str, started: float) -> dict[str, Any]:
    """`started`: time.time() when the server began serving."""
    from kvlab.memory.weights import count_params
    from kvlab.show import short_count

    engine, loaded = llm.engine, llm.loaded
    counts = engine.kv.pool.counts()
    weights, kv_pool = loaded.weight_bytes, engine.cache.nbytes()
    device = engine.cache.device
    params = count_params(loaded.config)
    return {"models": [{
        "name": model_name,
        "model": model_name,
        "size": weights + kv_pool,
        "size_vram": weights + kv_pool if device.type == "cuda" else 0,
        "context_length": engine.max_model_len,
        "details": {
            "format": "gguf" if loaded.path.suffix == ".gguf" else "safetensors",
            "family": loaded.config.architecture,
            "parameter_size": short_count(params.total) if params else "",
            "quantization_level": loaded.weight_format,
        },
        "kvlab": {
            "file": loaded.path.name,  # never the absolute path: a client learns nothing of the server's disk
            "device": str(device),
            "dtype": str(loaded.model.dtype).removeprefix("torch."),
            "threads": llm.policy.threads,
            "weight_bytes": weights,
            "kv_pool_bytes": kv_pool,
            "kv_blocks_total": counts.total,
            "kv_blocks_used": counts.used,
            "kv_blocks_cached": counts.cached,
            "block_size": engine.kv.block_size,
            "vocab_size": loaded.config.vocab_size,  # token ids it accepts (kvlab bench serve draws prompts from them)
            "requests_running": engine.num_running,
            "requests_waiting": engine.num_waiting,
            "uptime_s": round(time.time() - started, 1),
        },
    }]}  # fmt: skip

