"""Prefix-cache keys: a full block is known by its tokens and by everything before it.

    hash(block i) = blake2b(hash(block i-1) ‖ token ids of block i)      (block 0 chains from ROOT)

Two sequences share the K/V of block i only if they agree on every token up to its end, which is
exactly what the chained hash says in 16 bytes. The hash is stable across processes (no Python
`hash()` randomisation), so tests can name blocks by it.

A request with a `cache_salt` chains its first block from `salted_root(salt)` instead of ROOT, so
its blocks are findable only by requests with the same salt (vLLM's `cache_salt`): tenants with
different salts never share K/V, nor learn from a hit what another tenant sent.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes
ROOT: BlockHash = b""  # the parent of a sequence's first block


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def salted_root(cache_salt: str | None) -> BlockHash:
    """The parent of a sequence's first block: ROOT unsalted, else a digest of the salt (never ROOT)."""
    if cache_salt is None:
        return ROOT
    return hashlib.blake2b(b"kvlab-cache-salt\0" + cache_salt.encode("utf-8"), digest_size=16).digest()


def hash_blocks(
    token_ids: Sequence[int], block_size: int, known: list[BlockHash], root: BlockHash = ROOT
) -> list[BlockHash]:
    """Extend `known` (hashes of the first blocks, chained from `root`) to every full block of `token_ids`."""
    for i in range(len(known), len(token_ids) // block_size):
        parent = known[i - 1] if i else root
        known.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size]))
    return known


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the cache and found there (first admissions only)."""

    queries: int = 0
    hits: int = 0
    requests: int = 0
    requests_with_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.queries += num_prompt_tokens
        self.hits += num_hit_tokens
        self.requests_with_hits += num_hit_tokens > 0
