"""How the KV cache stores one head's vector of head_dim numbers: floats, or quantized with its scales.

    float32 / bfloat16 / float16   the numbers as that dtype
    q8_0    blocks of 32 along head_dim: int8 codes and one fp16 scale d = max|x| / 127 each (34 bytes
            per 32 values, llama.cpp's block); x ≈ d · q
    q4_0    blocks of 32: 4-bit codes and one fp16 scale d = x_m / −8, x_m the value of largest |x|
            (18 bytes per 32); x ≈ d · (q − 8)
    fp8_e4m3  float8 e4m3 numbers and one float32 scale per vector, amax / 448 from the vector itself
            (not 1.0: a cache written in raw fp8 loses the small values of heads whose range is small)

A quantized format may be *rotated* (llama.cpp does it by default since 2026, PR #21038): each
vector is multiplied by an orthonormal Hadamard matrix H before it is quantized and by H again
after it is decoded (H·H = I). Rotation spreads a few large channels over all of them, so a block's
scale no longer drowns its small values; attention sees the same numbers, less the rounding.

A format turns vectors [..., D] into its storage tensors ([..., D] codes, [..., D / 32] scales, ...)
and back. The caches allocate each storage tensor with their own leading dimensions, quantize on
write and dequantize on read; `tensors()` lists the scales too, so block copies and zeroing move a
block's scales with its codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.config.engine import KV_CACHE_DTYPES, KV_ROTATIONS
from kvlab.errors import KvlabError

QBLOCK = 32
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


@dataclass(frozen=True)
class KVFormat:
    name: str

    def storage(self, head_dim: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Each storage tensor's trailing shape and dtype for one vector of `head_dim` numbers."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Vectors x [..., D] (any float dtype) → the storage tensors' values [..., *trailing]."""
        raise NotImplementedError

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Storage values → vectors [..., D] in `dtype`."""
        raise NotImplementedError

    def bytes_per_vector(self, head_dim: int) -> int:
        return sum(_numel(shape) * torch.empty(0, dtype=dtype).element_size() for shape, dtype in self.storage(head_dim))

    @property
    def is_quantized(self) -> bool:
        return True

    # 'auto' rotates the integer block formats only. Their step is uniform within a block, so one large
    # channel coarsens its 31 neighbours, and rotation evens the blocks out. A float8 number keeps its
    # precision relative to its own size; rotation would add a share of the large channel to every other
    # one and drown them (measured: Qwen2.5-Coder-0.5B's fp8 KV, mean KLD 0.011 plain, 0.13 rotated).
    rotate_by_default = False


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % QBLOCK:
        raise KvlabError(f"a q8_0 / q4_0 KV cache needs head_dim in whole blocks of {QBLOCK}, got {x.shape[-1]}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // QBLOCK, QBLOCK)


@dataclass(frozen=True)
class FloatFormat(KVFormat):
    dtype: torch.dtype = torch.float32

    def storage(self, head_dim):
        return [((head_dim,), self.dtype)]

    def encode(self, x):
        return [x.to(self.dtype)]

    def decode(self, parts, dtype):
        return parts[0].to(dtype)

    @property
    def is_quantized(self) -> bool:
        return False


def _whole_blocks(head_dim: int, name: str) -> int:
    """Blocks of QBLOCK values in one head's vector; a KvlabError (at load, before any pool) when they do not tile it."""
    if head_dim % QBLOCK:
        raise KvlabError(f"a {name} KV cache needs head_dim in whole blocks of {QBLOCK}, got {head_dim}")
    return head_dim // QBLOCK


