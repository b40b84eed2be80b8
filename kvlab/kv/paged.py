"""The paged KV cache: one pool of fixed-size blocks per layer, read through block tables.

    k[layer]: [num_blocks, block_size, Hkv, D]   (v alike)      slot = block * block_size + offset

A step packs every scheduled token into one row ([1, N]: decodes first, then each prompt chunk), so
linear layers see all of them at once. Attention cannot be packed that way — each sequence has its
own keys — so `attend` splits the step into groups (`PagedMetadata.groups`):

    decodes      B sequences × 1 new token: their keys gathered through the block tables into
                 [B, Hkv, L, D] (L = the longest), a key mask for the shorter ones, one attention call
    prompt chunk 1 sequence × T new tokens after `start` cached ones: keys [1, Hkv, start + T, D],
                 causal mask offset by start

New keys and values are written first, through the slot mapping, so a group reads its own tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvlab.kv.cache import AttentionMetadata, KVCache
from kvlab.kv.manager import BlockZero


@dataclass
class AttentionGroup:
    """Sequences of one step that attend in one call: every decode (T = 1), or one prompt chunk (B = 1)."""

    lo: int  # first token of the group in the step's packed order
    hi: int  # one past its last
    block_tables: torch.Tensor  # [B, num_table_blocks] long; short tables padded (the padding is masked)
    num_keys: int  # L: keys of the longest sequence, this step's tokens included
    meta: AttentionMetadata  # positions [B, T]; attn_mask None, causal-after-start, or key padding

    @property
    def batch_size(self) -> int:
        return self.block_tables.shape[0]


@dataclass
class PagedMetadata:
    """A step's packed tokens: where each one sits, where its K/V is written, and who attends to what."""

    positions: torch.Tensor  # [1, N] long: absolute position of each packed token (its RoPE angle)
    slot_mapping: torch.Tensor  # [N] long: the slot each new token's K/V is written to
    groups: list[AttentionGroup]  # in packed order, covering tokens 0..N-1 once


class PagedKVCache(KVCache):
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # uninitialised: on a CPU the pages stay untouched (not resident) until a block is first used;
        # every block is zeroed when allocated (kv.manager.BlockZero)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_model(cls, config, num_blocks: int, block_size: int = 16, dtype=torch.float32, device="cpu"):
        return cls(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, dtype, device)

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the pool; each is indexed by block first, so a block operation touches all of them."""
        return self.k + self.v

    def bytes_per_token(self) -> int:
        """Bytes one token takes across all layers (K and V)."""
        return self.bytes_per_block() // self.block_size

    def bytes_per_block(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors())

    # ---- writes and reads -------------------------------------------------------------------------

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: PagedMetadata) -> None:
        """k, v [1, Hkv, N, D] of the step's packed tokens → their slots."""
        Hkv, D = self.num_kv_heads, self.head_dim
        self.k[layer].view(-1, Hkv, D).index_copy_(0, meta.slot_mapping, k[0].transpose(0, 1))
        self.v[layer].view(-1, Hkv, D).index_copy_(0, meta.slot_mapping, v[0].transpose(0, 1))

    def gather(self, layer: int, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """Every key and value of the group's sequences: [B, Hkv, L, D] each (padding past short ones)."""
        B, L, Hkv, D = group.batch_size, group.num_keys, self.num_kv_heads, self.head_dim
        blocks = group.block_tables.view(-1)
        # whole blocks as rows: index_select copies rows, several times faster than k[tables]
        k = self.k[layer].view(self.num_blocks, -1).index_select(0, blocks).view(B, -1, Hkv, D)  # [B, blocks·bs, Hkv, D]
        v = self.v[layer].view(self.num_blocks, -1).index_select(0, blocks).view(B, -1, Hkv, D)
        return k[:, :L].transpose(1, 2), v[:, :L].transpose(1, 2)

    def read(self, layer: int, meta: PagedMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of a step with a single group (see `attend` for the general case)."""
        if len(meta.groups) != 1:
            raise ValueError("a paged step with several attention groups is read group by group (attend)")
        return self.gather(layer, meta.groups[0])

    def attend(self, layer: int, q, k, v, meta: PagedMetadata, attention) -> torch.Tensor:
        """q [1, H, N, D], k, v [1, Hkv, N, D] packed → [1, H, N, D]: each group attends to its own keys."""
        self.write(layer, k, v, meta)
        outs = []
        for group in meta.groups:
            k_all, v_all = self.gather(layer, group)
            q_group = q[:, :, group.lo : group.hi]  # [1, H, T, D]
            if group.batch_size == 1:
                outs.append(attention(q_group, k_all, v_all, group.meta))
                continue
            q_batch = q_group[0].transpose(0, 1).unsqueeze(2)  # decodes: token i is sequence i → [B, H, 1, D]
            out = attention(q_batch, k_all, v_all, group.meta)  # [B, H, 1, D]
            outs.append(out.squeeze(2).transpose(0, 1).unsqueeze(0))  # back to [1, H, B, D]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def apply(self, ops: Iterable) -> None:
        """Do the KV manager's block operations (kv.manager.BlockZero, BlockCopy), in order, in every layer."""
        for op in ops:
            if isinstance(op, BlockZero):
                blocks = torch.tensor(op.block_ids, dtype=torch.long, device=self.device)
                for t in self.tensors():
                    t.index_fill_(0, blocks, 0)
            else:
                for t in self.tensors():
                    t[op.dst, : op.num_tokens] = t[op.src, : op.num_tokens]
