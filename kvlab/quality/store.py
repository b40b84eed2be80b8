"""Measured quality kept per model and setting, and the one line `kvlab run` / `serve` print about it.

    $KVLAB_HOME/quality/<model>.json   {"model": path, "results": {"<setting> @ <text>": {...}}}

A setting's key names the formats of keys and values ("float" for any float format: float32 against
bfloat16 storage is not what the guard is about) and how the weights were held, so `kvlab run
--kv-cache-dtype q4_0` finds what `kvlab quality --kv-cache-dtype q4_0` measured on the same file.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from kvlab.kv.formats import KVFormat, KVFormats


def weights_name(dequantize: bool = False, quantization: str | None = None, activation_quant: str | None = None) -> str:
    name = f"{quantization} at load" if quantization else "dequantized" if dequantize else "as stored"
    if not activation_quant:
        return name
    from kvlab.quant.activations import setting_name

    return f"{name}, {setting_name(activation_quant)}"


def _fmt(f: KVFormat) -> str:
    return f.name if f.is_quantized else "float"


def setting_key(formats: KVFormats, weights: str) -> str:
    k = _fmt(formats.k) + (" rotated" if formats.rotate_k and formats.k.is_quantized else "")
    v = _fmt(formats.v) + (" rotated" if formats.rotate_v and formats.v.is_quantized else "")
    return f"K {k} V {v}, weights {weights}"


def _model_file(model_path: Path) -> Path:
    from kvlab.hub import kvlab_home

    p = Path(model_path).resolve()
    size = p.stat().st_size if p.is_file() else 0
    digest = hashlib.sha1(f"{p}|{size}".encode()).hexdigest()[:12]
    return kvlab_home() / "quality" / f"{p.name}-{digest}.json"


def load(model_path: Path) -> dict:
    path = _model_file(model_path)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"model": str(model_path), "results": {}}


def save(model_path: Path, key: str, text_digest: str, record: dict) -> Path:
    """Keep one measurement (written whole through a temporary file: never half a file)."""
    data = load(model_path)
    data["results"][f"{key} @ {text_digest}"] = {**record, "key": key, "measured": time.strftime("%Y-%m-%d %H:%M")}
    path = _model_file(model_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)
    return path


def lookup(model_path: Path, key: str) -> dict | None:
    """The newest measurement of this setting on this model (any text), or None."""
    found = [r for r in load(model_path)["results"].values() if r.get("key") == key]
    return max(found, key=lambda r: r.get("measured", "")) if found else None


def advice(model_arg: str, model_path: Path, formats: KVFormats, dequantize=False, quantization=None,
           activation_quant=None) -> str | None:  # fmt: skip
    """One line for a lossy setting: its measured verdict when worrying, how to measure it when none is
    kept; None for the model's own weights with a float cache and exact activations, or a measured `ok`."""
    if not formats.is_quantized and not quantization and not activation_quant:
        return None
    key = setting_key(formats, weights_name(dequantize, quantization, activation_quant))
    found = lookup(model_path, key)
    what = formats.description if formats.is_quantized else "float KV"
    if quantization:
        what += f", weights {quantization}"
    if activation_quant:
        what += f", {activation_quant} activations"
    if found is None:
        flags = (f"--cache-type-k {formats.k.name} --cache-type-v {formats.v.name}" if formats.k.name != formats.v.name
                 else f"--kv-cache-dtype {formats.k.name}" if formats.is_quantized else "")  # fmt: skip
        default = KVFormats.resolve(cache_type_k=formats.k.name, cache_type_v=formats.v.name)
        if formats.is_quantized and (formats.rotate_k, formats.rotate_v) != (default.rotate_k, default.rotate_v):
            flags += " --kv-rotation " + ("off" if not formats.rotate else "on")
        if quantization:
            flags += f" --quantization {quantization}"
        if activation_quant:
            flags += f" --activation-quant {activation_quant}"
        return (f"note: the quality of {what} on this model has not been measured; "
                f"`kvlab quality {model_arg} {flags.strip()}` measures it (KL divergence against float32 KV)")  # fmt: skip
    figures = f"mean KLD {found['mean_kld']:.4f}, same top token {100 * found['same_top_p']:.1f}%"
    if found["verdict"] == "unsafe":
        return f"warning: {what} measured unsafe on this model ({figures}): expect visibly worse answers"
    if found["verdict"] == "caution":
        return f"note: {what} measured 'caution' on this model ({figures})"
    return None
