"""The CPU decode backend: the decoder layers of a paged decode step in one C call (kernels/decode.c).

    backend = CpuDecodeBackend.build(model)      # or a str: why this model cannot take it
    backend.cache_reason(cache)                  # None, or why this cache cannot
    if backend.applies(input_ids, cache, meta, policy):
        logits = backend.run(input_ids, cache, meta, logits_index, policy)

A decode step of a small model is a few hundred small operations; from Python each costs microseconds
of dispatch, more than the 4-bit products take. The backend reads the model's modules once and
describes every layer to decode.c (`LayerDesc`, cpu_layer.py): Llama's and Qwen's two norms or Gemma's four (its
x̂ · (1 + w) as the weights 1 + w), q/k norms, the fused q/k/v product with its bias, the layer's own
rotary table (Gemma 3's sliding layers), its sliding window and q·k scale, the SwiGLU or GeGLU MLP,
each product a float matrix or the GGUF file's own blocks. Around the layers it does what the model's
forward does: before them the embedding, a GGUF table's rows looked up and dequantized in one C call
(quant.c's kvlab_quant_dequantize_rows), then scaled (Gemma); after them the final norm and the LM head
at the logits rows, one more C call (kvlab_decode_head, described by cpu_layer.describe_head), then the
soft-cap. Each end is the module's own call where C does not read it (a float table, a tensor-parallel
shard's head) or where the module carries hooks.

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
A step runs its layers in one C call, each with its K/V storage, rotary angles and KV view set from
its `LayerStep` (a `_Plan` per cache); forward hooks on a decoder layer (the MTP proposer's, which reads
the last layer's output) split the call there and are called with the layer's output as if the module
had run.

`phase_clock()` times the steps' parts where they run (the benchmarks' split of a step): each layer's
matrix products, its mixer (attention with RoPE and the K/V writes, or a DeltaNet), its other work
(norms, residuals, the activation), and the final norm with the LM head (`PHASES`).
"""

from __future__ import annotations

import ctypes
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvlab.backends.cpu_layer import describe_head, describe_layer, embedding_format, is_attention
from kvlab.kernels import gemv, quant
from kvlab.backends.cpu_kv import GroupView, store, unreadable_reason
from kvlab.kernels.decode import (BLOCKS, Angles, KVStore, KVView, LayerDesc, LayerStep, StepDesc, kv_format_ids,
                                  library, struct_mismatch)  # fmt: skip
from kvlab.kernels.policy import ThreadPolicy
from kvlab.kv.formats import unrotated


# the parts of a step phase_clock() times, in its tensor's order: decode.c's PHASE_* (step.h), then the head
PHASES = ("products", "mixer", "layer_other", "head")


