"""DiskStore: prefix-cache blocks as files, the prompt cache's second tier (`--prompt-cache-dir`).

One file per KV block of one KV group, named by what it holds and nothing else:

    DIR/kvlab-prompt-cache-v1/ab/ab12….kvb      name = blake2b(fingerprint ‖ key), 16 bytes in hex
    magic "KVLABKV1" | u32 header length | header (JSON: fingerprint, key, each part's shape and dtype)
    | payload (each storage tensor's block, in the cache's own format, padded to 16 bytes)
    | blake2b-16 of header and payload

`key` is the prefix cache's key of the block (`kv/manager.py`: the KV group and the chained block
hash, itself chained from the request's salted root, `kv/prefix_cache.py`), so a block is found only
by a request that agrees on every token before it and on its `cache_salt`. The fingerprint
(`kv/prompt_cache.py`) names everything that changes the bytes: the weights file, dtype, KV formats
and rotation, block size, the KV layout, kvlab's cache version. A file is trusted only when its
header names the fingerprint and key asked for, its parts have the pool's shapes and dtypes, and
its checksum matches: anything else (a torn, truncated, flipped or foreign file) is a miss, removed
and logged once.

Writes are atomic: a temporary file in DIR/…/tmp (named with the writer's pid), then `os.replace`, so
a reader, or another process sharing DIR, sees a whole file or none; a writer killed mid-write leaves
only a temporary file, removed by the next process that finds its pid gone. No fsync: after a power
cut a renamed file may hold garbage, and its checksum makes that a miss. The size bound is kept by
least-recently-used eviction by modification time (a read touches its file), so processes sharing
DIR agree on what is old. A write that fails for want of room or rights (full disk, read-only DIR)
turns writes off with one log line; reads go on.

Pure file handling; the threads and the pool's tensors are `kv/prompt_cache.py`'s.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvlab.errors import KvlabError

if TYPE_CHECKING:  # torch only where tensors are written: the flags are checked without it
    import torch

logger = logging.getLogger(__name__)

MAGIC = b"KVLABKV1"
VERSION_DIR = "kvlab-prompt-cache-v1"  # bump with the file format: older files are simply never found
ALIGN = 16  # every part starts at a multiple of 16 bytes of the payload (a staging row viewed as any dtype)
SUFFIX = ".kvb"
DEFAULT_SIZE = 4 * 2**30


def _pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class PartSpec:
    """One storage tensor's block: its shape ([block_size, Hkv, ...]) and dtype, and where it sits."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes into the payload
    nbytes: int

    def describe(self) -> list:
        return [list(self.shape), str(self.dtype).removeprefix("torch.")]


def part_specs(tensors: list[torch.Tensor]) -> tuple[PartSpec, ...]:
    """The payload's layout for a pool of these storage tensors (each indexed by block first)."""
    specs, offset = [], 0
    for t in tensors:
        nbytes = t[0].numel() * t.element_size()
        specs.append(PartSpec(tuple(t.shape[1:]), t.dtype, offset, nbytes))
        offset += _pad(nbytes)
    return tuple(specs)


def payload_bytes(specs: tuple[PartSpec, ...]) -> int:
    return specs[-1].offset + _pad(specs[-1].nbytes) if specs else 0


@dataclass
class DiskStats:
    """What the tier did, in blocks and bytes (one process)."""

    hits: int = 0  # blocks read back and verified
    misses: int = 0  # lookups past the memory hit that found no file
    bad_files: int = 0  # files refused (checksum, header, length) and removed
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    dropped_writes: int = 0  # blocks not written: the writer's queue was full, or writes are off
    evictions: int = 0  # files removed to keep the size bound
    tokens_served: int = 0  # prompt tokens admitted from blocks read back from disk


class BadFile(Exception):
    """A file that is there but cannot be trusted (torn, truncated, corrupt, someone else's)."""


