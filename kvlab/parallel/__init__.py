"""Tensor parallelism on torch.distributed: a model's layers split over the ranks of a torchrun job.

    torchrun --nproc-per-node 2 -m kvlab run MODEL "prompt" --tensor-parallel-size 2
    torchrun --nproc-per-node 2 -m kvlab serve MODEL --tensor-parallel-size 2

group.py (the ranks and their collectives, with deadlines), shard.py (the transform of a loaded model,
and what one rank holds), layers.py (the all-reduce and vocabulary wrappers), spmd.py (every rank
runs the same schedule; rank 0 decides what comes in).
"""

from __future__ import annotations

import dataclasses
import random

import torch

from kvlab.parallel.group import RankFailed, TPGroup, collective_timeout_s, launch_rank
from kvlab.parallel.shard import shard_config, shard_model
from kvlab.parallel.spmd import SpmdEngine

__all__ = ["RankFailed", "SpmdEngine", "TPGroup", "agree_engine_config", "launch_rank", "shard_config", "shard_model",
           "tensor_parallel"]


def tensor_parallel(tensor_parallel_size: int, device="cpu", timeout_s: float | None = None) -> TPGroup:
    """This process's group (a world of one without torchrun), with PyTorch's global random generator
    seeded alike on every rank: unseeded draws then agree, since every rank draws in the same order.
    `timeout_s`: every collective's deadline (default: $KVLAB_TP_TIMEOUT_S, else 60 s)."""
    group = TPGroup.from_environment(tensor_parallel_size, device, timeout_s or collective_timeout_s())
    if group.world_size > 1:
        torch.manual_seed(group.broadcast(random.SystemRandom().randrange(2**63)))
    return group


def agree_engine_config(config, loaded, group: TPGroup):
    """`config` with the KV pool every rank can hold (the smallest of their plans, in bytes): the ranks'
    schedules, preemptions included, stay the same only if their pools have the same number of blocks."""
    from kvlab.kv.pool_plan import plan_kv_pool

    plan = plan_kv_pool(config, loaded.config, loaded.model.dtype, loaded.model.device)
    return dataclasses.replace(config, kv_memory_bytes=group.smallest(plan.nbytes))
