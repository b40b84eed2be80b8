"""Which KV format to size when the user says "auto": the one an engine really keeps.

    served engine   the formats its cache was built with (`kvlab serve`'s calculator, "served" config)
    kvlab run       what `kvlab run MODEL` would choose with its defaults (--device cpu, --dtype auto,
                    --kv-cache-dtype auto): the engine's own rule, called, not restated

A GGUF file says nothing of its cache, and the calculator's library-level "auto" is the config's dtype
(f16 for GGUF, llama.cpp's default cache type); kvlab's engine on a CPU keeps float32. These helpers
let `kvlab mem` and the page size the cache the engine holds. torch is imported only when a format
must be resolved, never when this module is.
"""

from __future__ import annotations

from kvlab.config import ModelConfig

RUN_DEVICE = "cpu"  # `kvlab run`'s --device default (generate_cli.py)
SERVED_REASON = "the format the served engine's cache holds"


def engine_kv_dtype(formats) -> str:
    """A cache's `KVFormats` (kv/formats.py) as the calculator names it: 'float32', or 'q8_0:q4_0' when
    keys and values differ. Rotation moves no byte, so it is not part of the name."""
    k, v = formats.k.name, formats.v.name
    return k if k == v else f"{k}:{v}"


def run_kv_dtype(spec: ModelConfig, device: str = RUN_DEVICE) -> str:
    """The KV format `kvlab run` keeps for this model on `device` with its default flags."""
    import torch

    from kvlab.config.engine import EngineConfig
    from kvlab.kv.formats import KVFormats
    from kvlab.model.auto_dtype import auto_dtype

    engine = EngineConfig()  # the defaults `kvlab run` passes when no KV flag is given
    dtype = getattr(torch, auto_dtype(spec, torch.device(device)))  # a name from auto_dtype.FLOAT_DTYPES
    formats = KVFormats.resolve(engine.kv_cache_dtype, engine.cache_type_k, engine.cache_type_v, dtype,
                                engine.kv_rotation)  # fmt: skip
    return engine_kv_dtype(formats)


def runs_as_is(spec: ModelConfig) -> bool:
    """Whether `kvlab run` could load this description: it comes with weights (a GGUF file, a checkpoint
    directory), not a bare config.json or a bundled config."""
    return spec.file_weights is not None


def fill_auto(kv_dtype: str, auto: str) -> str:
    """`kv_dtype` ('auto', 'q8_0', 'q8_0:auto', ...) with each 'auto' side (K, V) taken from `auto`'s same side."""
    k, sep, v = kv_dtype.partition(":")
    v = v if sep else k  # one name: both sides
    auto_k, sep, auto_v = auto.partition(":")
    auto_v = auto_v if sep else auto_k
    k, v = (auto_k if _is_auto(k) else k), (auto_v if _is_auto(v) else v)
    return k if k == v else f"{k}:{v}"


def has_auto(kv_dtype: str) -> bool:
    """Whether keys or values are left to 'auto'."""
    return any(_is_auto(side) for side in kv_dtype.split(":"))


def _is_auto(name: str) -> bool:
    return name.strip().lower() == "auto"
