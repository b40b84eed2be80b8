"""Units: byte sizes (parse and print) and the storage width of every number format.

Widths are exact fractions of bits per stored number, so sizes stay exact integers until the very end
(`ceil_bytes`). GiB = 2**30 bytes, GB = 10**9 bytes, and the printed form always names which.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from kvlab.config.dtypes import canonical_dtype  # noqa: F401  (part of this module's API)
from kvlab.errors import KvlabError

KIB, MIB, GIB, TIB = 2**10, 2**20, 2**30, 2**40

# --- KV-cache element types: bits per cached number -------------------------------------------------
# Plain storage widths. int8/int4 and fp8 assume the engine keeps its scales elsewhere (a few bytes per
# block or per tensor, not counted: vLLM's fp8); q8_0/q4_0 are llama.cpp's cache types with their
# per-32 fp16 scale included; kvlab's fp8_e4m3 adds one float32 scale to every head's vector.
KV_DTYPE_BITS: dict[str, Fraction] = {
    "float32": Fraction(32),
    "bfloat16": Fraction(16),
    "float16": Fraction(16),
    "fp8": Fraction(8),
    "fp8_e4m3": Fraction(8),
    "int8": Fraction(8),
    "int4": Fraction(4),
    "q8_0": Fraction(34 * 8, 32),
    "q4_0": Fraction(18 * 8, 32),
}


KV_VECTOR_SCALE_BYTES: dict[str, int] = {"fp8_e4m3": 4}  # bytes of scale per vector (one head, one token)


def kv_vector_scale_bytes(name: object) -> int:
    """Bytes of scale a KV format stores with every vector of head_dim numbers (0 for most)."""
    return KV_VECTOR_SCALE_BYTES.get(canonical_dtype(name), 0)


# --- GGUF block types: (numbers per block, bytes per block), as in ggml's type traits ------------------
GGUF_BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2),
    "Q8_0": (32, 34),   # 32 int8 + fp16 scale                        -> 8.5 bits
    "Q4_0": (32, 18),   # 32 nibbles + fp16 scale                     -> 4.5
    "Q4_1": (32, 20),   # 32 nibbles + fp16 scale + fp16 min          -> 5.0
    "Q5_0": (32, 22),   # 32 nibbles + 32 high bits + fp16 scale      -> 5.5
    "Q5_1": (32, 24),   # ... + fp16 min                              -> 6.0
    "Q2_K": (256, 84),  # super-block of 256                          -> 2.625
    "Q3_K": (256, 110),  #                                            -> 3.4375
    "Q4_K": (256, 144),  # 6-bit sub-block scales and mins            -> 4.5
    "Q5_K": (256, 176),  #                                            -> 5.5
    "Q6_K": (256, 210),  #                                            -> 6.5625
    "Q8_K": (256, 292),  #                                            -> 9.125
}

# --- weight formats: bits per parameter ---------------------------------------------------------------
WEIGHT_FORMAT_BITS: dict[str, Fraction] = {
    "float32": Fraction(32),
    "bfloat16": Fraction(16),
    "float16": Fraction(16),
    "fp8": Fraction(8),                       # one scale per tensor: negligible
    "fp8_e4m3": Fraction(8),
    "fp8-block128": 8 + Fraction(32, 128 * 128),  # DeepSeek-V3: fp32 scale per 128x128 block
    "int8": Fraction(8),                      # per-channel scales: negligible
    "int4": 4 + Fraction(16, 128),            # group 128, fp16 scale           -> 4.125
    "int4-g64": 4 + Fraction(16, 64),         #                                 -> 4.25
    "int4-g32": 4 + Fraction(16, 32),         #                                 -> 4.5
    "mxfp4": 4 + Fraction(8, 32),             # 32 e2m1 values + one e8m0 scale -> 4.25
    "nvfp4": 4 + Fraction(8, 16),             # 16 e2m1 values + one fp8 scale  -> 4.5
}
WEIGHT_FORMAT_BITS.update({name.lower(): Fraction(b * 8, n) for name, (n, b) in GGUF_BLOCKS.items()})

# GGUF "file types" are mixes of several block types: no single width describes them
_GGUF_MIXES = re.compile(r"^q\d_k_(s|m|l|xs|xl)$|^iq\d")


def kv_dtype_bits(name: object) -> Fraction:
    """Bits per cached number for a KV dtype name; KvlabError names the choices when unknown."""
    key = canonical_dtype(name)
    if key not in KV_DTYPE_BITS:
        raise KvlabError(f"unknown KV dtype {name!r}: choose one of {', '.join(KV_DTYPE_BITS)}")
    return KV_DTYPE_BITS[key]


def weight_format_bits(name: str) -> Fraction:
    """Bits per parameter for a weight format: a name (bfloat16, int4, q4_k, ...) or a number of bits.

    A bare number such as "4" or "4.5bpw" means that many bits per parameter, scales included.
    """
    key = canonical_dtype(name)
    if key in WEIGHT_FORMAT_BITS:
        return WEIGHT_FORMAT_BITS[key]
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(?:bpw|bits?)?", key)
    if match:
        bits = Fraction(match.group(1))
        if not 0 < bits <= 64:
            raise KvlabError(f"weight format {name!r}: bits per weight must be in (0, 64]")
        return bits
    if _GGUF_MIXES.match(key):
        raise KvlabError(
            f"weight format {name!r} is a GGUF mix of several block types with no single width: "
            "give the .gguf file for exact bytes, or one block type such as q4_k (4.5 bits)"
        )
    raise KvlabError(
        f"unknown weight format {name!r}: choose one of {', '.join(WEIGHT_FORMAT_BITS)}, "
        "or a number of bits per weight such as 4.5"
    )


def ceil_bytes(bits: Fraction | int) -> int:
    """Bytes needed to hold a number of bits (rounded up to a whole byte)."""
    return math.ceil(Fraction(bits) / 8)


_SIZE_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": KIB, "mib": MIB, "gib": GIB, "tib": TIB,
}
MAX_DEVICE_BYTES = 2**50  # 1 PiB: anything larger is a typo


def parse_size(text: str) -> int:
    """Parse '80GiB', '80 GB', '512MiB' or '1.5TiB' into bytes; the unit is required (GiB vs GB)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise KvlabError(
            f"cannot read the size {text!r}: write a number and a unit, e.g. 80GiB (2^30 bytes) or 80GB (10^9)"
        )
    value = Fraction(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    if not 0 < value <= MAX_DEVICE_BYTES:
        raise KvlabError(f"size {text!r} is out of range (more than 0, at most 1 PiB)")
    return math.floor(value)


def fmt_bytes(n: int | None) -> str:
    """Human form of a byte count in binary units: '4.375 GiB', '112 KiB', '0 B'."""
    if n is None:
        return "-"
    for unit, size in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            return f"{_trim(n / size)} {unit}"
    return f"{n} B"


def fmt_gb(n: int | None) -> str:
    """Decimal form of a byte count in the largest fitting unit: '4.70 GB', '115 kB'."""
    if n is None:
        return "-"
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n} B"


def fmt_count(n: int | None) -> str:
    """A large count in words: 596.0M, 671.0B."""
    if n is None:
        return "-"
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if abs(n) >= size:
            return f"{n / size:,.1f}{unit}"
    return str(n)


def _trim(x: float) -> str:
    """Up to three decimals, trailing zeros dropped: 4.375, 112, 1.5."""
    return f"{x:,.3f}".rstrip("0").rstrip(".")
