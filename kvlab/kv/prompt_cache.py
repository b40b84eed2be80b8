"""PromptCache: the prefix cache's second tier, on disk (`--prompt-cache-dir`), as the engine sees it.

    after a step   save_new_blocks()   the full blocks registered this step are copied out of the pool
                                       (one index_select per storage tensor into recycled buffers, in the
                                       engine thread, before any later step can reuse them) and queued; a
                                       writer thread writes one file per block and KV group (`kv/disk_tier.py`)
    add_request    hold(request)       its prompt's first block that is not in memory is on disk: a reader
                                       thread reads the run of blocks that follow into a staging buffer,
                                       and the request waits here, not in the scheduler
    each step      ready()             finished reads are copied into free blocks (a slice copy per run of
                                       consecutive blocks and storage tensor) and registered in the prefix
                                       cache; their requests join the scheduler's queue, where the prefix
                                       hit finds them in memory

No step waits on the disk: a request whose read is still running is simply not admitted yet, and the
other requests' steps go on (the engine waits for a read only when it has nothing else to do). The
cost: such a request's TTFT includes its read, and requests that arrived after it, with nothing on
disk, may be admitted before it. A block the read brings in is an ordinary cached block, so memory
pressure may evict it again before admission; then those tokens are recomputed — never wrong.

Blocks the pool evicts are not lost: they stay on disk and come back on the next request that needs
them. Keys and safety are `kv/disk_tier.py`'s; the fingerprint is built here from the model and cache.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import weakref
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlab.errors import KvlabError
from kvlab.kv.disk_tier import DiskStats, DiskStore, cache_size, part_specs
from kvlab.kv.manager import KVCacheManager
from kvlab.kv.paged import PagedKVCache
from kvlab.kv.prefix_cache import BlockHash
from kvlab.request import Request

logger = logging.getLogger(__name__)

CACHE_VERSION = 1  # bump when the bytes of a block change meaning (a format's encoding, the hash chain)
QUEUE_BYTES = 256 * 2**20  # copied-out blocks waiting for the writer, at most (more are dropped, not waited for)
SLOT_BLOCKS = 32  # blocks per copy-out buffer
WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")


def weights_identity(path: str | os.PathLike) -> list:
    """The weights file(s) by name, size and modification time: a re-pulled or edited file is another model."""
    p = Path(path)
    if p.is_file():
        files = [p]
    else:
        files = sorted(f for f in p.iterdir() if f.suffix in WEIGHT_SUFFIXES or f.name == "config.json")
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def fingerprint(loaded, cache: PagedKVCache) -> str:
    """Everything that changes a block's bytes, as one digest: the weights, how they are held, the dtype,
    the device type, the KV formats (rotation included), block size, layout and shapes, the tensor-parallel
    rank, and kvlab's cache version."""
    import hashlib
    import json

    facts = {
        "version": CACHE_VERSION,
        "weights": weights_identity(loaded.path),
        "weight_format": loaded.weight_format,
        "dtype": str(cache.dtype),
        "device": cache.device.type,
        "kv_formats": [repr(cache.formats.k), repr(cache.formats.v)],
        "block_size": cache.block_size,
        "layout": [[g.window, list(g.layers)] for g in cache.layout.groups],
        "shape": [cache.num_layers, cache.num_kv_heads, cache.head_dim],
        "rank": [os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")],
    }
    return hashlib.blake2b(json.dumps(facts, sort_keys=True).encode(), digest_size=16).hexdigest()


def byte_rows(t: torch.Tensor) -> torch.Tensor:
    """A pool tensor [num_blocks, ...] viewed as [num_blocks, bytes of a block] (int64 when they divide by 8)."""
    rows = t.view(torch.uint8).view(t.shape[0], -1)
    return rows.view(torch.int64) if rows.shape[1] % 8 == 0 else rows


def _write_loop(jobs: queue.Queue, store: DiskStore, free_slots: list, lock: threading.Lock, pending: set) -> None:
    """(writer thread) Write each queued batch of copied-out blocks, one file per block; recycle its buffers."""
    while True:
        item = jobs.get()
        try:
            if item is None:
                return
            keys, slot = item
            parts = [p[: len(keys)].cpu() for p in slot]
            for j, key in enumerate(keys):
                try:
                    store.write(key, [p[j] for p in parts])
                except Exception:  # never the engine's problem: the block is just not on disk
                    logger.exception("kvlab: prompt cache: writing a block failed")
                pending.discard(key)
            with lock:
                free_slots.append(slot)
        finally:
            jobs.task_done()


def _close_at_exit(ref: weakref.ref) -> None:
    tier = ref()
    if tier is not None:
        tier.close()


@dataclass
class _Read:
    """A request held while the run of its blocks after `start` is read from disk."""

    request: Request
    hashes: list[BlockHash]
    start: int  # first block index read (the blocks before it were in memory when the read began)
    future: Future  # → (staging [rows, payload bytes] uint8, whole blocks read)


class MemoryOnly:
    """No disk tier (no --prompt-cache-dir): PromptCache's hooks, each doing nothing, so that the engine
    calls them without asking whether a tier exists."""

    num_held = 0

    def hold(self, request: Request) -> bool:
        return False

    def cancel(self, request_id: str) -> Request | None:
        return None

    def ready(self, wait_s: float = 0.0) -> list[Request]:
        return []

    def disk_tokens(self, request: Request) -> int:
        return 0

    def save_new_blocks(self) -> None: ...

    def forget(self, request: Request) -> None: ...

    def close(self) -> None: ...


class PromptCache:
    def __init__(self, store: DiskStore, kv: KVCacheManager, cache: PagedKVCache):
        self.store, self.kv, self.cache = store, kv, cache
        self.tensors = cache.tensors()
        # each storage tensor as one row of bytes per block, read as int64 where the row allows (index_select
        # and index_copy_ over whole rows are fast; over [bs, Hkv, D] slices of small dtypes they are not)
        self.rows = [byte_rows(t) for t in self.tensors]
        self.num_groups = len(kv.groups)
        kv.track_new_blocks = True
        # copy-out buffers, recycled: a fresh page costs more than the copy into it (5-15× on a VM), so the
        # memory blocks are copied into is touched once, not at every step; at most QUEUE_BYTES of them
        self.max_slots = max(2, QUEUE_BYTES // max(SLOT_BLOCKS * store.payload_len, 1))
        self._slots: list[list[torch.Tensor]] = []  # free ones
        self._num_slots = 0
        self._slots_lock = threading.Lock()
        self._staging: torch.Tensor | None = None  # the read buffer, kept between reads (None: in use)
        self._pending: set[BlockHash] = set()  # keys queued for writing
        self._queue: queue.Queue = queue.Queue()
        # the writer holds what it writes with, not the PromptCache: a dropped engine's tier is collected
        # (its __del__ ends the writer after the queue) and its KV pool freed
        writer_state = (self._queue, store, self._slots, self._slots_lock, self._pending)
        self._writer = threading.Thread(target=_write_loop, args=writer_state, name="kvlab-prompt-cache-write",
                                        daemon=True)  # fmt: skip
        self._writer.start()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvlab-prompt-cache-read")
        self._held: dict[str, _Read] = {}  # request id → its read, in arrival order
        self._restored: dict[str, set[int]] = {}  # request id → indices of blocks loaded for it from disk
        self._closed = False
        atexit.register(_close_at_exit, weakref.ref(self))

    @classmethod
    def create(cls, config, loaded, cache: PagedKVCache, kv: KVCacheManager) -> PromptCache | None:
        """The tier `config` asks for (None without `prompt_cache_dir`); a KvlabError for a DIR that
        cannot be written, a bad size, or a cache without prefix caching."""
        if not config.prompt_cache_dir:
            return None
        if not kv.enable_prefix_caching:
            raise KvlabError("--prompt-cache-dir keeps the prefix cache's blocks on disk: it needs prefix caching "
                             "(drop --no-prefix-caching / --no-cache)")  # fmt: skip
        size = cache_size(config.prompt_cache_size)
        store = DiskStore(config.prompt_cache_dir, size, fingerprint(loaded, cache), part_specs(cache.tensors()))
        if store.file_bytes > size:
            raise KvlabError(f"--prompt-cache-size {size:,} bytes is smaller than one block's file "
                             f"({store.file_bytes:,} bytes)")  # fmt: skip
        return cls(store, kv, cache)

    @property
    def stats(self) -> DiskStats:
        return self.store.stats

    @property
    def num_held(self) -> int:
        return len(self._held)

    # ---- out: after each step ------------------------------------------------------------------------

    def save_new_blocks(self) -> None:
        """Copy the blocks registered this step out of the pool and queue them for the writer (never waits)."""
        new = [(k, b) for k, b in self.kv.take_new_blocks()
               if k not in self._pending and self.store.name(k) not in self.store.index]  # fmt: skip
        if self._closed:
            return
        for start in range(0, len(new), SLOT_BLOCKS):
            chunk = new[start : start + SLOT_BLOCKS]
            slot = self._take_slot() if self.store.writable else None
            if slot is None:  # the writer is behind (or writes are off): these blocks are not written
                self.stats.dropped_writes += len(new) - start
                return
            ids = torch.tensor([b for _, b in chunk], dtype=torch.long, device=self.cache.device)
            for rows, buf in zip(self.rows, slot):  # [n, the block's bytes] each: a copy, into recycled memory
                torch.index_select(rows, 0, ids, out=buf[: len(chunk)])
            keys = [k for k, _ in chunk]
            self._pending.update(keys)
            self._queue.put((keys, slot))

    def _take_slot(self) -> list[torch.Tensor] | None:
        with self._slots_lock:
            if self._slots:
                return self._slots.pop()
            if self._num_slots >= self.max_slots:
                return None
            self._num_slots += 1
        return [torch.empty((SLOT_BLOCKS, rows.shape[1]), dtype=rows.dtype, device=rows.device) for rows in self.rows]

    def flush(self) -> None:
        """Wait until every queued block is written (tests, the end of `kvlab run`)."""
        self._queue.join()

    # ---- in: before admission ------------------------------------------------------------------------

    def hold(self, request: Request) -> bool:
        """Start reading the request's blocks that follow its in-memory prefix, if the first is on disk.
        True: the request waits here until `ready` hands it back."""
        if request.params.prompt_logprobs is not None:  # salted apart by its own id: never on disk
            return False
        pool, hashes = self.kv.pool, self.kv.prompt_hashes(request)
        start = next((i for i, h in enumerate(hashes)
                      if any(pool.lookup(k) is None for k in self.kv.group_keys(h))), len(hashes))  # fmt: skip
        if start == len(hashes):
            return False
        keys = [self.kv.group_keys(h) for h in hashes[start:]][: max(self.kv.num_blocks // self.num_groups, 1)]
        if not all(self.store.exists(k) for k in keys[0]):
            self.stats.misses += 1
            return False
        rows = len(keys) * self.num_groups
        staging, self._staging = self._staging, None
        if staging is None or staging.shape[0] < rows:  # in use by another read, or too small: a new one
            staging = torch.empty((rows, self.store.payload_len), dtype=torch.uint8)
        future = self._reader.submit(self._read_run, keys, staging)
        self._held[request.request_id] = _Read(request, hashes, start, future)
        return True

    def _read_run(self, keys: list[list[BlockHash]], staging: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(reader thread) The longest run of these blocks whose files are there and sound, every group,
        read into `staging` (a row of payload bytes per block file)."""
        for i, group_keys in enumerate(keys):
            for g, key in enumerate(group_keys):
                if not self.store.read_into(key, staging[i * self.num_groups + g]):
                    self.stats.misses += 1
                    return staging, i
        return staging, len(keys)

    def ready(self, wait_s: float = 0.0) -> list[Request]:
        """Requests whose reads have finished, their blocks now in the pool, in arrival order (`wait_s`:
        wait that long for one, when the engine has nothing else to do)."""
        if not self._held:
            return []
        if wait_s:
            wait([r.future for r in self._held.values()], timeout=wait_s, return_when=FIRST_COMPLETED)
        done = [rid for rid, r in self._held.items() if r.future.done()]
        out = []
        for rid in done:
            read = self._held.pop(rid)
            try:
                self._install(read)
            except Exception:  # a read that cannot be used is a miss: the request prefills
                logger.exception("kvlab: prompt cache: loading blocks from disk failed")
            out.append(read.request)
        return out

    def _install(self, read: _Read) -> None:
        """Copy the blocks read into free blocks of the pool and make them findable (engine thread)."""
        staging, n = read.future.result()
        try:
            if n:
                self._adopt_run(read, staging, n)
        finally:
            if self._staging is None or self._staging.shape[0] < staging.shape[0]:
                self._staging = staging  # kept for the next read: its pages are touched already

    def _adopt_run(self, read: _Read, staging: torch.Tensor, n: int) -> None:
        pool, G = self.kv.pool, self.num_groups
        held: list[int] = []  # blocks this install holds while it allocates, in block order
        for h in read.hashes[: read.start]:  # the in-memory prefix: not to be evicted for its own tail
            found = [b for k in self.kv.group_keys(h) if (b := pool.lookup(k)) is not None]
            pool.touch(found)
            held += found
        rows, ids, installed = [], [], set()
        for i in range(n):
            idx = read.start + i
            for g, key in enumerate(self.kv.group_keys(read.hashes[idx])):
                b = pool.lookup(key)
                if b is not None:
                    pool.touch([b])
                elif pool.num_free_blocks:
                    (b,) = pool.allocate(1)
                    self.kv.adopt(read.request, read.hashes, idx, g, b)
                    rows.append(i * G + g)
                    ids.append(b)
                else:
                    break
                held.append(b)
            else:
                installed.add(idx)
                continue
            break
        if ids:
            self._copy_in(staging, rows, ids)
        pool.free(reversed(held))  # the tail first: a prefix outlives the blocks after it
        self._restored[read.request.request_id] = installed

    def _copy_in(self, staging: torch.Tensor, rows: list[int], ids: list[int]) -> None:
        """Staging rows (one block file's payload each) → pool blocks `ids`, every storage tensor: one slice
        copy per run of consecutive rows going to consecutive blocks (index_copy_ from a strided source is
        10× slower)."""
        runs, start = [], 0
        for k in range(1, len(rows) + 1):
            if k == len(rows) or rows[k] != rows[k - 1] + 1 or ids[k] != ids[k - 1] + 1:
                runs.append((rows[start], ids[start], k - start))
                start = k
        for spec, dst in zip(self.store.specs, self.rows):
            unit = dst.element_size()
            src = staging.view(dst.dtype)[:, spec.offset // unit : (spec.offset + spec.nbytes) // unit]
            for row, block, n in runs:
                dst[block : block + n].copy_(src[row : row + n])

    def cancel(self, request_id: str) -> Request | None:
        """Stop holding a request (aborted before its read finished); its read's result is dropped."""
        read = self._held.pop(request_id, None)
        return read.request if read is not None else None

    # ---- reporting -------------------------------------------------------------------------------

    def disk_tokens(self, request: Request) -> int:
        """Of the request's cached prompt tokens, those whose blocks were read back from disk for it."""
        installed = self._restored.get(request.request_id)
        if not installed:
            return 0
        bs, cached = self.kv.block_size, request.num_cached_tokens
        return bs * sum(1 for i in installed if (i + 1) * bs <= cached)

    def forget(self, request: Request) -> None:
        """The request has ended: count its tokens served from disk, drop its record."""
        self.stats.tokens_served += self.disk_tokens(request)
        self._restored.pop(request.request_id, None)

    def describe(self) -> str:
        s = self.stats
        return (f"prompt cache {self.store.root}: {s.hits} blocks read, {s.blocks_written} written, "
                f"{self.store.total_bytes / 2**20:.1f} of {self.store.max_bytes / 2**20:.0f} MiB")  # fmt: skip

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self._queue.put(None)  # the writer ends once the queue before it is written
            self._reader.shutdown(wait=False)

    def close(self) -> None:
        """Write what is queued, then stop the threads (idempotent; also at exit)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._writer.join(timeout=60)
        self._reader.shutdown(wait=False, cancel_futures=True)
