"""One spelling for every dtype name: 'bf16', 'torch.float16', a torch.dtype → bfloat16, float16, ..."""

from __future__ import annotations

_DTYPE_ALIASES = {
    "fp32": "float32", "f32": "float32", "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16", "f16": "float16", "half": "float16",
    "float8": "fp8", "fp8_e5m2": "fp8", "float8_e5m2": "fp8", "float8_e4m3fn": "fp8_e4m3",
}


def canonical_dtype(name: object) -> str:
    """Normalise a dtype name ('bf16', 'torch.float16', a torch.dtype) to this module's spelling."""
    text = str(name).strip().lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(text, text)
