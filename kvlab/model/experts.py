"""The routed experts of one MoE layer: E gated MLPs stored as stacked matrices, run grouped by expert.

    gate_up  [E, 2I, hidden]  each expert's gate rows, then its up rows (float), or per part the file's
                              blocks [E, I, row bytes] (GGUF's ffn_gate_exps / ffn_up_exps, kept packed)
    down     [E, hidden, I]   (float), or blocks [E, hidden, row bytes] (ffn_down_exps)
    gate_up_bias [E, 2I], down_bias [E, hidden]   gpt-oss only

A token's pass reads only the experts it chose: `bytes_read_per_token` is top_k of E experts' bytes,
and the forward multiplies each chosen expert once with every row that chose it (the C kernels when
the rows are decode-sized or a few chunks of that, BLAS otherwise), never touching an expert nobody
chose, so a memory-mapped file's unused experts stay on disk. On a CPU, experts in blocks the C kernels
read run as one C call (kernels/moe_prefill.py: every chosen expert's tiles of rows as one job of the
pool); elsewhere `forward_by_expert` runs them expert by expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.config import MoE
from kvlab.backends.ops import current_ops
from kvlab.kernels import current, moe_prefill
from kvlab.quant.linear import PackedTensor, packed_product



def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Expert ids [N, k] → (order [N·k]: flat (token, slot) indices sorted by expert, stably; token of each
    [N·k]; counts [E]: how many of them each expert has). Expert e's rows are order[start_e : start_e + count_e]."""
    flat = ids.reshape(-1)  # [N·k]
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, order // ids.shape[1], counts


