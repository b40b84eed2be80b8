"""The layers tensor parallelism adds around a model's own: each wraps the rank's shard of a layer.

    RowParallel              y = Σ over ranks of (x's shard · W's column shard): an all-reduce after
                             the inner layer (o_proj, down_proj, or a mixture of experts whose every
                             expert holds the rank's share of its channels)
    VocabParallelEmbedding   each rank holds a range of the vocabulary's rows; a token outside it looks
                             up zeros, and an all-reduce puts every row together
    VocabParallelHead        each rank computes its vocabulary range's logits; an all-gather joins them

Column-parallel layers (q/k/v, gate/up) need no wrapper: they are the model's own Linear or
PackedLinear with fewer output rows. The wrappers report the inner layer's costs (`bytes_read_per_token`,
`macs_per_token`) and hold no weights of their own, so the model's byte counts see each shard once.
"""

from __future__ import annotations

import torch
from torch import nn

from kvlab.parallel.group import TPGroup


class RowParallel(nn.Module):
    def __init__(self, inner: nn.Module, group: TPGroup):
        super().__init__()
        self.inner, self.group = inner, group
        if hasattr(inner, "experts"):  # a mixture of experts (kvlab.model.moe): hidden in, hidden out
            self.in_features = self.out_features = inner.experts.hidden
        else:
            self.in_features, self.out_features = inner.in_features, inner.out_features
        self.parts = (self.out_features,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x))

    def bytes_read_per_token(self) -> int:
        return 0  # the inner layer reports its own bytes

    @property
    def macs_per_token(self) -> int:
        return 0


class VocabParallelEmbedding(nn.Module):
    def __init__(self, inner: nn.Module, start: int, rows: int, group: TPGroup):
        super().__init__()
        self.inner, self.start, self.rows, self.group = inner, start, rows, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        out = self.inner(local.clamp(0, self.rows - 1))  # [..., E]
        out = out * mine.unsqueeze(-1).to(out.dtype)  # others' tokens: exact zeros, so the sum is exact
        return self.group.all_reduce(out.contiguous())

    def bytes_read_per_token(self) -> int:
        return self.inner.bytes_read_per_token()


class VocabParallelHead(nn.Module):
    def __init__(self, inner: nn.Module, vocab_size: int, group: TPGroup):
        super().__init__()
        self.inner, self.vocab_size, self.group = inner, vocab_size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(self.inner(x), dim=-1)[..., : self.vocab_size]  # the last shard is padded

    def bytes_read_per_token(self) -> int:
        return 0

    @property
    def macs_per_token(self) -> int:
        return self.inner.macs_per_token
