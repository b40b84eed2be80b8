"""StatePool: the constant-size per-sequence states of a hybrid model's recurrent layers, beside the KV pool.

    conv[l]  [num_slots, C, K − 1]       the last K − 1 conv inputs of Gated DeltaNet layer l (model dtype)
    ssm[l]   [num_slots, Hv, Dk, Dv]     its delta-rule matrix per value head (the config's ssm dtype, or
                                         the model's; a GGUF's state_dtype for both)

Bytes per sequence are `kvlab mem`'s `state_bytes` (memory/kv.py: conv_dim × (K − 1) and Hv × Dk × Dv
numbers a layer); the engine's plan sizes `num_slots` = max_num_seqs of them (kv/pool_plan.py).
Slots are handed out by kv/state_slots.py with the sequence's blocks.

The pool tracks how many tokens each slot's state covers (`covered`). Before each pass (`begin`) it
copies forked states, zeroes the state of a sequence starting at position 0 (a new or preempted one),
and, for a sequence continuing from fewer tokens than its state covers — drafts were rejected — restores
the state kept after the last accepted row of its verification (`keep`). Anything else is a bug and
raises.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.config import GatedDeltaNet, ModelConfig
from kvlab.errors import KvlabError
from kvlab.kv.state_slots import StateMetadata

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class StateShape:
    """What one sequence's state holds per recurrent layer, and in which dtypes."""

    layers: tuple[int, ...]  # model layer index of each Gated DeltaNet layer
    conv: tuple[int, int]  # C, K − 1
    ssm: tuple[int, int, int]  # Hv, Dk, Dv
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype

    @classmethod
    def of(cls, config: ModelConfig, dtype: torch.dtype) -> StateShape | None:
        """The state of `config`'s recurrent layers with activations in `dtype` (None: it has none)."""
        mixers = [(i, layer.mixer) for i, layer in enumerate(config.layers) if isinstance(layer.mixer, GatedDeltaNet)]
        if not mixers:
            return None
        m = mixers[0][1]
        conv_dtype = ssm_dtype = dtype
        if config.state_dtype is not None:  # the runtime fixes both (a GGUF: llama.cpp's float32)
            conv_dtype = ssm_dtype = DTYPES[config.state_dtype]
        elif m.ssm_dtype is not None:
            ssm_dtype = DTYPES[m.ssm_dtype]
        conv = (2 * m.num_key_heads * m.key_head_dim + m.num_value_heads * m.value_head_dim, m.conv_kernel - 1)
        return cls(tuple(i for i, _ in mixers), conv, (m.num_value_heads, m.key_head_dim, m.value_head_dim),
                   conv_dtype, ssm_dtype)  # fmt: skip

    @property
    def bytes_per_sequence(self) -> int:
        conv = self.conv[0] * self.conv[1] * self.conv_dtype.itemsize
        ssm = self.ssm[0] * self.ssm[1] * self.ssm[2] * self.ssm_dtype.itemsize
        return len(self.layers) * (conv + ssm)


