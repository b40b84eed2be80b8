"""The CPU decode backend: each decoder layer of a paged decode step in one C call (kernels/decode.c).

    backend = CpuDecodeBackend.build(model)      # or a str: why this model cannot take it
    backend.cache_reason(cache)                  # None, or why this cache cannot
    if backend.applies(input_ids, cache, meta, policy):
        logits = backend.run(input_ids, cache, meta, logits_index, policy)

A decode step of a small model is a few hundred small operations; from Python each costs microseconds
of dispatch, more than the 4-bit products take. The backend reads the model's modules once and
describes every layer to decode.c (`LayerDesc`): Llama's and Qwen's two norms or Gemma's four (its
x̂ · (1 + w) as the weights 1 + w), q/k norms, the fused q/k/v product with its bias, the layer's own
rotary table (Gemma 3's sliding layers), its sliding window and q·k scale, the SwiGLU or GeGLU MLP,
each product a float matrix or the GGUF file's own blocks. Around the layers it does what the model's
forward does: the embedding (scaled, Gemma), the final norm, the LM head and its soft-cap.

It takes decode-sized passes (every token a sequence's next one; at most the thread policy's kernel
rows) on a paged cache whose keys and values are each float32, bfloat16, float16, q8_0, q4_0 or
fp8_e4m3 (K and V apart, Hadamard-rotated or not): the C side writes the new K/V in the cache's format,
the bytes `formats.encode` writes, and attends over the stored codes, each row decoded as it is read.
A model with sliding-window layers has one block table per KV group of layers (kv/layout.py): each
layer reads its group's tables and slots, from the first key its window shows.

A hybrid's Gated DeltaNet layers (Qwen3.5, Qwen3-Next) are layers of the same step: their mixer is
described as a `DeltaNetDesc` (kernels/deltanet.c runs in_proj, the conv, the delta rule on the state
pool's slots, the gated norm and out_proj), their attention layers take the output gate and partial
rotary. The pool is brought to the pass's positions once (`StatePool.begin`) before the layers run.
Forward hooks on a decoder layer (the MTP proposer's, which reads the last layer's output) are called
with the layer's output as if the module had run.
"""

from __future__ import annotations

import ctypes
import math
import weakref

import torch

from kvlab.backends.cpu_deltanet import describe_deltanet
from kvlab.backends.cpu_linear import describe_linear
from kvlab.kernels import gemv
from kvlab.kernels.decode import (
    MAX_HEAD_DIM,
    KVStore,
    LayerDesc,
    LinearDesc,
    ReduceDesc,
    StepDesc,
    activation_ids,
    kv_format_ids,
    library,
    struct_mismatch,
)
from kvlab.kernels.policy import ThreadPolicy
from kvlab.kv.formats import unrotated
from kvlab.kv.layout import window_start


