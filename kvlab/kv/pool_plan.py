"""How big the KV pool is: from `--kv-memory` bytes, or a fraction of the memory free right now.

    bytes per token = what the cache class says one token costs (plain K and V: 2 × layers × kv heads
                      × head dim × bytes per number)
    bytes per block = bytes per token × block_size × layers per block ÷ layers (kv/layout.py: every
                      layer, or one KV group's layers when the model has sliding windows)
    blocks          = budget // bytes per block
    max concurrency = blocks ÷ blocks one sequence holds at max_model_len (sequences that fit at full
                      context; a sliding group holds only its window: kvlab mem's windowed figure)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.config import EngineConfig, ModelConfig
from kvlab.errors import KvlabError
from kvlab.kv.layout import KVLayout
from kvlab.kv.formats import KVFormats
from kvlab.kv.paged import PagedKVCache
from kvlab.kv.state_pool import StateShape, kv_config

DEFAULT_KV_FRACTION = 0.2  # of free memory, when --kv-memory is not given


@dataclass(frozen=True)
class KVPoolPlan:
    block_size: int
    bytes_per_token: int  # every layer, in the cache class's layout (scales included)
    num_blocks: int
    max_model_len: int  # tokens one sequence may hold
    source: str  # where the budget came from, in words
    layout: KVLayout  # which layers a block holds; sliding groups keep only their window
    bytes_per_block: int  # block_size tokens of one block's layers
    formats: KVFormats = None  # how keys and values are stored (floats, or quantized with their scales)
    state: StateShape | None = None  # a hybrid's per-sequence recurrent state (kv/state_pool.py), beside the blocks
    num_state_slots: int = 0  # sequences the state pool holds (max_num_seqs)
    max_num_seqs: int = 0  # requests running at once (EngineConfig.seats_for: the flag, or the default)

    @property
    def state_nbytes(self) -> int:
        """Bytes of the state pool: every slot's recurrent states."""
        return self.num_state_slots * self.state.bytes_per_sequence if self.state else 0

    @property
    def num_tokens(self) -> int:
        """Tokens of every layer the pool holds (as if no window released anything)."""
        return self.nbytes // self.bytes_per_token

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def blocks_per_sequence(self, context: int) -> int:
        """Blocks one sequence of `context` tokens holds between steps."""
        return self.layout.blocks_for_sequence(context, self.block_size)

    def max_concurrency(self, context: int) -> float:
        return self.num_blocks / self.blocks_per_sequence(context)


def free_memory_bytes(device: torch.device) -> int:
    """Memory available for new allocations: MemAvailable on a CPU, the free device memory on CUDA."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_kv_pool(
    config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device, cache_cls=PagedKVCache
) -> KVPoolPlan:
    """The pool's size for an EngineConfig `config` running `model` in `dtype` on `device`.

    Without an explicit byte count (`kv_memory_bytes`): `kv_memory_fraction` of free memory (default
    0.2), but no more than `max_num_seqs` sequences at full context need. Bytes per token are the cache
    class's own (`cache_cls.bytes_per_token_for`, the paged cache by default). The layout groups
    sliding-window layers apart (`config.windowed_kv`), so one sequence holds fewer blocks.
    """
    block_size, max_model_len = config.block_size, config.context_len(model)
    state = StateShape.of(model, dtype)  # a hybrid's recurrent layers: one state slot per sequence
    seats = config.seats_for(recurrent=state is not None)
    state_total = state.bytes_per_sequence * seats if state else 0
    model = kv_config(model)  # the layers whose K/V the blocks hold
    if block_size < 1:
        raise KvlabError(f"--block-size must be at least 1, got {block_size}")
    layout = KVLayout.for_model(model, windowed=config.windowed_kv)
    formats = KVFormats.resolve(config.kv_cache_dtype, config.cache_type_k, config.cache_type_v, dtype,
                                config.kv_rotation)
    per_token = cache_cls.bytes_per_token_for(model, dtype, formats)
    per_block = cache_cls.bytes_per_block_for(model, dtype, block_size, layout, formats)
    # a sequence at full context in its largest step: a sliding group's window plus a whole chunk
    peak = layout.peak_blocks(max_model_len, block_size, config.max_num_batched_tokens)
    if config.kv_memory_bytes is not None:
        budget, source = config.kv_memory_bytes - state_total, "--kv-memory" + (" less the state pool" if state else "")
    else:
        fraction = DEFAULT_KV_FRACTION if config.kv_memory_fraction is None else config.kv_memory_fraction
        if not 0 < fraction <= 1:
            raise KvlabError(f"--kv-memory-fraction must be in (0, 1], got {fraction}")
        free = free_memory_bytes(device)
        wanted = seats * peak * per_block
        budget = min(int(fraction * free), wanted + state_total) - state_total
        source = (f"min({fraction:g} × {free / 2**30:.1f} GiB free, {seats} sequences × "
                  f"{max_model_len} tokens)")  # fmt: skip
    num_blocks = max(budget, 0) // per_block
    if num_blocks < peak:
        states = (f" after {state_total / 2**20:.1f} MiB of recurrent state for {seats} sequences"
                  if state else "")  # fmt: skip
        raise KvlabError(
            f"the KV pool ({max(budget, 0) / 2**20:.1f} MiB = {num_blocks} blocks{states}) cannot hold one sequence "
            f"of {max_model_len} tokens ({peak} blocks of {per_block:,} bytes): give more --kv-memory "
            f"or a smaller --max-model-len" + (" or --max-num-seqs" if state else "")
        )
    return KVPoolPlan(block_size, per_token, num_blocks, max_model_len, source, layout, per_block, formats, state,
                      seats if state else 0, seats)  # fmt: skip
