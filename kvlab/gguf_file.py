"""The one reader of GGUF files: metadata, tensor directory, and tensors dequantized on demand.

`gguf.GGUFReader` builds one numpy view per array element and takes ~17 s to open a file with a
151k-token vocabulary; this reader parses the header with `struct` (well under a second) and maps
the tensor data lazily. Dequantization itself is the `gguf` package's.

Layout (GGUF v2/v3): magic "GGUF", version u32, tensor count u64, metadata count u64, then the
metadata key/values, then per tensor (name, n_dims u32, dims u64[n] (innermost first), type u32,
offset u64), then the tensor data from the next multiple of `general.alignment` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvlab.errors import KvlabError

# metadata value types → (struct format, numpy dtype) for scalars
_SCALARS = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # PyTorch order: outermost first ([rows, cols] for a matrix)
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        """GGML type: F32, F16, Q4_K, ..."""
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.ggml_type).name

    @property
    def num_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class GGUFFile:
    """Metadata and tensor directory of one .gguf file; tensor bytes are read only when asked."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise KvlabError(f"no such file: {self.path}")
        if self.path.stat().st_size == 0:
            raise KvlabError(f"{self.path} is empty (truncated to 0 bytes); pull or download it again")
        try:
            # a plain ndarray view of the map: slicing np.memmap objects costs a Python hook per slice
            self._map = np.asarray(np.memmap(self.path, dtype=np.uint8, mode="r"))
        except (OSError, ValueError) as e:  # empty or unreadable
            raise KvlabError(f"cannot read {self.path} as GGUF ({e}); pull or download it again") from None
        try:
            with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as header:
                self.metadata, self.tensors = _parse(header)  # mmap slices are bytes: fast to decode
        except TruncatedHeader as e:
            raise KvlabError(f"{self.path} is truncated: {e}; pull or download it again") from None
        except (struct.error, UnicodeDecodeError, ValueError, IndexError, MemoryError) as e:
            raise KvlabError(f"{self.path} is not a valid GGUF file ({e}); pull or download it again") from None
        end = max((t.offset + t.nbytes for t in self.tensors.values()), default=0)
        if end > len(self._map):
            raise KvlabError(
                f"{self.path} is truncated: tensor data needs {end:,} bytes, the file has "
                f"{len(self._map):,}; pull or download it again"
            )

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored: uint8 [rows..., bytes per row]."""
        info = self.tensors[name]
        data = self._map[info.offset : info.offset + info.nbytes]
        return data.reshape(*info.shape[:-1], -1) if len(info.shape) > 1 else data

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as float32 numpy, in PyTorch's shape order."""
        from gguf import GGMLQuantizationType, quants

        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.ggml_type)
        if qtype == GGMLQuantizationType.BF16:
            raw = self.raw(name).view(np.uint16).astype(np.uint32) << 16
            return raw.view(np.float32).reshape(info.shape)
        try:
            return quants.dequantize(self.raw(name), qtype).reshape(info.shape)
        except NotImplementedError:
            raise KvlabError(f"GGUF tensor type {qtype.name} ({name}) cannot be dequantized yet") from None


class TruncatedHeader(ValueError):
    """The header runs past the end of the file: a download or copy cut short."""


def _parse(buf: mmap.mmap) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    if not b"GGUF".startswith(buf[:4]):  # a file of 1-3 bytes may be the start of the magic
        raise ValueError("bad magic: not a GGUF file")
    reader = _Reader(buf, 0)
    _, version, num_tensors, num_kv = reader.unpack("<4sIQQ")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported")
    if num_tensors > 1_000_000 or num_kv > 1_000_000:
        raise ValueError("absurd tensor or metadata count")
    metadata = {}
    for _ in range(num_kv):
        key = reader.string()
        metadata[key] = reader.value(reader.u32())
    infos = []
    for _ in range(num_tensors):
        name = reader.string()
        n_dims = reader.u32()
        if n_dims > 8:
            raise ValueError(f"tensor {name} has {n_dims} dimensions")
        dims = reader.unpack(f"<{n_dims}Q")
        ggml_type, offset = reader.unpack("<IQ")
        infos.append((name, tuple(reversed(dims)), ggml_type, offset))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-reader.pos // alignment) * alignment
    tensors = {}
    for name, shape, ggml_type, offset in infos:
        tensors[name] = TensorInfo(name, shape, ggml_type, data_start + offset, _nbytes(name, shape, ggml_type))
    return metadata, tensors


def _nbytes(name: str, shape: tuple[int, ...], ggml_type: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ValueError(f"tensor {name} has unknown GGML type {ggml_type}") from None
    return int(np.prod(shape, dtype=np.int64)) // block_size * type_size


class _Reader:
    """Sequential reader over the header bytes."""

    def __init__(self, buf: mmap.mmap, pos: int):
        self.buf, self.pos = buf, pos

    def need(self, num_bytes: int) -> None:
        """TruncatedHeader unless `num_bytes` more bytes follow the position."""
        if self.pos + num_bytes > len(self.buf):
            raise TruncatedHeader(f"its header runs past the end of the file ({len(self.buf):,} bytes)")

    def unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        self.need(size)
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return values

    def u32(self) -> int:
        return self.unpack("<I")[0]

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        self.need(length)
        start = self.pos
        self.pos += length
        return self.buf[start : self.pos].decode("utf-8")

    def strings(self, count: int) -> list[str]:
        """An array of strings (a vocabulary: 150k of them), read in one tight loop."""
        raw, pos, unpack = self.buf, self.pos, struct.Struct("<Q").unpack_from
        out = []
        try:
            for _ in range(count):
                (length,) = unpack(raw, pos)
                pos += 8
                out.append(raw[pos : pos + length].decode("utf-8"))
                pos += length
        except struct.error:  # no room for the next length
            self.pos = pos
            self.need(8)
            raise
        except UnicodeDecodeError:  # a string cut short (or not UTF-8)
            self.pos = pos
            self.need(length)
            raise
        self.pos = pos
        self.need(0)  # the last string ran past the end
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            elem_type = self.u32()
            (count,) = self.unpack("<Q")
            if elem_type == _STRING:
                return self.strings(count)
            if elem_type in _SCALARS:
                dtype = np.dtype(_SCALARS[elem_type][1])
                self.need(count * dtype.itemsize)
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * dtype.itemsize
                return arr.tolist()
            return [self.value(elem_type) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.unpack(_SCALARS[vtype][0])[0]