class CpuDecodeBackend:
    """The C description of every decoder layer of one model, and the step that runs them."""

    name = "cpu-c"

    def __init__(self, model, layers: list[LayerDesc], keep: list[torch.Tensor], lib):
        self.model, self.layers, self.lib = model, layers, lib
        self._keep = keep  # tensors the descriptions point at that the model does not hold (1 + w)
        self._checked: dict[int, str | None] = {}  # id(cache) → cache_reason, asked once per cache
        self._plan_of: tuple | None = None  # (a weak reference to the cache, its per-layer plan): see _plan
        self.kv_ids = kv_format_ids()  # decode.c's id of each KV storage format, asked once
        self._attentions = [layer.attn for layer in model.layers if _is_attention(layer.attn)]
        attns = self._attentions or [None]
        c = model.config
        self.geometry = (c.hidden_size, max(getattr(a, "num_heads", 0) for a in attns),
                         max(getattr(a, "num_kv_heads", 0) for a in attns), max(getattr(a, "head_dim", 0) for a in attns),
                         max(getattr(layer.mlp, "inner", layer.mlp).intermediate_size for layer in model.layers))  # fmt: skip
        self.hybrid = any(d.deltanet for d in layers)
        self.mixer_floats = max(self._mixer_floats(d) for d in layers)  # Step.mixer_scratch per row of a step

    @classmethod
    def build(cls, model) -> CpuDecodeBackend | str:
        """The backend for `model`, or why it cannot run it (one phrase)."""
        lib = library()
        if lib is None:
            return f"the C kernels are not built: {gemv.build_error() or 'unknown'}"
        mismatch = struct_mismatch(lib)
        if mismatch:
            return f"decode.c and decode.py disagree: {mismatch}"
        from kvlab.model.transformer import Transformer

        if not isinstance(model, Transformer):  # an MTP head: its pass feeds hidden states, not embeddings
            return f"a {type(model).__name__}, not the decoder the C step runs (embeddings, layers, norm, head)"
        if model.device.type != "cpu":
            return f"the model is on {model.device.type}"
        if model.dtype != torch.float32:
            return f"activations in {str(model.dtype).removeprefix('torch.')} (the C step computes in float32)"
        layers, keep = [], []
        for i, layer in enumerate(model.layers):
            desc = _describe(model, layer, keep, lib)
            if isinstance(desc, str):
                return f"layer {i}: {desc}"
            layers.append(desc)
        return cls(model, layers, keep, lib)

    def cache_reason(self, cache) -> str | None:
        """Why this cache cannot be read by the C step (None: it can)."""
        from kvlab.kv.paged import PagedKVCache

        key = id(cache)
        if key not in self._checked:
            self._checked[key] = _cache_reason(cache) if isinstance(cache, PagedKVCache) else "not a paged cache"
        return self._checked[key]

    def applies(self, input_ids: torch.Tensor, cache, meta, policy: ThreadPolicy) -> bool:
        """Whether this pass is a decode step it runs: B sequences, one token each, in every KV group."""
        from kvlab.kv.paged import PagedMetadata
        from kvlab.model.attention import sdpa_attention

        tokens = input_ids.shape[1]
        if not isinstance(meta, PagedMetadata) or not policy.kernel_sized(tokens) or self.cache_reason(cache):
            return False
        if any(attn.attend is not sdpa_attention for attn in self._attentions):
            return False  # the lab's set_attention since
        if self.hybrid and not _one_decode_segment(getattr(meta, "states", None), tokens):
            return False
        for view in meta.kv_groups:
            if len(view.groups) != 1:
                return False
            group = view.groups[0]
            if not (group.batch_size == tokens and group.lo == 0 and group.hi == tokens):
                return False
        return True

    def run(self, input_ids: torch.Tensor, cache, meta, logits_index: torch.Tensor, policy: ThreadPolicy):
        """Logits [1, S, V] of the rows at `logits_index`, as the model's own forward would give them."""
        model = self.model
        x = model.embed_tokens(input_ids)[0]  # [B, E]
        if model.embed_scale is not None:  # in the activations' dtype, as the model rounds it
            x = x * torch.tensor(model.embed_scale, dtype=x.dtype)
        x = x.float().contiguous()
        positions = meta.positions[0]  # [B]
        B = x.shape[0]
        groups = [_GroupView(cache, g, view, positions) for g, view in enumerate(meta.kv_groups)]
        max_keys = max(v.max_keys for v in groups)
        scratch = torch.empty(self.lib["scratch_floats"](B, *self.geometry, max_keys))
        k_fmt, v_fmt = self.kv_ids[unrotated(cache.formats.k).name], self.kv_ids[unrotated(cache.formats.v).name]
        step = StepDesc(B, None, None, KVStore(), KVStore(), cache.block_size, None, None, 0, None, None, max_keys,
                        scratch.data_ptr(), int(cache.formats.rotate_k), int(cache.formats.rotate_v))  # fmt: skip
        moe_scratch = self._moe_scratch(B)  # the MoE layers' output [B, E] and working rows, or None
        step.moe_scratch = moe_scratch.data_ptr() if moe_scratch is not None else None
        mixer_scratch = torch.empty(B * self.mixer_floats)
        step.mixer_scratch = mixer_scratch.data_ptr()
        if self.hybrid:  # the recurrent states at the pass's positions; each sequence's slot
            cache.states.begin(meta.states)
            state_slots = torch.tensor(meta.states.segments[0].slots, dtype=torch.int64)
            step.state_slots = state_slots.data_ptr()
        angles = {}  # one cos/sin lookup per rotary table: [B, D] each
        run_layer, step_ref, x_ptr, threads = self.lib["layer"], ctypes.byref(step), x.data_ptr(), policy.threads
        unset = object()
        last = (unset, unset, unset)  # the rotary table, KV group and window the step's fields hold now
        for i, (entry, layer) in enumerate(zip(self._plan(cache, k_fmt, v_fmt), model.layers)):
            if entry.deltanet:
                index = layer.attn.state_index
                step.conv_state, step.ssm_state = cache.states.conv[index].data_ptr(), cache.states.ssm[index].data_ptr()
            else:  # only what differs from the layer before is set again
                if entry.rope is not last[0]:
                    if entry.rope not in angles:
                        table = model._rotary_of(entry.rope)
                        angles[entry.rope] = (table.cos[positions].contiguous(), table.sin[positions].contiguous())
                    cos, sin = angles[entry.rope]
                    step.cos, step.signed_sin = cos.data_ptr(), sin.data_ptr()
                if entry.group != last[1] or entry.window != last[2]:
                    view = groups[entry.group]
                    step.slots, step.block_tables, step.table_stride = view.slots, view.tables_ptr, view.stride
                    step.num_keys, step.first_key = view.num_keys_ptr, view.first_key(entry.window)
                last = (entry.rope, entry.group, entry.window)
                step.k, step.v = entry.k, entry.v
            status = run_layer(entry.desc, step_ref, x_ptr, threads)
            if status == -1:
                self._rank_failed(i)
            if status:
                raise ValueError(f"layer {i}: the C step refused its Gated DeltaNet's sizes")
            if layer._forward_hooks:  # what the module's own call would show them: its output [1, B, E]
                for hook in list(layer._forward_hooks.values()):
                    hook(layer, (), x[None].clone())
        x = x[logits_index]  # [S, E]
        logits = model.lm_head(model.norm(x[None])).float()  # [1, S, V]
        if model.logit_softcap is not None:
            logits = torch.tanh(logits / model.logit_softcap) * model.logit_softcap
        return logits

    def _plan(self, cache, k_fmt: int, v_fmt: int) -> list[_LayerEntry]:
        """Per layer, what its step reads that lasts as long as the cache: its description, its rotary
        table, KV group and window, its K and V storage (asked once per cache, not per step)."""
        if self._plan_of is None or self._plan_of[0]() is not cache:
            plan = []
            for desc, layer in zip(self.layers, self.model.layers):
                entry = _LayerEntry(ctypes.byref(desc), bool(desc.deltanet))
                if not entry.deltanet:
                    kv = layer.attn.layer_index  # its layer among those the cache holds
                    entry.rope, entry.window, entry.group = layer.attn.rope, layer.attn.window, cache.placement[kv][0]
                    entry.k, entry.v = _store(k_fmt, cache.k_parts[kv]), _store(v_fmt, cache.v_parts[kv])
                plan.append(entry)
            self._plan_of = (weakref.ref(cache), plan)  # the plan's pointers only, never the cache kept alive
        return self._plan_of[1]

    def _mixer_floats(self, desc: LayerDesc) -> int:
        """Floats of Step.mixer_scratch a layer needs per row: its DeltaNet's working rows, or its attention's gate."""
        if desc.deltanet:
            return self.lib["deltanet_scratch_floats"](desc.deltanet, 1)  # deltanet.c's: B rows need B times it
        return desc.heads * desc.head_dim if desc.gate.num_parts else 1

    def _moe_scratch(self, B: int) -> torch.Tensor | None:
        moes = [d.moe.contents for d in self.layers if d.moe]
        if not moes:
            return None
        E = self.model.config.hidden_size
        return torch.empty(B * E + max(self.lib["moe_scratch_floats"](ctypes.byref(m), B, E) for m in moes))

    def _rank_failed(self, layer: int):
        from kvlab.parallel.group import RankFailed

        group = self.layers[layer]._group
        raise RankFailed(f"rank {group.rank}: all-reduce failed (layer {layer} of the C decode step): another rank "
                         f"of the tensor-parallel job died or stopped answering within {group.timeout_s:g} s; the job ends")


