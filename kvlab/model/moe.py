"""The mixture-of-experts MLP: a router picks top_k of E experts per token; their outputs, weighted by the
router, are summed (plus an always-on shared expert behind a sigmoid gate, Qwen2-MoE).

    MoEBlock(config, layer)     the layer's MLP when its config says MoE (config/layers.py)
      .router                   Linear [E, hidden] (+ bias, gpt-oss): logits → (weights [N, k], experts [N, k])
      .experts                  Experts: every expert's gate/up [E, 2I, hidden] and down [E, hidden, I]
      .shared_expert            SwiGLU of the shared width, or None
      .shared_expert_gate       Linear [1, hidden], or None

Tokens are grouped by expert (one sort), and each chosen expert multiplies all the rows that chose it
at once: a prompt's N tokens become at most E products, a decode step's B rows read each chosen expert's
weights once. Shapes: N tokens, k = top_k, E experts, I expert width.
"""

from __future__ import annotations

import torch
from torch import nn

from kvlab.config import ModelConfig, MoE
from kvlab.model.experts import Experts
from kvlab.model.layers import Linear, SwiGLU


def route(logits: torch.Tensor, moe: MoE) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] → (weights [N, k] in the logits' dtype, expert ids [N, k]), transformers' order.

    softmax_topk: softmax over all experts in float32, top-k, renormalised when `norm_topk_prob`;
    topk_softmax (gpt-oss): top-k of the logits, softmax over those k.
    """
    if moe.routing == "topk_softmax":
        top, ids = torch.topk(logits, moe.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


class MoEBlock(nn.Module):
    """Σ over the k chosen experts of weight · expert(x), plus sigmoid(gate(x)) · shared(x) where present."""

    def __init__(self, config: ModelConfig, moe: MoE):
        super().__init__()
        hidden = config.hidden_size
        self.moe = moe
        self.intermediate_size = moe.expert_size
        self.router = Linear(hidden, moe.num_experts, bias=moe.router_bias)
        self.experts = Experts(moe, hidden)
        self.shared_expert = SwiGLU(hidden, moe.shared_size) if moe.shared_size else None
        self.shared_expert_gate = Linear(hidden, 1) if moe.shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, hidden = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, hidden)  # [N, hidden]
        weights, ids = route(self.router(flat), self.moe)  # [N, k] each
        out = self.experts(flat, weights, ids)  # [N, hidden]
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view(*lead, hidden)