class Q8_0(KVFormat):
    rotate_by_default = True

    def storage(self, head_dim):
        return [((head_dim,), torch.int8), ((_whole_blocks(head_dim, self.name),), torch.float16)]

    def encode(self, x):
        b = _blocks(x)  # [..., D/32, 32]
        d = (b.abs().amax(dim=-1) / 127).to(torch.float16)  # the scale as stored: codes are made with it
        inv = torch.where(d == 0, 0.0, 1.0 / d.float())
        q = torch.round(b * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return [q.reshape(x.shape), d]

    def decode(self, parts, dtype):
        q, d = parts
        b = q.reshape(*q.shape[:-1], -1, QBLOCK).float() * d.float()[..., None]
        return b.reshape(q.shape).to(dtype)


class Q4_0(KVFormat):
    rotate_by_default = True

    def storage(self, head_dim):
        return [((head_dim // 2,), torch.uint8), ((_whole_blocks(head_dim, self.name),), torch.float16)]

    def encode(self, x):
        b = _blocks(x)
        at = b.abs().argmax(dim=-1, keepdim=True)
        d = (b.gather(-1, at)[..., 0] / -8).to(torch.float16)
        inv = torch.where(d == 0, 0.0, 1.0 / d.float())
        q = torch.trunc(b * inv[..., None] + 8.5).clamp(0, 15).to(torch.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)  # byte j: value j low, value j + 16 high (llama.cpp's order)
        return [packed.reshape(*x.shape[:-1], x.shape[-1] // 2), d]

    def decode(self, parts, dtype):
        packed, d = parts
        p = packed.reshape(*packed.shape[:-1], -1, QBLOCK // 2)
        q = torch.cat([p & 0x0F, p >> 4], dim=-1).to(torch.int8) - 8  # [..., D/32, 32]
        b = q.float() * d.float()[..., None]
        return b.reshape(*packed.shape[:-1], -1).to(dtype)


class FP8E4M3(KVFormat):
    # the codes are kept as their bytes (uint8): block zeroing and copies then need no float8 kernels,
    # which PyTorch's CPU build lacks for index_fill
    def storage(self, head_dim):
        return [((head_dim,), torch.uint8), ((1,), torch.float32)]

    def encode(self, x):
        xf = x.float()
        s = xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX
        s = torch.where(s == 0, torch.ones_like(s), s)
        return [(xf / s).to(torch.float8_e4m3fn).view(torch.uint8), s]

    def decode(self, parts, dtype):
        q, s = parts
        return (q.view(torch.float8_e4m3fn).float() * s).to(dtype)


def hadamard_size(head_dim: int) -> int:
    """The rotation's block: the largest power of two dividing head_dim (H is block-diagonal past it)."""
    return head_dim & -head_dim


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] · H in float32: the fast Walsh–Hadamard transform on each block of hadamard_size(D)
    values, then × 1/√n. H is Sylvester's matrix / √n: orthonormal and symmetric, so H·H = I. Done as
    butterflies rather than a matmul, each vector's result is the same bits whatever the batch's shape."""
    D = x.shape[-1]
    n = hadamard_size(D)
    y = x.float().reshape(-1, D // n, n)
    h = 1
    while h < n:
        pairs = y.view(y.shape[0], D // n, n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).view(y.shape)
        h *= 2
    return (y * torch.tensor(n**-0.5, dtype=torch.float32)).view(x.shape)


@dataclass(frozen=True)
class Rotated(KVFormat):
    """`base`'s storage of the vector rotated by H: encode x·H, decode (x·H)·H = x."""

    base: KVFormat = None

    def storage(self, head_dim):
        return self.base.storage(head_dim)

    def encode(self, x):
        return self.base.encode(hadamard(x))

    def decode(self, parts, dtype):
        return hadamard(self.base.decode(parts, torch.float32)).to(dtype)

    @property
    def is_quantized(self) -> bool:
        return self.base.is_quantized


def rotated(f: KVFormat) -> Rotated:
    return f if isinstance(f, Rotated) else Rotated(f.name, f)


def unrotated(f: KVFormat) -> KVFormat:
    return f.base if isinstance(f, Rotated) else f


KV_FORMATS: dict[str, KVFormat] = {
    "float32": FloatFormat("float32", torch.float32),
    "bfloat16": FloatFormat("bfloat16", torch.bfloat16),
    "float16": FloatFormat("float16", torch.float16),
    "fp8_e4m3": FP8E4M3("fp8_e4m3"),
    "q8_0": Q8_0("q8_0"),
    "q4_0": Q4_0("q4_0"),
}
_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16", "f16": "float16",
            "half": "float16", "float8_e4m3fn": "fp8_e4m3"}  # fmt: skip
assert set(KV_FORMATS) == set(KV_CACHE_DTYPES[1:]), "config/engine.py's list of --kv-cache-dtype choices"


def kv_format(name: str | None, model_dtype: torch.dtype) -> KVFormat:
    """The format `--kv-cache-dtype NAME` names ('auto': the activations' dtype); a KvlabError lists the choices."""
    key = str(name or "auto").strip().lower()
    key = _ALIASES.get(key, key)
    if key == "auto":
        return next(f for f in KV_FORMATS.values() if isinstance(f, FloatFormat) and f.dtype == model_dtype)
    if key not in KV_FORMATS:
        raise KvlabError(f"unknown KV cache dtype {name!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
    if key == "fp8_e4m3" and not hasattr(torch, "float8_e4m3fn"):
        raise KvlabError(f"--kv-cache-dtype fp8_e4m3 needs torch's float8_e4m3fn, which torch {torch.__version__} "
                         "lacks (2.1 or newer has it): use q8_0, the same bytes within 6%")  # fmt: skip
    return KV_FORMATS[key]


@dataclass(frozen=True)
class KVFormats:
    """The formats of keys and of values (llama.cpp's --cache-type-k / --cache-type-v)."""

    k: KVFormat
    v: KVFormat

    @classmethod
    def resolve(cls, kv_cache_dtype=None, cache_type_k=None, cache_type_v=None, model_dtype=torch.float32,
                rotation: str | bool = "auto") -> KVFormats:  # fmt: skip
        """--cache-type-k / -v where given, else --kv-cache-dtype for both, else the activations' dtype;
        each side rotated when its format is q8_0 or q4_0 ('auto'), always ('on') or never ('off')."""
        k = kv_format(cache_type_k or kv_cache_dtype, model_dtype)
        v = kv_format(cache_type_v or kv_cache_dtype, model_dtype)
        mode = {True: "on", False: "off"}.get(rotation, str(rotation).strip().lower())
        if mode not in KV_ROTATIONS:
            raise KvlabError(f"unknown KV rotation {rotation!r}: choose one of {', '.join(KV_ROTATIONS)}")
        if mode == "off":
            return cls(k, v)
        return cls(*(rotated(f) if mode == "on" or f.rotate_by_default else f for f in (k, v)))

    @classmethod
    def plain(cls, dtype: torch.dtype) -> KVFormats:
        return cls.resolve(model_dtype=dtype)

    @property
    def rotate_k(self) -> bool:
        """Keys are stored rotated by H (attention may rotate q instead of decoding them back)."""
        return isinstance(self.k, Rotated)

    @property
    def rotate_v(self) -> bool:
        """Values are stored rotated by H (attention may rotate its output instead)."""
        return isinstance(self.v, Rotated)

    @property
    def rotate(self) -> bool:
        return self.rotate_k or self.rotate_v

    @property
    def name(self) -> str:
        """'q8_0', 'K q8_0, V q4_0': the formats as --kv-cache-dtype / --cache-type-k/-v name them."""
        return self.k.name if self.k.name == self.v.name else f"K {self.k.name}, V {self.v.name}"

    @property
    def description(self) -> str:
        """The name, and which side is rotated: 'q8_0, rotated', 'K q8_0, V fp8_e4m3, K rotated'."""
        if self.rotate_k and self.rotate_v:
            return self.name + ", rotated"
        return self.name + (", K rotated" if self.rotate_k else ", V rotated" if self.rotate_v else "")

    @property
    def is_quantized(self) -> bool:
        return self.k.is_quantized or self.v.is_quantized
