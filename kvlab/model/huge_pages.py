"""The weights a decode step reads whole, copied at load into memory in 2 MB pages (Linux's transparent
huge pages), on a CPU.

Where they come from, they sit in 4 KB pages: a GGUF file's blocks are viewed in place in its memory map
(the page cache), and PyTorch's own allocations get huge pages only where the kernel hands them out
unasked (`always`; most systems say `madvise`, which gives them only to memory that asks). A decode step
streams every matrix once, so it walks hundreds of MB a token through 4 KB pages: a TLB miss every 4 KB,
and every hardware prefetcher stops at the end of a page. One anonymous region advised MADV_HUGEPAGE,
the matrices copied into it one after the other (64-byte aligned), spares both. Measured side by side
on an AMD EPYC (Zen 4) VM, 2 threads, the exact products from memory: Qwen2.5-Coder-0.5B's Q5_0 gate
193 -> 179 us, its Q6_K down projection 231 -> 216 us; its exact one-sequence decode step (with its Q8_0
LM head) 22.7 -> 21.4 ms, both forms held in one process and their steps alternated.

What moves: the tensors of every module whose bytes_read_per_token is all its bytes (the layers'
matrices, norms and biases, an LM head; a tied embedding table with it, the one storage serving both).
What stays: an untied embedding table (a token reads one row: the rest stays on disk, out of the
resident set) and a mixture's experts (a token reads its top k). A storage shared by several tensors
(a tied head, views) is copied once and every tensor made again over the copy, each with its own
offset, shape and strides, so that a tie stays a tie. The copy runs in pieces of 8 MB on up to 4
threads, the file's pages each piece read let go at once (release_file_pages): the resident set peaks
a piece per thread over the final one.

Nothing moves on another device, where the kernel gives no huge pages (`never`, or not Linux), below one
huge page of weights (a test's tiny model), or with KVLAB_HUGE_PAGES=0 (the measurement's other side).
The values are the same bytes: only where they live changes.

    huge_pages_wanted()       whether this process copies weights into huge pages (the kernel's mode, the variable)
    into_huge_pages(model)    move the model's streamed weights (in place); the bytes moved
    in_huge_pages(tensor)     whether a tensor lies in a region this module made
    HugeArena().empty(shape)  a tensor made in huge pages to begin with (weights repacked at load)
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from kvlab.model.file_pages import read_only_file_maps, release_file_pages

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # Linux's madvise advice (asm-generic/mman-common.h)
ALIGN = 64  # each storage starts on a cache line
PIECE = 8 << 20  # bytes copied before the file pages they came from are let go
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_regions: list[tuple[int, int, weakref.ref]] = []  # (first byte, end, its map while a tensor keeps it alive)


def thp_mode(path: Path = THP_MODE) -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"); None where it has none."""
    try:
        found = re.search(r"\[(\w+)\]", path.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def huge_pages_wanted() -> bool:
    return os.environ.get("KVLAB_HUGE_PAGES", "1") != "0" and thp_mode() in ("always", "madvise")


def _region(size: int) -> torch.Tensor:
    """`size` bytes (a multiple of 2 MB) of an anonymous private mapping, from a 2 MB boundary, advised
    huge, as one uint8 tensor; the mapping lives as long as a tensor over it does."""
    area = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(area, dtype=torch.uint8)  # its storage holds the map
    skip = -whole.data_ptr() % HUGE_PAGE
    region = whole[skip : skip + size]
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise(region.data_ptr(), size, MADV_HUGEPAGE)  # refused: 4 KB pages, the same bytes
    _regions[:] = [r for r in _regions if r[2]() is not None]  # the regions no tensor keeps any more: gone
    _regions.append((region.data_ptr(), region.data_ptr() + size, weakref.ref(area)))
    return region


def in_huge_pages(t: torch.Tensor) -> bool:
    """Whether t lies in a region into_huge_pages made."""
    ptr = t.untyped_storage().data_ptr()
    return any(start <= ptr < end and alive() is not None for start, end, alive in _regions)


class HugeArena:
    """Tensors made one after another in huge-page regions of at least `chunk` bytes: weights that are
    made at load anyway (--activation-quant's repacking) are made there, and need no copy after. Each
    region's unused tail is never touched, so holds no memory past its last 2 MB page. Off (as
    huge_pages_wanted says), torch.empty."""

    def __init__(self, chunk: int = 64 << 20):
        self.chunk, self.region, self.used = chunk, None, 0
        self.on = huge_pages_wanted()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        if not self.on:
            return torch.empty(shape, dtype=dtype)
        like = torch.empty(shape, dtype=dtype, device="meta")
        n = _aligned(like.numel() * like.element_size())
        if self.region is None or self.used + n > self.region.numel():
            try:
                self.region, self.used = _region(_aligned(max(self.chunk, n), HUGE_PAGE)), 0
            except (OSError, ValueError, RuntimeError):  # no memory for a region: PyTorch's from here on
                self.on = False
                return torch.empty(shape, dtype=dtype)
        t = _over(self.region.untyped_storage(), self.region.storage_offset() + self.used, like)
        self.used += n
        return t


def streamed_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors of every module that a decode step reads whole."""
    found = {}
    for m in model.modules():
        if hasattr(m, "weight_tensors") and m.bytes_read_per_token() == m.nbytes():
            found.update({id(t): t for t in m.weight_tensors()})
    return list(found.values())


def into_huge_pages(model: nn.Module, least: int | None = None) -> int:
    """Copy the streamed weights of `model` (streamed_tensors) into one huge-page region and point every
    module's parameters and buffers that used them at the copies; returns the bytes moved (0 where
    nothing moves: see the module's docstring; `least`: the fewest bytes worth a region, one huge page)."""
    if not huge_pages_wanted():
        return 0
    storages: dict[int, torch.UntypedStorage] = {}
    for t in streamed_tensors(model):
        if t.device.type == "cpu" and not in_huge_pages(t):
            storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
    size = sum(_aligned(s.nbytes()) for s in storages.values())
    if size < (HUGE_PAGE if least is None else least):
        return 0
    arena = HugeArena(chunk=size)  # one region that holds them all, side by side
    copies: dict[int, torch.Tensor] = {}  # storage → the bytes of its copy
    for ptr, storage in storages.items():
        copies[ptr] = arena.empty((storage.nbytes(),))
        if not arena.on:  # no memory for the region: the weights stay where they are
            return 0
    files = read_only_file_maps()
    pieces = [(ptr, at, min(PIECE, c.numel() - at)) for ptr, c in copies.items() for at in range(0, c.numel(), PIECE)]

    def copy(piece: tuple[int, int, int]) -> None:  # its file pages let go at once (an LM head: 145 MB)
        ptr, at, n = piece
        ctypes.memmove(copies[ptr].data_ptr() + at, ptr + at, n)  # without the GIL
        release_file_pages([_bytes(storages[ptr], at, n)], files)

    # on several threads: the fresh pages' faults (the kernel zeroing them) take most of the time, and
    # they run in parallel (Qwen2.5-0.5B's 383 MB on a Zen 4 VM: 0.40 against 0.55 s, 0.08 against 0.12)
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        list(pool.map(copy, pieces))
    release_file_pages([_bytes(s, 0, s.nbytes()) for s in storages.values()], files)  # the pages across pieces

    made: dict[int, torch.Tensor] = {}  # id(old tensor) → its copy: a tensor two modules share stays one

    def moved(t: torch.Tensor) -> torch.Tensor | None:  # t made again over the copy of its storage
        c = copies.get(t.untyped_storage().data_ptr()) if t.device.type == "cpu" else None
        if id(t) not in made and c is not None:
            copy = _over(c.untyped_storage(), c.storage_offset() + t.storage_offset() * t.element_size(), t)
            made[id(t)] = nn.Parameter(copy, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else copy
        return made.get(id(t))

    kept = []  # the old tensors stay alive until the walk ends: no id is reused meanwhile
    for m in model.modules():
        for table in (m._buffers, m._parameters):
            for name, t in list(table.items()):
                if t is not None and (copy := moved(t)) is not None:
                    kept.append(t)
                    table[name] = copy
    return size


def _aligned(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def _bytes(storage: torch.UntypedStorage, at: int, n: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage, at, (n,), (1,))


def _over(storage: torch.UntypedStorage, at: int, like: torch.Tensor) -> torch.Tensor:
    """A tensor of like's dtype, shape and strides over `storage` from byte `at` (a multiple of its size)."""
    return torch.empty(0, dtype=like.dtype).set_(storage, at // like.element_size(), like.shape, like.stride())