def expert_activation(moe: MoE):
    """gate [n, I], up [n, I] → act(gate) · up for the experts' activation."""
    if moe.activation == "clamped_swiglu":
        limit, alpha = moe.swiglu_limit, moe.swiglu_alpha

        def clamped(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            gate = gate.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
            return (up + 1) * (gate * torch.sigmoid(gate * alpha))

        return clamped
    return lambda gate, up: F.silu(gate) * up


class Experts(nn.Module):
    """E experts' matrices; forward(x [N, hidden], weights [N, k], ids [N, k]) → Σ weight · expert(x) [N, hidden]."""

    def __init__(self, moe: MoE, hidden: int):
        super().__init__()
        E, I = moe.num_experts, moe.expert_size
        self.num_experts, self.top_k, self.hidden, self.expert_size = E, moe.top_k, hidden, I
        self.act = expert_activation(moe)
        self.activation, self.swiglu = moe.activation, (moe.swiglu_limit, moe.swiglu_alpha)  # as moe.c reads them
        self.gate_up = nn.Parameter(torch.empty(E, 2 * I, hidden), requires_grad=False)
        self.down = nn.Parameter(torch.empty(E, hidden, I), requires_grad=False)
        self.gate_up_bias = nn.Parameter(torch.empty(E, 2 * I), requires_grad=False) if moe.expert_bias else None
        self.down_bias = nn.Parameter(torch.empty(E, hidden), requires_grad=False) if moe.expert_bias else None
        self.formats: dict[str, list[str]] = {}  # "gate_up" / "down" → the block format of each part, when packed
        self._shapes: dict[str, list[tuple[int, int]]] = {}  # ... and each part's [rows, in] per expert

    # ---- packed (GGUF blocks) -------------------------------------------------------------------------

    def set_packed(self, name: str, parts: list[PackedTensor]) -> None:
        """Keep `name` ("gate_up" or "down") as the file's blocks: parts of shape [E, rows, in], data
        uint8 [E, rows, row bytes] (gate_up: the gate part, then the up part)."""
        delattr(self, name)
        for i, p in enumerate(parts):
            self.register_buffer(f"{name}_{i}", p.data, persistent=False)
        self.formats[name] = [p.fmt for p in parts]
        self._shapes[name] = [tuple(p.shape[1:]) for p in parts]

    def expert_parts(self, name: str, e: int) -> list[PackedTensor]:
        """Expert e's matrices of a packed `name`, as 2-D PackedTensors (views into the stacked blocks)."""
        return [PackedTensor(fmt, shape, getattr(self, f"{name}_{i}")[e])
                for i, (fmt, shape) in enumerate(zip(self.formats[name], self._shapes[name]))]  # fmt: skip

    def part_shape(self, name: str, i: int) -> tuple[int, int]:
        """[rows, in] of one expert's part i of a packed `name` (its bytes may be interleaved: "<fmt>x16")."""
        return self._shapes[name][i]

    def _product(self, name: str, e: int, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [n, in] times expert e's `name` matrix (+ its bias) → [n, out]."""
        if name not in self.formats:
            return current_ops().linear(x, getattr(self, name)[e], None if bias is None else bias[e])
        parts, rows = self.expert_parts(name, e), current().max_kernel_rows
        if current_ops().chunked_experts(x.shape[0], self.formats[name]):  # a prompt's rows, in decode-sized chunks
            y = torch.cat([packed_product(x[i : i + rows], parts) for i in range(0, x.shape[0], rows)])
        else:
            y = packed_product(x, parts)  # float32 [n, out]
        if bias is not None:
            y = y + bias[e].to(y.dtype)
        return y.to(x.dtype)

    def shard(self, lo: int, hi: int, keep_down_bias: bool = True) -> None:
        """Keep channels [lo, hi) of every expert (a tensor-parallel rank's share): their gate and up rows
        and the matching down columns, which must start and end on the down blocks' boundaries; the down
        bias zeroed unless `keep_down_bias` (the ranks' outputs are summed: one of them adds it)."""
        from kvlab.quant.formats import FORMATS

        I = self.expert_size
        if "gate_up" in self.formats:
            for i in range(len(self.formats["gate_up"])):
                setattr(self, f"gate_up_{i}", getattr(self, f"gate_up_{i}")[:, lo:hi].contiguous())
            self._shapes["gate_up"] = [(hi - lo, shape[1]) for shape in self._shapes["gate_up"]]
        else:
            w = self.gate_up.detach()
            self.gate_up = nn.Parameter(torch.cat([w[:, lo:hi], w[:, I + lo : I + hi]], dim=1), requires_grad=False)
        if "down" in self.formats:
            for i, fmt in enumerate(self.formats["down"]):
                f = FORMATS[fmt]
                start, end = lo // f.block_values * f.block_bytes, hi // f.block_values * f.block_bytes
                setattr(self, f"down_{i}", getattr(self, f"down_{i}")[:, :, start:end].contiguous())
            self._shapes["down"] = [(shape[0], hi - lo) for shape in self._shapes["down"]]
        else:
            self.down = nn.Parameter(self.down.detach()[:, :, lo:hi].contiguous(), requires_grad=False)
        if self.gate_up_bias is not None:
            b = self.gate_up_bias.detach()
            self.gate_up_bias = nn.Parameter(torch.cat([b[:, lo:hi], b[:, I + lo : I + hi]], dim=1), requires_grad=False)
        if self.down_bias is not None and not keep_down_bias:
            self.down_bias = nn.Parameter(torch.zeros_like(self.down_bias), requires_grad=False)
        self.expert_size = hi - lo

    # ---- the forward ------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        desc = self._c_description(x, weights)
        if desc is not None:
            return moe_prefill.experts(desc, x, weights, ids)
        return self.forward_by_expert(x, weights, ids)

    def _c_description(self, x: torch.Tensor, weights: torch.Tensor):
        """moe.c's description of these experts when one C call takes this forward (float32 rows on a CPU,
        both matrices in blocks the kernels read at this many rows), else None."""
        if x.dtype != torch.float32 or weights.dtype != torch.float32 or not {"gate_up", "down"} <= self.formats.keys():
            return None
        formats = self.formats["gate_up"] + self.formats["down"]
        if not current_ops().experts_applies(x, formats):
            return None
        from kvlab.backends.cpu_moe import describe_experts

        desc = describe_experts(self)
        return None if isinstance(desc, str) else desc

    def forward_by_expert(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The forward in PyTorch, one chosen expert after another (each its products and an index_add)."""
        order, tokens, counts = group_by_expert(ids, self.num_experts)
        flat_weights = weights.reshape(-1)  # [N·k]
        out = torch.zeros_like(x)  # [N, hidden]
        start = 0
        for e, n in enumerate(counts):  # ascending expert ids: each token sums its experts in transformers' order
            if n == 0:
                continue
            picked, rows = order[start : start + n], tokens[start : start + n]  # [n] each
            start += n
            h = x.index_select(0, rows)  # [n, hidden]
            gate_up = self._product("gate_up", e, h, self.gate_up_bias)  # [n, 2I]
            gate, up = gate_up.split(self.expert_size, dim=-1)
            y = self._product("down", e, self.act(gate, up), self.down_bias)  # [n, hidden]
            out.index_add_(0, rows, (y * flat_weights[picked, None]).to(out.dtype))
        return out

    # ---- what it costs ----------------------------------------------------------------------------

    def weight_tensors(self) -> list[torch.Tensor]:
        tensors = []
        for name in ("gate_up", "down"):
            if name in self.formats:
                tensors += [getattr(self, f"{name}_{i}") for i in range(len(self.formats[name]))]
            else:
                tensors.append(getattr(self, name))
        return tensors + [b for b in (self.gate_up_bias, self.down_bias) if b is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weight_tensors())

    def bytes_read_per_token(self) -> int:
        """One token reads its top_k experts: top_k / E of every stacked matrix and bias."""
        return self.nbytes() * self.top_k // self.num_experts

    @property
    def macs_per_token(self) -> int:
        return self.top_k * 3 * self.hidden * self.expert_size
