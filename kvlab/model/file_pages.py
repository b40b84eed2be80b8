"""The pages of a memory-mapped file that this process has read, let go once what they held was copied
elsewhere (repacked for --activation-quant, or moved into huge pages: model/huge_pages.py). A file's page
dropped from the process comes back from the file if anything reads it again, so no value can change;
anonymous memory is never touched here. Linux only (elsewhere nothing is released).

    read_only_file_maps()              (start, end) of this process's read-only file mappings
    release_file_pages(tensors, files) drop the whole pages of `tensors` that lie in those mappings
"""

from __future__ import annotations

MADV_DONTNEED = 4  # Linux's madvise advice: drop these pages from the process (a file's come back from it)


def read_only_file_maps() -> list[tuple[int, int]]:
    """(start, end) of each of this process's read-only mappings of a file (/proc/self/maps); [] off Linux."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    files = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and "w" not in fields[1] and fields[4] != "0":
            start, end = (int(v, 16) for v in fields[0].split("-"))
            files.append((start, end))
    return files


def release_file_pages(tensors, files: list[tuple[int, int]] | None = None) -> int:
    """Drop from this process's resident memory the whole pages of `tensors` that lie in read-only file
    mappings (`files`, by default read_only_file_maps(): the memory-mapped GGUF whose blocks were just
    copied elsewhere, read once to do it). If anything reads them again, the kernel maps them again from
    the file, so no value can change; memory that is not such a mapping is left alone. Returns the bytes
    released (0 off Linux)."""
    import ctypes
    import mmap

    files = read_only_file_maps() if files is None else files
    if not files:
        return 0
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError, TypeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page, released = mmap.PAGESIZE, 0
    for t in tensors:
        first, size = t.data_ptr(), t.numel() * t.element_size()
        if not any(start <= first and first + size <= end for start, end in files):
            continue
        lo, hi = -(-first // page) * page, (first + size) // page * page  # whole pages only: a neighbour's stay
        if hi > lo and madvise(lo, hi - lo, MADV_DONTNEED) == 0:
            released += hi - lo
    return released
