"""The memory calculator behind `kvlab mem`: KV cache, recurrent states and weights, layer by layer.

    from kvlab.memory import load_config, kv_bytes_per_token, kv_bytes, state_bytes
    spec = load_config("qwen3-0.6b")          # bundled name, config.json, HF dir, .gguf, registry name, dict
    kv_bytes_per_token(spec, "bfloat16")     # 114,688
    kv_bytes(spec, context=512, batch=1)     # 58,720,256 bytes = 29,360,128 numbers x 2

No module of kvlab.memory imports torch; gguf and matplotlib are imported only when a GGUF file or a plot
needs them.
"""

from kvlab.memory.fit import MemoryReport, estimate, max_batch, max_context
from kvlab.memory.kv import (
    breakdown, kv_bytes, kv_bytes_per_token, numbers_per_token, state_bytes, state_numbers,
    window_bytes_per_token,
)
from kvlab.memory.pairs import pairs_with_cache, pairs_without_cache
from kvlab.config import bundled_names, load_config
from kvlab.config import MLA, Attention, GatedDeltaNet, Layer, Mamba2, ModelConfig
from kvlab.memory.weights import count_params, params_bytes, weight_bytes

__all__ = [
    "Attention", "GatedDeltaNet", "Layer", "MLA", "Mamba2", "MemoryReport", "ModelConfig",
    "breakdown", "bundled_names", "count_params", "estimate", "kv_bytes", "kv_bytes_per_token",
    "load_config", "max_batch", "max_context", "numbers_per_token", "pairs_with_cache",
    "pairs_without_cache", "params_bytes", "state_bytes", "state_numbers", "weight_bytes",
    "window_bytes_per_token",
]
