"""Gated DeltaNet: the linear-attention layer of Qwen3.5 and Qwen3-Next, with a constant-size state.

Per token t and value head h (Hv heads; the Hk key heads are shared by Hv/Hk value heads each):

    x_t = silu(depthwise causal conv over the last K inputs of [q | k | v])   conv state: K − 1 inputs
    q_t, k_t = l2-normalised (q also scaled by 1/√Dk);  β_t = sigmoid(b_t);  g_t = −exp(A_log) · softplus(a_t + dt_bias)
    S_t = e^{g_t} S_{t−1} + k_t δ_tᵀ,   δ_t = β_t (v_t − e^{g_t} S_{t−1}ᵀ k_t)          S: [Dk, Dv] per head
    o_t = S_tᵀ q_t,  then RMSNorm(o_t) · silu(z_t) per head, out_proj

A prompt chunk runs the chunked form (`delta_rule_chunked`: within a chunk of C tokens the δ's solve
one unit lower-triangular system, the WY form), equal to the recurrent form (`delta_rule_recurrent`)
within float32 rounding; decode rows run the recurrent step, batched over sequences. Verification rows
(speculative decoding: k + 1 rows of one sequence) run the recurrent step one row after another, and
the state after each row is kept so that rejected drafts roll back exactly (kv/state_pool.py).
All of the recurrence is computed in float32; the states are stored in the pool's dtypes.
Shapes: N packed tokens, H = Hv value heads, Dk key head dim, Dv value head dim, C conv channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvlab.config import GatedDeltaNet as DeltaNetConfig
from kvlab.backends.ops import current_ops
from kvlab.config import ModelConfig
from kvlab.errors import KvlabError
from kvlab.kernels import deltanet as deltanet_c
from kvlab.kv.state_slots import contiguous_plan
from kvlab.model.layers import Linear, RMSNorm, Vector

CHUNK = 64  # tokens per chunk of the chunked delta rule
TILED_ARCHS = ("qwen35", "qwen35moe")  # GGUF architectures whose value heads are stored tiled by key head


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_step(S, q, k, v, g, beta):
    """One token of B sequences: S [B, H, Dk, Dv], q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H] → (o [B, H, Dv], S)."""
    S = S * g.exp()[..., None, None]
    delta = (v - torch.einsum("bhkv,bhk->bhv", S, k)) * beta[..., None]
    S = S + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", S, q), S


def delta_rule_recurrent(q, k, v, g, beta, S, keep_states: bool = False):
    """One sequence token by token: q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H], S [H, Dk, Dv] →
    (o [T, H, Dv], S, the state after each token [T, H, Dk, Dv] when `keep_states`)."""
    outs, states = [], []
    S = S[None]
    for t in range(q.shape[0]):
        o, S = delta_step(S, q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1])
        outs.append(o[0])
        if keep_states:
            states.append(S[0])
    return torch.stack(outs), S[0], (torch.stack(states) if keep_states else None)


def delta_rule_chunked(q, k, v, g, beta, S, chunk: int = CHUNK):
    """The same recurrence over chunks of `chunk` tokens (shapes as delta_rule_recurrent; no kept states).

    With G the cumulative sum of g inside a chunk and S₀ its initial state, the δ's of the chunk solve
    (I + A) δ = β ⊙ (V − e^G ⊙ K S₀),  A_ij = β_i e^{G_i − G_j} k_i·k_j for j < i,
    then o_t = e^{G_t} S₀ᵀ q_t + Σ_{i ≤ t} e^{G_t − G_i} (q_t·k_i) δ_i and S = e^{G_C} S₀ + Σ_i e^{G_C − G_i} k_i δ_iᵀ.
    """
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [H, T, D]
    g, beta = g.transpose(0, 1), beta.transpose(0, 1)  # [H, T]
    outs = []
    for lo in range(0, q.shape[1], chunk):
        qc, kc, vc = q[:, lo : lo + chunk], k[:, lo : lo + chunk], v[:, lo : lo + chunk]
        G, bc = g[:, lo : lo + chunk].cumsum(-1), beta[:, lo : lo + chunk]  # [H, n]
        n = G.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()  # j ≤ i
        diff = G[:, :, None] - G[:, None, :]  # [H, n, n]: G_i − G_j
        decay = diff.masked_fill(~causal, float("-inf")).exp()  # masked first: e^{positive} would overflow
        strict = decay * (~torch.eye(n, dtype=torch.bool, device=q.device))
        A = bc[:, :, None] * strict * (kc @ kc.transpose(1, 2))
        rhs = bc[..., None] * (vc - G.exp()[..., None] * (kc @ S))  # [H, n, Dv]
        eye = torch.eye(n, dtype=A.dtype, device=q.device).expand_as(A)
        delta = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        outs.append(G.exp()[..., None] * (qc @ S) + (decay * (qc @ kc.transpose(1, 2))) @ delta)
        tail = (G[:, -1:] - G).exp()[..., None]  # [H, n, 1]: e^{G_C − G_i}
        S = G[:, -1].exp()[:, None, None] * S + (kc * tail).transpose(1, 2) @ delta
    return torch.cat(outs, dim=1).transpose(0, 1), S


def runs_in_c(pool, layer: int, rows: int) -> bool:
    """Whether a decode batch of `rows` sequences runs on the C step (float32 states on a CPU, kernels built)."""
    return current_ops().deltanet_applies(pool.conv[layer], pool.ssm[layer], rows)


class GatedDeltaNet(nn.Module):
    """The layer's modules: one fused input projection (conv input q|k|v, the gate z, b and a), the
    conv's taps [C, K], A_log and dt_bias [H], the per-head output norm, out_proj."""

    rope = None  # no rotary table (Transformer.forward asks every mixer)

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        m: DeltaNetConfig = config.layers[layer_index].mixer
        self.layer_index = layer_index
        self.state_index = sum(isinstance(layer.mixer, DeltaNetConfig) for layer in config.layers[:layer_index])
        self.num_k_heads, self.num_v_heads = m.num_key_heads, m.num_value_heads
        # llama.cpp's qwen35 files order the value heads tiled (head h reads key head h mod Hk), not grouped
        # (h // (Hv/Hk)) as the checkpoints do (kvlab.model.hybrid_weights)
        self.tiled = config.architecture in TILED_ARCHS
        self.k_dim, self.v_dim, self.kernel = m.key_head_dim, m.value_head_dim, m.conv_kernel
        key_size, value_size = m.num_key_heads * m.key_head_dim, m.num_value_heads * m.value_head_dim
        self.conv_dim = 2 * key_size + value_size
        H = m.num_value_heads
        self.in_proj = Linear(config.hidden_size, self.conv_dim + value_size + 2 * H,
                              parts=(self.conv_dim, value_size, H, H))  # fmt: skip
        self.conv = Vector(self.conv_dim, m.conv_kernel)
        self.A_log, self.dt_bias = Vector(H), Vector(H)
        self.norm = RMSNorm(m.value_head_dim, config.rms_norm_eps)
        self.out_proj = Linear(value_size, config.hidden_size)
        self.attend = None  # Transformer.set_attention sets every mixer's; softmax attention only

    def forward(self, x, cos, sin, cache, meta) -> torch.Tensor:
        B, T, E = x.shape  # a paged step: [1, N] packed tokens; a contiguous cache: B sequences of T each
        N = B * T
        mixed, z, b, a = self.in_proj(x.reshape(N, E)).split(self.in_proj.parts, dim=-1)  # [N, ·] each
        beta = b.float().sigmoid()  # [N, H]
        g = -self.A_log.weight.float().exp() * F.softplus(a.float() + self.dt_bias.weight.float())
        pool, plan = cache.states, getattr(meta, "states", None)
        if pool is None:
            raise KvlabError("Gated DeltaNet layers need a cache with a state pool (the serving engine's, or a "
                             "contiguous cache made with ContiguousKVCache.for_model)")  # fmt: skip
        if plan is None:  # a contiguous cache's pass: planned once, by the first recurrent layer
            plan = meta.states = contiguous_plan(B, T, meta.start)
        pool.begin(plan)  # once per pass: forks copied, fresh states zeroed, rejected drafts rolled back
        out = torch.empty(N, self.num_v_heads, self.v_dim, dtype=torch.float32, device=x.device)
        for seg in plan.segments:
            rows = seg.rows_tensor(x.device)
            o = self._segment(pool, seg, mixed.index_select(0, rows).float(), g[rows], beta[rows])
            out.index_copy_(0, rows, o)
        normed = self.norm(out.to(x.dtype))  # per head, over Dv
        gated = (normed.float() * F.silu(z.float().view(N, self.num_v_heads, self.v_dim))).to(x.dtype)
        return self.out_proj(gated.reshape(B, T, -1))

    def _segment(self, pool, seg, mixed, g, beta) -> torch.Tensor:
        """One segment's rows: its conv and recurrence on the pool's states; returns o [n, H, Dv]."""
        if seg.kind == "decode" and runs_in_c(pool, self.state_index, len(seg.slots)):  # kernels/deltanet.c, in place
            return deltanet_c.decode(mixed, g, beta, self.conv.weight, pool.conv[self.state_index],
                                     pool.ssm[self.state_index], torch.tensor(seg.slots),
                                     self.num_k_heads, self.tiled)  # fmt: skip
        conv_state, S = pool.read(self.state_index, seg.slots)  # [b, C, K−1], [b, H, Dk, Dv] float32
        if seg.kind == "decode":  # b sequences, one token each
            window = torch.cat([conv_state, mixed[:, :, None]], dim=2)  # [b, C, K]
            xc = F.silu((window * self.conv.weight.float()).sum(-1))  # [b, C]
            q, k, v = self._heads(xc)
            o, S = delta_step(S, q, k, v, g, beta)
            pool.write(self.state_index, seg.slots, window[:, :, 1:], S)
            return o
        window = torch.cat([conv_state[0], mixed.t()], dim=1)  # [C, K − 1 + n]
        xc = F.silu(F.conv1d(window[None], self.conv.weight.float()[:, None], groups=self.conv_dim)[0]).t()  # [n, C]
        q, k, v = self._heads(xc)
        if seg.kind == "rows":  # verification: row by row, the state after each kept for a rollback
            o, S_last, states = delta_rule_recurrent(q, k, v, g, beta, S[0], keep_states=True)
            convs = torch.stack([window[:, i + 1 : i + self.kernel] for i in range(q.shape[0])])  # [n, C, K−1]
            pool.keep(self.state_index, seg.slots[0], convs, states)
        else:
            o, S_last = delta_rule_chunked(q, k, v, g, beta, S[0])
        pool.write(self.state_index, seg.slots, window[None, :, window.shape[1] - self.kernel + 1 :], S_last[None])
        return o

    def _heads(self, xc: torch.Tensor):
        """Conv output [n, C] → q, k [n, H, Dk] (normalised; key heads repeated for their value heads), v [n, H, Dv]."""
        n, ks = xc.shape[0], self.num_k_heads * self.k_dim
        q, k, v = xc.split((ks, ks, self.conv_dim - 2 * ks), dim=-1)
        repeat = self.num_v_heads // self.num_k_heads
        spread = (lambda x: x.repeat(1, repeat, 1)) if self.tiled else (lambda x: x.repeat_interleave(repeat, dim=1))
        q = spread(l2norm(q.reshape(n, self.num_k_heads, self.k_dim))) * self.k_dim**-0.5
        k = spread(l2norm(k.reshape(n, self.num_k_heads, self.k_dim)))
        return q, k, v.reshape(n, self.num_v_heads, self.v_dim)
