"""Where a model description comes from: load_config() for every kind of argument the user can give.

In order: an already-parsed config (dict), an existing path (config.json, a Hugging Face directory,
a .gguf file, a .safetensors file next to its config.json), a bundled config's short name, and last a
name from kvlab's model registry (resolved to a pulled .gguf by kvlab.hub, when that module exists).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections import defaultdict
from pathlib import Path

from kvlab.config.hf import config_from_hf
from kvlab.config.model import FileWeights, ModelConfig
from kvlab.errors import KvlabError

MAX_HEADER_BYTES = 100 * 2**20  # a safetensors JSON header larger than this is not a real header


def bundled_dir() -> Path:
    """The folder of config.json files shipped inside the package (kvlab/configs)."""
    return Path(__file__).resolve().parent.parent / "configs"


def bundled_names() -> list[str]:
    """Short names of the bundled configs: qwen3-0.6b, deepseek-v3, gpt-oss-20b, ..."""
    return sorted(p.stem for p in bundled_dir().glob("*.json"))


def load_config(source: str | Path | dict, *, name: str | None = None) -> ModelConfig:
    """Describe a model layer by layer from a dict, a path, a bundled name or a registry name.

    A dict is an already-parsed config.json (a transformers config object works too, through its
    to_dict()). Errors are KvlabError with one line saying what to fix.
    """
    if not isinstance(source, (str, Path, dict)) and callable(getattr(source, "to_dict", None)):
        source = source.to_dict()
    if isinstance(source, dict):
        label = name or str(source.get("_name_or_path") or source.get("model_type") or "config")
        return config_from_hf(source, name=label, source=f"config dict ({label})")
    text = str(source)
    path = Path(text).expanduser()
    if path.exists():
        return _from_path(path, name)
    if text in bundled_names():
        file = bundled_dir() / f"{text}.json"
        return config_from_hf(read_json(file), name=name or text, source=f"bundled config {file.name}")
    if "/" in text or text.endswith((".json", ".gguf", ".safetensors")):
        raise KvlabError(f"no such file or directory: {text}")
    return _from_registry(text, name)


def read_json(path: Path) -> dict:
    """Parse a JSON file; the bare Infinity/NaN tokens some configs carry (Nemotron-H) are accepted."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise KvlabError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise KvlabError(f"{path}: cannot read it ({e})") from None
    if not isinstance(data, dict):
        raise KvlabError(f"{path}: a config must be a JSON object, not {type(data).__name__}")
    return data


def _from_path(path: Path, name: str | None) -> ModelConfig:
    if path.is_dir():
        return _from_directory(path, name)
    suffix = path.suffix.lower()
    if suffix == ".gguf":
        from kvlab.config.gguf import config_from_gguf
        from kvlab.gguf_file import GGUFFile

        return config_from_gguf(GGUFFile(path), name=name)
    if suffix == ".safetensors" or path.name.endswith(".safetensors.index.json"):
        return _from_directory(path.parent, name)
    if suffix == ".json":
        return config_from_hf(read_json(path), name=name or _default_name(path), source=str(path))
    raise KvlabError(f"{path}: not a config.json, .gguf, .safetensors or model directory")


def _default_name(path: Path) -> str:
    return path.parent.name if path.name == "config.json" and path.parent.name else path.stem


def _from_directory(folder: Path, name: str | None) -> ModelConfig:
    """A Hugging Face directory: config.json, plus exact weight bytes from any safetensors headers."""
    config = folder / "config.json"
    if not config.exists():
        ggufs = sorted(folder.glob("*.gguf"))
        if len(ggufs) == 1:
            return _from_path(ggufs[0], name)
        raise KvlabError(f"{folder}: no config.json in this directory")
    described = config_from_hf(read_json(config), name=name or folder.name, source=str(config))
    weights = safetensors_weights(folder)
    if weights is None:
        return described
    return dataclasses.replace(described, file_weights=weights)


def safetensors_weights(folder: Path) -> FileWeights | None:
    """Exact tensor bytes of the safetensors in a folder (sharded index supported), from headers only."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        data = read_json(index)
        shards = sorted(set((data.get("weight_map") or {}).values()))
        missing = [s for s in shards if not (folder / s).exists()]
        if missing:
            total = (data.get("metadata") or {}).get("total_size")
            if isinstance(total, int) and total > 0:  # the index states the byte count of all shards
                return FileWeights(path=str(index), tensor_bytes=total, num_elements=0, bytes_by_type=())
            raise KvlabError(f"{index}: shard {missing[0]} is missing and the index has no total_size")
        files = [folder / s for s in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    by_type: dict[str, int] = defaultdict(int)
    elements = 0
    for file in files:
        for dtype, nbytes, count in _safetensors_tensors(file):
            by_type[dtype] += nbytes
            elements += count
    return FileWeights(
        path=str(index if index.exists() else files[0] if len(files) == 1 else folder),
        tensor_bytes=sum(by_type.values()),
        num_elements=elements,
        bytes_by_type=tuple(sorted(by_type.items(), key=lambda kv: -kv[1])),
        file_bytes=sum(f.stat().st_size for f in files),
    )


def _safetensors_tensors(file: Path):
    """Yield (dtype, bytes, elements) per tensor from a .safetensors header (8-byte length + JSON)."""
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_HEADER_BYTES:
                raise ValueError(f"header length {length} is implausible")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as e:
        raise KvlabError(f"{file}: not a readable safetensors file ({e})") from None
    for key, info in header.items():
        if key == "__metadata__":
            continue
        start, end = info["data_offsets"]
        count = 1
        for dim in info["shape"]:
            count *= dim
        yield info["dtype"], end - start, count


def _from_registry(text: str, name: str | None) -> ModelConfig:
    """A registry name: kvlab.hub resolves it to a pulled .gguf (the hub may not exist yet)."""
    hint = f"unknown model {text!r}: not a file, not a bundled config (kvlab mem --list)"
    try:
        from kvlab import hub

        resolve = hub.resolve_model
    except (ImportError, AttributeError):
        raise KvlabError(hint) from None
    try:
        path = resolve(text)
    except KvlabError:
        if text in getattr(hub, "REGISTRY", ()):
            raise  # a registry model that is not pulled: the hub's message says what to run
        known = getattr(hub, "known_names", None)
        raise KvlabError(f"{hint}, nor a registry name" + (f" ({known()})" if known else "")) from None
    return _from_path(Path(path), name or text)
