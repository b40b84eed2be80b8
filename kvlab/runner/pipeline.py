"""build_pipeline: the device side of a step, made one way for the engine's target model and a draft model.

    pipe = build_pipeline(loaded, EngineConfig(...), policy, sampler)
    pipe.pool_plan    the KV pool's size and formats (kv/pool_plan.py)
    pipe.cache        the paged KV cache those blocks live in (kv/paged.py)
    pipe.kv           the block manager over them: tables, prefix cache, ref counts (kv/manager.py)
    pipe.runner       the plan as tensors, the forward, sampling and verification (model_runner.py)

The engine holds one; a draft model (spec_decode/draft_model.py) holds another, built from the target's
EngineConfig so that it stores K and V in the same formats (or says in one line why it cannot).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvlab.config import EngineConfig
from kvlab.errors import KvlabError
from kvlab.kernels import ThreadPolicy
from kvlab.kv.manager import KVCacheManager
from kvlab.kv.paged import PagedKVCache
from kvlab.kv.pool_plan import KVPoolPlan, plan_kv_pool
from kvlab.kv.state_pool import StatePool, kv_config
from kvlab.kv.state_slots import HybridKVCacheManager, StateSlots
from kvlab.runner.model_runner import ModelRunner
from kvlab.sampling.sampler import BatchSampler


logger = logging.getLogger(__name__)


@dataclass
class Pipeline:
    pool_plan: KVPoolPlan
    cache: PagedKVCache
    kv: KVCacheManager
    runner: ModelRunner


def build_pipeline(loaded, config: EngineConfig, policy: ThreadPolicy | None = None,
                   sampler: BatchSampler | None = None, prefix_caching: bool | None = None) -> Pipeline:  # fmt: skip
    """The KV pool, cache, block manager and runner of `loaded` under `config` (`prefix_caching`: the
    config's, unless given)."""
    model, model_config = loaded.model, loaded.config
    plan = plan_kv_pool(config, model_config, model.dtype, model.device)
    if model.rotary.cos.shape[0] < plan.max_model_len:
        raise KvlabError(f"the model was loaded with rotary tables for {model.rotary.cos.shape[0]} positions, "
                         f"fewer than max_model_len {plan.max_model_len}: load it with max_positions")  # fmt: skip
    cache = PagedKVCache.for_model(kv_config(model_config), plan.num_blocks, config.block_size, model.dtype,
                                   model.device, plan.layout, plan.formats)  # fmt: skip
    caching = config.enable_prefix_caching and config.use_cache if prefix_caching is None else prefix_caching
    if plan.state is not None:  # a hybrid: a state slot per sequence beside its blocks (kv/state_slots.py)
        slots = StateSlots(plan.num_state_slots)
        cache.states = StatePool(plan.state, slots, model.device)
        kv = HybridKVCacheManager(plan.num_blocks, config.block_size, slots, plan.layout)
        if caching:
            logger.info("prefix caching is off for %s: its recurrent state cannot be restored from attention "
                        "blocks", model_config.name or model_config.architecture)  # fmt: skip
    else:
        kv = KVCacheManager(plan.num_blocks, config.block_size, caching, plan.layout)
    runner = ModelRunner(model, cache, pack_prompts=config.pack_prompts, policy=policy, sampler=sampler)
    return Pipeline(plan, cache, kv, runner)
