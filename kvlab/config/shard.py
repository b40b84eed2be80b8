"""What one rank of a tensor-parallel job holds of a model: its heads and MLP width (no torch).

    shard_config(config, 2)     # the description the rank's KV cache and `kvlab mem
                                #   --tensor-parallel-size 2` are sized from

Query heads are split in contiguous ranges; KV heads too, or, with fewer KV heads than ranks, each rank
keeps the one its query heads read (replicated, as vLLM does). kvlab/parallel/shard.py splits the
loaded model's layers the same way.
"""

from __future__ import annotations

import dataclasses

from kvlab.config.layers import MLA, Attention, DenseMLP, GatedDeltaNet, Mamba2, MoE
from kvlab.config.model import ModelConfig
from kvlab.errors import KvlabError


def kv_heads_per_rank(heads: int, kv_heads: int, world: int, name: str) -> tuple[int, int]:
    """(query heads, KV heads) one of `world` ranks holds; a KvlabError names the sizes that would work."""
    if heads % world:
        sizes = ", ".join(str(n) for n in range(1, heads + 1) if heads % n == 0)
        raise KvlabError(f"{name} has {heads} query heads, which {world} ranks cannot share equally: "
                         f"use a --tensor-parallel-size that divides {heads} ({sizes})")  # fmt: skip
    if kv_heads % world == 0:
        return heads // world, kv_heads // world
    if world % kv_heads == 0:
        return heads // world, 1  # fewer KV heads than ranks: each rank keeps the one its queries read
    raise KvlabError(f"{name}: {kv_heads} KV heads cannot be split or replicated over {world} ranks")


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """The description of what one of `world` ranks holds: its heads and MLP width (per-rank KV bytes)."""
    if world == 1:
        return config
    name = config.name or config.architecture

    def mixer(m):
        if isinstance(m, Attention):
            heads, kv_heads = kv_heads_per_rank(m.num_heads, m.kv_heads, world, name)
            return dataclasses.replace(m, num_heads=heads, kv_heads=kv_heads)
        if isinstance(m, MLA):  # one latent per token, read by every head: every rank keeps it whole
            return dataclasses.replace(m, num_heads=m.num_heads // world)
        if isinstance(m, GatedDeltaNet):
            return dataclasses.replace(m, num_key_heads=max(m.num_key_heads // world, 1),
                                       num_value_heads=m.num_value_heads // world)  # fmt: skip
        if isinstance(m, Mamba2):
            return dataclasses.replace(m, num_heads=m.num_heads // world, n_groups=max(m.n_groups // world, 1))
        return m

    def mlp(m):
        if isinstance(m, DenseMLP):
            if m.intermediate_size % world:
                raise KvlabError(f"{name}: an MLP of {m.intermediate_size} cannot be split over {world} ranks")
            return dataclasses.replace(m, intermediate_size=m.intermediate_size // world)
        if isinstance(m, MoE):  # every expert (and the shared one) split like an MLP; the router whole
            if m.expert_size % world or m.shared_size % world:
                raise KvlabError(f"{name}: experts of {m.expert_size} channels cannot be split over {world} ranks")
            return dataclasses.replace(m, expert_size=m.expert_size // world, shared_size=m.shared_size // world)
        return m

    layers = tuple(dataclasses.replace(layer, mixer=mixer(layer.mixer), mlp=mlp(layer.mlp)) for layer in config.layers)
    note = f"tensor parallel: what one of {world} ranks holds"
    return dataclasses.replace(config, layers=layers, notes=config.notes + (note,))
