"""Per-sequence state slots of a hybrid model (Gated DeltaNet layers beside attention), pure Python.

A model with recurrent layers keeps, beside its paged KV blocks, one constant-size state per running
sequence (kv/state_pool.py holds the tensors). Which slot a sequence holds is decided here, in the same
lifecycle as its blocks:

    allocate_slots   a sequence's first allocation also takes a state slot (no slot free: None, as a
                     full block pool answers, and nothing changes)
    free             finished or preempted: the slot goes back (a preempted sequence recomputes from 0)
    fork_state       n > 1: the child's slot gets a copy of the parent's state (done before the next pass)

Truncation needs no bookkeeping here: the pool knows how many tokens each slot's state covers and rolls
a state back to the verified position it is asked to continue from (kv/state_pool.py). Prefix caching is
off for such models: the attention layers' blocks alone cannot restore the recurrent state.

`plan_states` turns a pass's chunks into `StateMetadata`: the decode rows of different sequences as one
batched segment, a verification's k + 1 rows of one sequence as a "rows" segment (run in order, every
row's state kept), each prompt chunk as a "chunk" segment (the chunked delta rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.kv.manager import KVCacheManager
from kvlab.request import Request


class StateSlots:
    """Which request holds which of `num_slots` state slots; copies owed to forks."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(reversed(range(num_slots)))  # pop() takes slot 0 first
        self.of: dict[str, int] = {}
        self.pending_copies: list[tuple[int, int]] = []  # (src slot, dst slot), before the next pass

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, request_id: str) -> int:
        if request_id not in self.of:
            self.of[request_id] = self._free.pop()
        return self.of[request_id]

    def release(self, request_id: str) -> None:
        slot = self.of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def check_integrity(self) -> None:
        held = sorted(self.of.values())
        assert len(set(held)) == len(held) and sorted(held + self._free) == list(range(self.num_slots)), held


class HybridKVCacheManager(KVCacheManager):
    """The block manager of a model with recurrent layers: blocks as usual, plus one state slot a sequence."""

    def __init__(self, num_blocks: int, block_size: int, slots: StateSlots, layout=None):
        super().__init__(num_blocks, block_size, False, layout)  # prefix caching off: see the module docstring
        self.slots = slots

    def allocate_slots(self, request: Request, num_new_tokens: int, hit=None):
        needs_slot = request.request_id not in self.slots.of
        if needs_slot and self.slots.num_free == 0:
            return None
        ops = super().allocate_slots(request, num_new_tokens, hit)
        if ops is not None and needs_slot:
            self.slots.acquire(request.request_id)
        return ops

    def free(self, request: Request) -> None:
        super().free(request)
        self.slots.release(request.request_id)

    def fork_state(self, parent: Request, child: Request) -> None:
        self.slots.pending_copies.append((self.slots.of[parent.request_id], self.slots.of[child.request_id]))


@dataclass
class StateSegment:
    """Rows of one pass that share a way of running: "decode" (one token of each of several sequences),
    "rows" (a verification's rows of one sequence, in order), "chunk" (a prompt chunk of one sequence)."""

    kind: str
    rows: tuple[int, ...]  # packed token indices
    slots: tuple[int, ...]  # one per sequence ("decode": one per row)
    _tensors: dict = field(default_factory=dict, repr=False)

    def rows_tensor(self, device):
        import torch

        if device not in self._tensors:
            self._tensors[device] = torch.tensor(self.rows, dtype=torch.long, device=device)
        return self._tensors[device]


@dataclass
class StateMetadata:
    """A pass's view of the state pool: its segments, and per slot the positions it covers."""

    segments: list[StateSegment]
    spans: dict[int, tuple[int, int]]  # slot → (first position, end position) of its tokens in this pass
    begun: bool = False  # StatePool.begin has prepared the states for this pass


def plan_states(chunks, slots: StateSlots) -> StateMetadata:
    """The segments of a pass from its chunks in packed order (decode rows first, as the runner packs them)."""
    runs: list[tuple[object, int, list[int]]] = []  # (request, first position, packed rows)
    at = 0
    for c in chunks:
        if runs and c.num_new_tokens == 1 and runs[-1][0] is c.request and c.start == runs[-1][1] + len(runs[-1][2]):
            runs[-1][2].append(at)  # the next row of a verification
        else:
            runs.append((c.request, c.start, list(range(at, at + c.num_new_tokens))))
        at += c.num_new_tokens
    segments, decode_rows, decode_slots, spans = [], [], [], {}
    for request, start, rows in runs:
        slot = slots.of[request.request_id]
        spans[slot] = (start, start + len(rows))
        if len(rows) == 1:
            decode_rows.append(rows[0])
            decode_slots.append(slot)
        else:
            kind = "rows" if chunks_verify(chunks, request) else "chunk"
            segments.append(StateSegment(kind, tuple(rows), (slot,)))
    if decode_rows:
        segments.insert(0, StateSegment("decode", tuple(decode_rows), tuple(decode_slots)))
    return StateMetadata(segments, spans)


def chunks_verify(chunks, request) -> bool:
    """Whether `request`'s chunks in this pass are verification rows (drafted tokens after its last)."""
    return any(c.request is request and c.spec_token_ids and c.num_new_tokens == 1 for c in chunks)


def contiguous_plan(batch_size: int, num_new_tokens: int, start: int) -> StateMetadata:
    """A contiguous cache's pass: B sequences, row b in slot b, each gaining T tokens at `start` (rows b·T …)."""
    B, T = batch_size, num_new_tokens
    spans = {b: (start, start + T) for b in range(B)}
    if T == 1:
        return StateMetadata([StateSegment("decode", tuple(range(B)), tuple(range(B)))], spans)
    return StateMetadata([StateSegment("chunk", tuple(range(b * T, (b + 1) * T)), (b,)) for b in range(B)], spans)