class StatePool:
    def __init__(self, shape: StateShape, slots, device: torch.device | str = "cpu"):
        self.shape, self.slots = shape, slots
        n = slots.num_slots
        self.conv = [torch.zeros(n, *shape.conv, dtype=shape.conv_dtype, device=device) for _ in shape.layers]
        self.ssm = [torch.zeros(n, *shape.ssm, dtype=shape.ssm_dtype, device=device) for _ in shape.layers]
        self.covered = [0] * n  # tokens each slot's state has seen
        self._kept: dict[int, tuple[int, list, list]] = {}  # slot → (first position, per layer conv, ssm states)

    def tensors(self) -> list[torch.Tensor]:
        return self.conv + self.ssm

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    # ---- before a pass ------------------------------------------------------------------------------

    def begin(self, meta: StateMetadata) -> None:
        """Make every slot of the pass hold the state before its first position (once per pass)."""
        if meta.begun:
            return
        meta.begun = True
        for src, dst in self.slots.pending_copies:
            for t in self.tensors():
                t[dst] = t[src]
            self.covered[dst] = self.covered[src]
        self.slots.pending_copies.clear()
        for slot, (start, end) in meta.spans.items():
            self._continue_from(slot, start)
            self.covered[slot] = end

    def _continue_from(self, slot: int, start: int) -> None:
        kept = self._kept.pop(slot, None)
        if start == 0:
            for t in self.tensors():
                t[slot].zero_()
        elif start == self.covered[slot]:
            return
        elif kept is not None and kept[0] < start <= kept[0] + kept[1][0].shape[0]:
            i = start - kept[0] - 1  # the state after row i covers positions up to start − 1
            for layer, (convs, states) in enumerate(zip(kept[1], kept[2])):
                self.conv[layer][slot] = convs[i]
                self.ssm[layer][slot] = states[i]
        else:  # a contiguous cache truncated back (a reused session): the recurrence cannot run backwards
            raise KvlabError(f"a Gated DeltaNet state holds {self.covered[slot]} tokens and cannot go back to "
                             f"{start}: a hybrid model's sequence is recomputed from its start instead")  # fmt: skip

    def stand_for(self, num_tokens: int) -> None:
        """Let every slot's state stand for `num_tokens` tokens, whatever it holds (the lab's caches filled with
        random numbers instead of a prefill: a step costs the same whatever the numbers)."""
        self.covered = [num_tokens] * len(self.covered)
        self._kept.clear()

    # ---- during a pass (the Gated DeltaNet layers) ---------------------------------------------------

    def read(self, layer: int, slots: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.tensor(slots, dtype=torch.long, device=self.conv[layer].device)
        return self.conv[layer].index_select(0, index).float(), self.ssm[layer].index_select(0, index).float()

    def write(self, layer: int, slots: tuple[int, ...], conv: torch.Tensor, ssm: torch.Tensor) -> None:
        index = torch.tensor(slots, dtype=torch.long, device=self.conv[layer].device)
        self.conv[layer].index_copy_(0, index, conv.to(self.shape.conv_dtype))
        self.ssm[layer].index_copy_(0, index, ssm.to(self.shape.ssm_dtype))

    def keep(self, layer: int, slot: int, convs: torch.Tensor, states: torch.Tensor) -> None:
        """The states after each verification row of `slot` (layer by layer, in layer order)."""
        start = self.covered[slot] - convs.shape[0]
        if layer == 0:
            self._kept[slot] = (start, [], [])
        self._kept[slot][1].append(convs.to(self.shape.conv_dtype))
        self._kept[slot][2].append(states.to(self.shape.ssm_dtype))


def kv_config(config: ModelConfig) -> ModelConfig:
    """The layers the paged KV cache holds: a hybrid's attention layers (its recurrent ones hold a state
    instead); other models unchanged. Attention modules index the cache in this order."""
    if not any(isinstance(layer.mixer, GatedDeltaNet) for layer in config.layers):
        return config
    import dataclasses

    kept = tuple(layer for layer in config.layers if not isinstance(layer.mixer, GatedDeltaNet))
    return dataclasses.replace(config, layers=kept)


def attach_states(cache, config: ModelConfig, batch_size: int, dtype: torch.dtype, device):
    """A contiguous (or no) cache of `config`: with a state pool of one slot per batch row when the model is a
    hybrid (its B sequences advance together: kvlab.kv.state_slots.contiguous_plan)."""
    from kvlab.kv.state_slots import StateSlots

    shape = StateShape.of(config, dtype)
    if shape is not None and device != "meta" and torch.device(device).type != "meta":
        slots = StateSlots(batch_size)
        for b in range(batch_size):
            slots.acquire(f"row {b}")  # row b holds slot b
        cache.states = StatePool(shape, slots, device)
    return cache