class DiskStore:
    """The files of one fingerprint under DIR: atomic writes, verified reads, a size bound (LRU)."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int, fingerprint: str, specs: tuple[PartSpec, ...]):
        self.root = os.path.join(os.fspath(directory), VERSION_DIR)
        self.tmp = os.path.join(self.root, "tmp")
        self.max_bytes, self.fingerprint, self.specs = max_bytes, fingerprint, specs
        self.payload_len = payload_bytes(specs)
        self.header_parts = [s.describe() for s in specs]
        self.stats = DiskStats()
        self.writable = True
        self.lock = threading.Lock()  # the index and the counts: the writer and reader threads share them
        self.index: dict[str, int] = {}  # file name → bytes, for this process's size accounting
        self.total_bytes = 0
        self._bad_logged: set[str] = set()
        check_writable(directory)
        os.makedirs(self.tmp, exist_ok=True)
        self._remove_orphans()
        self.rescan()

    # ---- names ---------------------------------------------------------------------------------

    def name(self, key: bytes) -> str:
        digest = hashlib.blake2b(self.fingerprint.encode() + b"\0" + key, digest_size=16).hexdigest()
        return digest + SUFFIX

    def path(self, name: str) -> str:
        return os.path.join(self.root, name[:2], name)

    def exists(self, key: bytes) -> bool:
        return os.path.exists(self.path(self.name(key)))

    @property
    def file_bytes(self) -> int:
        return 8 + 4 + len(self._header(b"\0" * 16)) + self.payload_len + 16

    def _header(self, key: bytes) -> bytes:
        return json.dumps({"fingerprint": self.fingerprint, "key": key.hex(), "parts": self.header_parts},
                          separators=(",", ":")).encode()  # fmt: skip

    # ---- write -------------------------------------------------------------------------------

    def write(self, key: bytes, parts: list[torch.Tensor]) -> bool:
        """Write one block (its storage tensors' rows, on the CPU) atomically; False when writes are off."""
        if not self.writable:
            self.stats.dropped_writes += 1
            return False
        import torch

        name = self.name(key)
        header = self._header(key)
        tmp = os.path.join(self.tmp, f"{name}.{os.getpid()}.{threading.get_ident()}.tmp")
        h = hashlib.blake2b(header, digest_size=16)
        try:
            os.makedirs(os.path.dirname(self.path(name)), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(header)) + header)
                for spec, part in zip(self.specs, parts):
                    data = memoryview(part.contiguous().view(-1).view(torch.uint8).numpy())
                    pad = b"\0" * (_pad(spec.nbytes) - spec.nbytes)
                    f.write(data)
                    f.write(pad)
                    h.update(data)
                    h.update(pad)
                f.write(h.digest())
            os.replace(tmp, self.path(name))
        except OSError as e:
            self._discard(tmp)
            self._stop_writing(e)
            return False
        size = 12 + len(header) + self.payload_len + 16
        with self.lock:
            self.total_bytes += size - self.index.get(name, 0)
            self.index[name] = size
            self.stats.bytes_written += size
            self.stats.blocks_written += 1
        if self.total_bytes > self.max_bytes:
            self.evict()
        return True

    def _stop_writing(self, error: OSError) -> None:
        self.writable = False
        self.stats.dropped_writes += 1
        why = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is spent",
               errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
               errno.EPERM: "permission denied"}.get(error.errno, str(error))  # fmt: skip
        logger.warning("kvlab: prompt cache %s: %s; no more blocks are written there (reads go on)", self.root, why)

    # ---- read --------------------------------------------------------------------------------

    def read_into(self, key: bytes, row: torch.Tensor) -> bool:
        """Read the block `key` into `row` (uint8 [payload bytes]); False when there is no such file.
        A file that is there but wrong is removed, logged once, and is a miss too."""
        path = self.path(self.name(key))
        try:
            with open(path, "rb") as f:
                self._read_verified(f, key, row)
        except FileNotFoundError:
            return False
        except (BadFile, OSError, ValueError) as e:
            self._refuse(path, e)
            return False
        try:
            os.utime(path)  # recently used: the last to be evicted, in every process sharing DIR
        except OSError:
            pass
        with self.lock:
            self.stats.hits += 1
            self.stats.bytes_read += self.file_bytes
        return True

    def _read_verified(self, f, key: bytes, row: torch.Tensor) -> None:
        start = f.read(12)
        if len(start) != 12 or start[:8] != MAGIC:
            raise BadFile("not a kvlab block file")
        (header_len,) = struct.unpack("<I", start[8:])
        if header_len > 1 << 16:
            raise BadFile("header too long")
        header = f.read(header_len)
        if len(header) != header_len:
            raise BadFile("truncated header")
        meta = json.loads(header)
        if meta.get("fingerprint") != self.fingerprint or meta.get("key") != key.hex():
            raise BadFile("written for another model, format or prefix")
        if meta.get("parts") != self.header_parts:
            raise BadFile("its tensors have other shapes")
        view = memoryview(row.numpy())
        if f.readinto(view) != self.payload_len:
            raise BadFile("truncated")
        checksum = f.read(16)
        if len(checksum) != 16 or f.read(1):
            raise BadFile("wrong length")
        h = hashlib.blake2b(header, digest_size=16)
        h.update(view)
        if h.digest() != checksum:
            raise BadFile("checksum mismatch")

    def _refuse(self, path: str, error: Exception) -> None:
        name = os.path.basename(path)
        self._discard(path)
        with self.lock:
            self.stats.bad_files += 1
            size = self.index.pop(name, 0)
            self.total_bytes -= size
            first = name not in self._bad_logged
            self._bad_logged.add(name)
        if first:
            logger.warning("kvlab: prompt cache: %s is unusable (%s): removed, its tokens are recomputed", path, error)

    # ---- the size bound ------------------------------------------------------------------------

    def rescan(self) -> list[tuple[float, str, int]]:
        """Every block file under the fingerprint-agnostic root (other processes' too): (mtime, name, bytes)."""
        files = []
        for sub in os.scandir(self.root):
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            try:
                entries = list(os.scandir(sub.path))
            except OSError:
                continue
            for e in entries:
                if e.name.endswith(SUFFIX):
                    try:
                        st = e.stat()
                    except OSError:
                        continue
                    files.append((st.st_mtime, e.name, st.st_size))
        with self.lock:
            self.index = {name: size for _, name, size in files}
            self.total_bytes = sum(self.index.values())
        return files

    def evict(self) -> None:
        """Remove the least recently used files until DIR holds at most 90% of the bound (seen by every
        process; the margin spares a rescan of the directory at every write once it is full)."""
        files = sorted(self.rescan())
        total = sum(size for _, _, size in files)
        for _, name, size in files:
            if total <= self.max_bytes * 0.9:
                break
            self._discard(self.path(name))
            total -= size
            with self.lock:
                self.stats.evictions += 1
                self.total_bytes -= self.index.pop(name, 0)

    def _remove_orphans(self) -> None:
        """Temporary files whose writer is gone (killed mid-write)."""
        for e in os.scandir(self.tmp):
            parts = e.name.split(".")
            pid = int(parts[-3]) if len(parts) >= 4 and parts[-3].isdigit() else None
            if pid is not None and pid != os.getpid() and not _alive(pid):
                self._discard(e.path)

    @staticmethod
    def _discard(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cache_size(value: int | str | None) -> int:
    """--prompt-cache-size as bytes: an int, or '2GiB', '500MB' (a KvlabError in one line otherwise)."""
    from kvlab.memory.units import parse_size

    if value is None:
        return DEFAULT_SIZE
    if isinstance(value, str):
        value = int(value) if value.strip().isdigit() else parse_size(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise KvlabError(f"--prompt-cache-size must be a positive size, e.g. 4GiB, got {value!r}")
    return value


def check_writable(directory: str | os.PathLike) -> None:
    """Refuse, in one line, a DIR that cannot be created or written at all (before anything slow)."""
    directory = os.fspath(directory)
    probe = os.path.join(directory, f".kvlab-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"kvlab")
        os.unlink(probe)
    except OSError as e:
        raise KvlabError(f"--prompt-cache-dir {directory}: cannot write there ({e.strerror or e})") from None
