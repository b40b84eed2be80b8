"""The mixture-of-experts MLP: a router picks top_k of E experts per token; their outputs, weighted by the
router, are summed (plus an always-on shared expert behind a sigmoid gate, Qwen2-MoE).

    MoEBlock(config, layer)     the layer's MLP when its config says MoE (config/layers.py)
      .router                   Linear [E, hidden] (+ bias, gpt-oss): logits → (weights [N, k], experts [N, k])
      .experts                  Experts: every expert's gate/up [E, 2I, hidden] and down [E, hidden, I]
      .shared_expert            SwiGLU of the shared width, or None
      .shared_expert_gate       Linear [1, hidden], or None (DeepSeek's shared experts are ungated)
      .score_bias               [E] routing correction bias (DeepSeek-V3), or None

Tokens are grouped by expert (one sort), and each chosen expert multiplies all the rows that chose it
at once: a prompt's N tokens become at most E products, a decode step's B rows read each chosen expert's
weights once. Shapes: N tokens, k = top_k, E experts, I expert width.
"""

from __future__ import annotations

import torch
from torch import nn

from kvlab.config import ModelConfig, MoE
from kvlab.model.experts import Experts
from kvlab.model.layers import Linear, SwiGLU, Vector


def route(logits: torch.Tensor, moe: MoE, score_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] → (weights [N, k] in the logits' dtype, expert ids [N, k]), transformers' order.

    softmax_topk: softmax over all experts in float32, top-k, renormalised when `norm_topk_prob`;
    topk_softmax (gpt-oss): top-k of the logits, softmax over those k;
    sigmoid_topk (DeepSeek-V3): see `sigmoid_route`.
    """
    if moe.routing == "sigmoid_topk":
        return sigmoid_route(logits, moe, score_bias)
    if moe.routing == "topk_softmax":
        top, ids = torch.topk(logits, moe.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


def sigmoid_route(logits: torch.Tensor, moe: MoE, score_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: scores = sigmoid(logits) in float32; experts are chosen by scores + score_bias [E] (the
    bias only chooses, it never weighs), first keeping the `top_k_groups` groups whose two best choice scores
    sum highest; the chosen scores, renormalised when `norm_topk_prob`, times `routed_scaling_factor`."""
    scores = torch.sigmoid(logits.float())  # [N, E]
    choice = scores if score_bias is None else scores + score_bias.float()
    if moe.num_groups > 1:
        N, G = choice.shape[0], moe.num_groups
        best_two = choice.view(N, G, -1).topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        kept = torch.topk(best_two, moe.top_k_groups, dim=-1).indices  # [N, top_k_groups]
        in_kept = torch.zeros_like(best_two, dtype=torch.bool).scatter_(1, kept, True)  # [N, G]
        choice = choice.masked_fill(~in_kept.repeat_interleave(choice.shape[1] // G, dim=1), float("-inf"))
    ids = torch.topk(choice, moe.top_k, dim=-1).indices  # [N, k]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * moe.routed_scaling_factor).to(logits.dtype), ids


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
        # DeepSeek-V3's routing correction bias [E] (e_score_correction_bias): it only chooses experts
        self.score_bias = Vector(moe.num_experts) if moe.score_bias else None

    def _router_logits(self, flat: torch.Tensor) -> torch.Tensor:
        """[N, E]; DeepSeek-V3's sigmoid router runs in float32, as transformers runs it (16-bit logits would
        turn near-equal scores into ties), from the weights as loaded."""
        weight = getattr(self.router, "weight", None)
        if self.moe.routing != "sigmoid_topk" or weight is None or flat.dtype == torch.float32:
            return self.router(flat)
        return torch.nn.functional.linear(flat.float(), weight.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, hidden = x.shape[:-1], x.shape[-1]
        flat = x.reshape(-1, hidden)  # [N, hidden]
        bias = None if self.score_bias is None else self.score_bias.weight
        weights, ids = route(self._router_logits(flat), self.moe, bias)  # [N, k] each
        out = self.experts(flat, weights, ids)  # [N, hidden]
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view(*lead, hidden)