class CpuDecodeBackend:
    """The C description of every decoder layer of one model, and the step that runs them."""

    name = "cpu-c"
    _phases: torch.Tensor | None = None  # float64 [len(PHASES)] while phase_clock() is open
    _head_cell: ctypes.c_double | None = None  # its "head" element, while it is open

    def __init__(self, model, layers: list[LayerDesc], keep: list[torch.Tensor], lib):
        self.model, self.layers, self.lib = model, layers, lib
        self._moes = [d.moe.contents for d in layers if d.moe]  # the mixtures' descriptions: the step sizes their scratch
        head = describe_head(model, keep)  # a string says why not: the modules run the head
        self.head = None if isinstance(head, str) else head  # (its LinearDesc, the norm's weights, eps), or None
        self._head_blocks = self.head is not None and self.head[0].parts[0].kind == BLOCKS  # any rows: no BLAS
        self.embed_fmt = embedding_format(model)  # the token table's format where C looks its rows up, or None
        self._rows_of_table = quant._library()["dequantize_rows"] if self.embed_fmt is not None else None
        self._keep = keep  # tensors the descriptions point at that the model does not hold (1 + w)
        self._checked: dict[int, str | None] = {}  # id(cache) → cache_reason, asked once per cache
        self._plan_of: tuple | None = None  # (a weak reference to the cache, its _Plan): see _plan
        self.kv_ids = kv_format_ids()  # decode.c's id of each KV storage format, asked once
        self._attentions = [layer.attn for layer in model.layers if is_attention(layer.attn)]
        attns = self._attentions or [None]
        c = model.config
        self.geometry = (c.hidden_size, max(getattr(a, "num_heads", 0) for a in attns),
                         max(getattr(a, "num_kv_heads", 0) for a in attns), max(getattr(a, "head_dim", 0) for a in attns),
                         max(getattr(layer.mlp, "inner", layer.mlp).intermediate_size for layer in model.layers))  # fmt: skip
        self.hybrid = any(d.deltanet for d in layers)
        # Products over GGUF blocks take any number of rows in the kernels (quant.c, quant_i8.c), so a
        # step of more sequences than the policy's max_kernel_rows stays here; a float matrix past it
        # wants BLAS (at 33-64 rows 1.3-2.5x faster than gemv.c), which the C step does not call.
        # SmolLM2 at 64 sequences: 81 -> 47 ms a step with int8 activations, 115 -> 86 exact.
        from kvlab.model.layers import Linear

        self.any_rows = not any(isinstance(m, Linear) for m in model.layers.modules())
        self.mixer_floats = max(self._mixer_floats(d) for d in layers)  # Step.mixer_scratch per row of a step

    @contextmanager
    def phase_clock(self) -> Iterator[torch.Tensor]:
        """Within the block, every step this backend runs adds the wall time of its parts to the yielded
        float64 tensor, in PHASES' order (seconds, summed over steps and layers); outside it nothing is timed."""
        phases = torch.zeros(len(PHASES), dtype=torch.float64)
        self._phases = phases
        # the head's part is added from here: a ctypes cell over its element, where a tensor op cost 89 us a
        # step (Python's first op after the C layers, its code cold), inside the step the benchmarks time
        self._head_cell = ctypes.c_double.from_address(phases.data_ptr() + phases.element_size() * PHASES.index("head"))
        try:
            yield phases
        finally:
            self._phases = self._head_cell = None

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
            desc = describe_layer(model, layer, keep)
            if isinstance(desc, str):
                return f"layer {i}: {desc}"
            layers.append(desc)
        return cls(model, layers, keep, lib)

    def cache_reason(self, cache) -> str | None:
        """Why this cache cannot be read by the C step (None: it can)."""
        from kvlab.kv.paged import PagedKVCache

        key = id(cache)
        if key not in self._checked:
            self._checked[key] = unreadable_reason(cache) if isinstance(cache, PagedKVCache) else "not a paged cache"
        return self._checked[key]

    def steady_rows(self, policy: ThreadPolicy) -> int | None:
        """Sequences a decode step may hold with every sequence's numbers those it has alone (None: any
        number): with a float matrix, the policy's max_kernel_rows, past which the step goes to BLAS."""
        return None if self.any_rows else policy.max_kernel_rows

    def applies(self, input_ids: torch.Tensor, cache, meta, policy: ThreadPolicy) -> bool:
        """Whether this pass is a decode step it runs: B sequences, one token each, in every KV group."""
        from kvlab.kv.paged import PagedMetadata
        from kvlab.model.attention import sdpa_attention

        tokens = input_ids.shape[1]
        sized = policy.kernel_sized(tokens) or (self.any_rows and policy.use_kernels and tokens > 0)
        if not isinstance(meta, PagedMetadata) or not sized or self.cache_reason(cache):
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
        x = self._embed(input_ids)  # [B, E]
        if model.embed_scale is not None:  # in the activations' dtype, as the model rounds it
            x = x * torch.tensor(model.embed_scale, dtype=x.dtype)
        x = x.float().contiguous()
        positions = meta.positions[0]  # [B]
        B = x.shape[0]
        groups = [GroupView(cache, g, view.groups[0], positions, view.slot_mapping)
                  for g, view in enumerate(meta.kv_groups)]  # fmt: skip
        max_keys = max(v.max_keys for v in groups)
        scratch = torch.empty(self.lib["scratch_floats"](B, *self.geometry, max_keys))
        k_fmt, v_fmt = self.kv_ids[unrotated(cache.formats.k).name], self.kv_ids[unrotated(cache.formats.v).name]
        step = StepDesc(B, None, None, KVStore(), KVStore(), cache.block_size, None, None, 0, None, None, max_keys,
                        scratch.data_ptr(), int(cache.formats.rotate_k), int(cache.formats.rotate_v))  # fmt: skip
        moe_scratch = self._moe_scratch(B)  # the MoE layers' output [B, E] and working rows, or None
        step.moe_scratch = moe_scratch.data_ptr() if moe_scratch is not None else None
        mixer_scratch = torch.empty(B * self.mixer_floats)
        step.mixer_scratch = mixer_scratch.data_ptr()
        phases = self._phases
        step.phase_seconds = phases.data_ptr() if phases is not None else None
        if self.hybrid:  # the recurrent states at the pass's positions; each sequence's slot
            cache.states.begin(meta.states)
            state_slots = torch.tensor(meta.states.segments[0].slots, dtype=torch.int64)
            step.state_slots = state_slots.data_ptr()
        plan = self._plan(cache, k_fmt, v_fmt)
        angles, keep = (Angles * max(len(plan.ropes), 1))(), []  # each rotary table's cos/sin at the positions
        for j, rope in enumerate(plan.ropes):
            table = model._rotary_of(rope)
            keep += (cos := table.cos.index_select(0, positions), sin := table.sin.index_select(0, positions))
            angles[j] = Angles(cos.data_ptr(), sin.data_ptr())
        views = (KVView * max(len(plan.views), 1))()  # each (KV group, window) pair's tables
        for j, (g, window) in enumerate(plan.views):
            view = groups[g]
            views[j] = KVView(view.slots, view.tables_ptr, view.stride, view.num_keys_ptr, view.first_key(window))
        for i, index in plan.deltanets:  # read each step: the pool's tensors are the cache's to replace
            entry = plan.entries[i]
            entry.conv_state, entry.ssm_state = cache.states.conv[index].data_ptr(), cache.states.ssm[index].data_ptr()
        # all layers in one call, but where a layer has forward hooks: the layers up to it, then its hooks
        layers, failed, start, run_layers = model.layers, ctypes.c_int64(), 0, self.lib["layers"]
        for end in sorted({i + 1 for i, layer in enumerate(layers) if layer._forward_hooks} | {len(layers)}):
            first = ctypes.byref(plan.entries, start * ctypes.sizeof(LayerStep))
            status = run_layers(first, end - start, angles, views, ctypes.byref(step), x.data_ptr(), policy.threads,
                                ctypes.byref(failed))  # fmt: skip
            if status == -1:
                self._rank_failed(start + failed.value)
            if status:
                raise ValueError(f"layer {start + failed.value}: the C step refused its Gated DeltaNet's sizes")
            start, layer = end, layers[end - 1]
            for hook in list(layer._forward_hooks.values()):  # what the module's own call would show: its output [1, B, E]
                hook(layer, (), x[None].clone())
        t = time.perf_counter() if phases is not None else 0.0
        S = logits_index.numel()
        if self._head_applies(S, policy):  # the final norm and the LM head in one C call
            desc, norm, eps = self.head
            index = logits_index.to(torch.int64).contiguous()
            logits, normed = torch.empty(1, S, desc.out_features), torch.empty(S, x.shape[1])
            if self.lib["head"](ctypes.byref(desc), norm, eps, x.data_ptr(), *x.shape, index.data_ptr(), S,
                                normed.data_ptr(), logits.data_ptr(), policy.threads):  # fmt: skip
                raise IndexError(f"logits rows {index.tolist()} outside the step's {x.shape[0]} rows")
        else:
            logits = model.lm_head(model.norm(x[logits_index][None])).float()  # [1, S, V]
        if model.logit_softcap is not None:
            logits = torch.tanh(logits / model.logit_softcap) * model.logit_softcap
        if phases is not None:
            self._head_cell.value += time.perf_counter() - t
        return logits

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The step's rows of the token table [B, E]: looked up and dequantized in one C call where the table
        is GGUF blocks (the module's bits; a hook on the module sees its own call instead)."""
        emb = self.model.embed_tokens
        if self.embed_fmt is None or emb._forward_hooks or emb._forward_pre_hooks:
            return emb(input_ids)[0]
        table, ids = emb.packed_0, input_ids.reshape(-1).to(torch.int64).contiguous()
        x = torch.empty(ids.numel(), emb.shape[1])
        status = self._rows_of_table(self.embed_fmt, table.data_ptr(), table.stride(0), table.shape[0], ids.data_ptr(),
                                     ids.numel(), x.data_ptr(), x.shape[1])  # fmt: skip
        if status == -2:
            raise IndexError(f"a token id outside the vocabulary of {table.shape[0]}: {ids.tolist()}")
        if status:
            raise ValueError(f"the C kernels refused the token table's {emb.fmt} rows")
        return x

    def _head_applies(self, rows: int, policy: ThreadPolicy) -> bool:
        """Whether the C head takes a step's `rows` logits rows: described, no hooks on the modules (they would
        not see the pass), and a float matrix only at the rows the kernels take (past them the modules' BLAS)."""
        if self.head is None or rows == 0:
            return False
        model = self.model
        if any(m._forward_hooks or m._forward_pre_hooks for m in (model.norm, model.lm_head)):
            return False
        return self._head_blocks or rows <= policy.max_kernel_rows

    def _plan(self, cache, k_fmt: int, v_fmt: int) -> _Plan:
        """What every layer's step reads that lasts as long as the cache (asked once per cache, not per step)."""
        if self._plan_of is None or self._plan_of[0]() is not cache:
            self._plan_of = (weakref.ref(cache), _Plan(self, cache, k_fmt, v_fmt))  # pointers only: the cache not kept
        return self._plan_of[1]

    def _mixer_floats(self, desc: LayerDesc) -> int:
        """Floats of Step.mixer_scratch a layer needs per row: its DeltaNet's working rows, or its attention's gate."""
        if desc.deltanet:
            return self.lib["deltanet_scratch_floats"](desc.deltanet, 1)  # deltanet.c's: B rows need B times it
        return desc.heads * desc.head_dim if desc.gate.num_parts else 1

    def _moe_scratch(self, B: int) -> torch.Tensor | None:
        if not self._moes:
            return None
        E = self.model.config.hidden_size
        return torch.empty(B * E + max(self.lib["moe_scratch_floats"](ctypes.byref(m), B, E) for m in self._moes))

    def _rank_failed(self, layer: int):
        from kvlab.parallel.group import RankFailed

        group = self.layers[layer]._group
        raise RankFailed(f"rank {group.rank}: all-reduce failed (layer {layer} of the C decode step): another rank "
                         f"of the tensor-parallel job died or stopped answering within {group.timeout_s:g} s; the job ends")


class _Plan:
    """A step's per-layer fields for one cache (step.h's LayerStep, one per layer): each layer's description, K
    and V storage, and the index of its rotary table (`ropes`) and of its KV group and window (`views`), whose
    tensors each step looks up once; a DeltaNet layer has neither, its states' pointers are set per step."""

    def __init__(self, backend: CpuDecodeBackend, cache, k_fmt: int, v_fmt: int):
        self.ropes: dict = {}  # each rotary table's key (the model's _rotary_of) → its index, in the layers' order
        self.views: dict[tuple[int, int | None], int] = {}  # each (KV group, window) pair → its index
        self.deltanets: list[tuple[int, int]] = []  # (layer, its state index) of a hybrid's DeltaNet layers
        self.entries = (LayerStep * len(backend.layers))()
        for i, (desc, layer) in enumerate(zip(backend.layers, backend.model.layers)):
            entry = self.entries[i]
            entry.layer, entry.angles, entry.view = ctypes.pointer(desc), -1, -1
            if desc.deltanet:
                self.deltanets.append((i, layer.attn.state_index))
                continue
            kv = layer.attn.layer_index  # its layer among those the cache holds
            entry.k, entry.v = store(k_fmt, cache.k_parts[kv]), store(v_fmt, cache.v_parts[kv])
            entry.angles = self.ropes.setdefault(layer.attn.rope, len(self.ropes))
            entry.view = self.views.setdefault((cache.placement[kv][0], layer.attn.window), len(self.views))


def _one_decode_segment(states, tokens: int) -> bool:
    """Whether a hybrid's pass is one batched decode segment over its rows in order (deltanet.c's step)."""
    if states is None or len(states.segments) != 1:
        return False
    seg = states.segments[0]
    return seg.kind == "decode" and seg.rows == tuple(range(tokens))