class _LayerEntry:
    """One layer's share of the step that lasts as long as the cache (CpuDecodeBackend._plan)."""

    __slots__ = ("desc", "deltanet", "rope", "window", "group", "k", "v")

    def __init__(self, desc, deltanet: bool):
        self.desc, self.deltanet = desc, deltanet
        self.rope = self.window = self.group = self.k = self.v = None


class _GroupView:
    """One KV group's share of a decode step as decode.c reads it: slots, block tables (from the first
    block its window reaches), the keys each sequence's table holds, and where each window starts."""

    def __init__(self, cache, g: int, view, positions: torch.Tensor):
        group = view.groups[0]
        bs, window = cache.block_size, cache.layout.groups[g].window
        self.positions = positions
        if window is None:  # the tables start at key 0
            self.table_start = torch.zeros_like(positions)  # [B]: the position of each table's first key
        else:
            self.table_start = torch.tensor([window_start(window, p) // bs * bs for p in positions.tolist()])
        self.num_keys = (positions + 1 - self.table_start).contiguous()  # [B]
        self.tables = group.block_tables.contiguous()
        self.slot_mapping = view.slot_mapping
        self.slots, self.tables_ptr = self.slot_mapping.data_ptr(), self.tables.data_ptr()
        self.stride, self.num_keys_ptr = self.tables.shape[1], self.num_keys.data_ptr()
        self.max_keys = int(group.num_keys)
        self._first: dict[int | None, torch.Tensor] = {}

    def first_key(self, window: int | None) -> int:
        """A pointer to [B]: each sequence's first key (in its table) that a layer with `window` sees."""
        if window not in self._first:
            if window is None:
                first = torch.zeros_like(self.num_keys)
            else:
                first = (self.positions - window + 1 - self.table_start).clamp(min=0).contiguous()
            self._first[window] = first
        return self._first[window].data_ptr()


def _store(fmt: int, parts: list[torch.Tensor]) -> KVStore:
    """A layer's storage tensors (codes, then scales where the format has them) as decode.c reads them."""
    return KVStore(fmt, parts[0].data_ptr(), parts[1].data_ptr() if len(parts) > 1 else None)


def _cache_reason(cache) -> str | None:
    ids, D = kv_format_ids(), cache.head_dim
    if cache.dtype != torch.float32:
        return f"the KV cache is read as {str(cache.dtype).removeprefix('torch.')} (the C step reads float32)"
    if D > MAX_HEAD_DIM or D % 8:
        return f"head_dim {D} (the C step takes multiples of 8 up to {MAX_HEAD_DIM})"
    for side, fmt in (("keys", cache.formats.k), ("values", cache.formats.v)):
        if unrotated(fmt).name not in ids:
            return f"{side} stored as {fmt.name}, a format decode.c does not read"
    if not all(t.is_contiguous() and t.device.type == "cpu" for t in cache.tensors()):
        return "the KV cache's tensors are not contiguous CPU tensors"
    states = getattr(cache, "states", None)
    if states is not None and not all(t.dtype == torch.float32 and t.is_contiguous() for t in states.tensors()):
        return "the recurrent states are not float32 (the C step updates float32 states)"
    return None


def _is_attention(mixer) -> bool:
    """A softmax-attention mixer (kvlab.model.transformer.Attention), not a recurrent one."""
    return hasattr(mixer, "qkv_proj")


def _one_decode_segment(states, tokens: int) -> bool:
    """Whether a hybrid's pass is one batched decode segment over its rows in order (deltanet.c's step)."""
    if states is None or len(states.segments) != 1:
        return False
    seg = states.segments[0]
    return seg.kind == "decode" and seg.rows == tuple(range(tokens))


# ---- the description of a layer, read from its modules --------------------------------------------


def _describe(model, layer, keep: list, lib) -> LayerDesc | str:
    """decode.c's description of one decoder layer, or why it cannot take it."""
    from kvlab.model.attention import sdpa_attention
    from kvlab.model.layers import GatedMLP
    from kvlab.backends.cpu_moe import describe_moe
    from kvlab.model.moe import MoEBlock
    from kvlab.model.transformer import DecoderLayer, SandwichDecoderLayer

    from kvlab.model.deltanet import GatedDeltaNet

    attn, mlp, eps = layer.attn, layer.mlp, model.config.rms_norm_eps
    deltanet = isinstance(attn, GatedDeltaNet)
    if not deltanet and not _is_attention(attn):  # multi-head latent attention (kvlab.model.mla)
        return f"its {type(attn).__name__} mixer is not one decode.c computes"
    if not deltanet and attn.attend is not sdpa_attention:
        return "the lab's materialized attention"
    if not deltanet and attn.clip_qkv is not None:
        return "q, k and v clamped (OLMoE's clip_qkv)"
    activations = activation_ids()
    moe_reduce = getattr(mlp, "inner", None)  # a tensor-parallel shard's experts, summed over the ranks
    moe = isinstance(mlp, MoEBlock) or isinstance(moe_reduce, MoEBlock)
    if not moe and (not isinstance(mlp, GatedMLP) or mlp.activation not in activations):
        return f"its MLP is {type(mlp).__name__} (the C step runs {', '.join(activations)} gated MLPs and experts)"
    if type(layer) is DecoderLayer:
        norms = [layer.input_norm, layer.post_attn_norm, None, None]  # before attention, before the MLP
    elif type(layer) is SandwichDecoderLayer:  # Gemma: each one's output normalised too
        norms = [layer.input_norm, layer.pre_mlp_norm, layer.post_attn_norm, layer.post_mlp_norm]
    else:
        return f"a {type(layer).__name__}, not a layer decode.c computes"
    norms += [None, None] if deltanet else [attn.q_norm, attn.k_norm]
    weights = [_norm_weight(n, eps, keep) if n is not None else None for n in norms]
    if any(isinstance(w, str) for w in weights):
        return next(w for w in weights if isinstance(w, str))
    # the all-reduce after o_proj and after the MLP (down_proj, or the whole mixture of experts)
    reduce = _row_parallel(attn.out_proj if deltanet else attn.o_proj, mlp if moe else mlp.down_proj,
                           model.config.hidden_size, keep)  # fmt: skip
    if isinstance(reduce, str):
        return reduce
    if deltanet and reduce:
        return "a tensor-parallel shard of a Gated DeltaNet layer"
    mixer = [] if deltanet else [attn.qkv_proj, attn.o_proj]
    if moe:
        mlp = moe_reduce if moe_reduce is not None else mlp
        products = mixer
    else:
        products = mixer + [mlp.gate_up_proj, mlp.down_proj]
    parts = [describe_linear(getattr(m, "inner", m) if reduce else m) for m in products]  # a shard's own matrices
    experts = describe_moe(mlp) if moe else None
    recurrent = describe_deltanet(attn) if deltanet else None
    gate = describe_linear(attn.gate_proj) if getattr(attn, "gate_proj", None) is not None else LinearDesc()
    for p in parts + [experts, recurrent, gate]:
        if isinstance(p, str):
            return p
    if deltanet:
        parts = [LinearDesc(), LinearDesc()] + parts  # no q/k/v or o
    if moe:
        parts += [LinearDesc(), LinearDesc()]  # the dense gate/up and down: none
    attn_norm, mlp_norm, attn_out, mlp_out, q_norm, k_norm = weights
    heads, kv_heads, head_dim = (0, 0, 0) if deltanet else (attn.num_heads, attn.num_kv_heads, attn.head_dim)
    scale = 0.0 if deltanet else attn.scale if attn.scale is not None else 1.0 / math.sqrt(head_dim)  # SDPA's default
    activation = 0 if moe else activations[mlp.activation]
    desc = LayerDesc(model.config.hidden_size, heads, kv_heads, head_dim, mlp.intermediate_size, eps, scale,
                     activation, 0 if deltanet else attn.window or 0,
                     attn_norm, mlp_norm, attn_out, mlp_out, q_norm, k_norm, *parts)  # fmt: skip
    desc.gate = gate
    if deltanet:
        keep.append(recurrent)
        desc.deltanet = ctypes.pointer(recurrent)
    else:
        desc.rotary_dim = model._rotary_of(attn.rope).cos.shape[-1]  # the table's width: head_dim, or partial rotary's
        desc.qk_norm_whole = int(attn.qk_norm_whole)
    if not deltanet and attn.sinks is not None:
        sinks = attn.sinks.weight
        if sinks.dtype != torch.float32 or not sinks.is_contiguous():
            return "attention sinks not float32"
        desc.sinks = sinks.data_ptr()
    if experts is not None:
        keep.append(experts)
        desc.moe = ctypes.pointer(experts)
    if reduce:
        desc.reduce = ctypes.pointer(reduce[0])
        desc._group = reduce[1]  # for the error a lost rank gives
    return desc


def _row_parallel(o_proj, down_proj, hidden: int, keep: list):
    """A tensor-parallel shard's all-reduce as decode.c makes it (the group's shared-memory segment and
    call counter) with its group; None for a whole model; or why the C step cannot sum over the ranks."""
    from kvlab.parallel.layers import RowParallel
    from kvlab.parallel.shm import CAPACITY_FLOATS

    wrapped = [isinstance(m, RowParallel) for m in (o_proj, down_proj)]
    if not any(wrapped):
        return None
    group = o_proj.group if wrapped[0] else down_proj.group
    if not all(wrapped) or down_proj.group is not group:
        return "a partly row-parallel layer"
    shm = group.shm
    if shm is None:
        return "its all-reduce runs over gloo (ranks on several hosts, or KVLAB_SHM_ALLREDUCE=0)"
    reduce = ReduceDesc(shm.address, shm.rank, shm.world, CAPACITY_FLOATS, shm.calls_address(), group.timeout_s)
    keep.append(reduce)
    return reduce, group


def _norm_weight(norm, eps: float, keep: list[torch.Tensor]) -> int | str:
    """The address of the float32 weights decode.c multiplies x̂ by: w, or Gemma's offset + w."""
    from kvlab.model.layers import OffsetRMSNorm, RMSNorm

    if type(norm) not in (RMSNorm, OffsetRMSNorm):
        return f"a {type(norm).__name__}, not an RMSNorm"
    if norm.eps != eps:
        return f"a norm with eps {norm.eps}, not the layer's {eps}"
    w = norm.weight
    if w.dtype != torch.float32 or w.device.type != "cpu":
        return "norm weights not float32 on the CPU"
    if type(norm) is OffsetRMSNorm and norm.offset != 0.0:
        w = norm.offset + w.float()  # the module's (offset + w), rounded once to float32 as it rounds it
        keep.append(w)
    return w.contiguous().data_ptr() if w.is_contiguous() else "norm weights not contiguous"
