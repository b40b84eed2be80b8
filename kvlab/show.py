"""`kvlab show MODEL`: what a model is, as `ollama show` tells it, read from the file alone (no weights).

Architecture, parameters, quantization, context, the layer geometry, the chat template, the file and
the licence: from a GGUF file's metadata and tensor directory, or from a Hugging Face folder's
config.json, tokenizer_config.json and README front matter.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from kvlab import hub
from kvlab.backends import expected_decode_path
from kvlab.errors import KvlabError


def model_facts(arg: str) -> dict[str, Any]:
    """Everything `kvlab show` prints, as a JSON-friendly dict (`kvlab show --json`)."""
    from kvlab.memory.weights import count_params

    path = Path(hub.resolve_model(arg))
    config, extra = _gguf(path) if path.is_file() else _folder(path)
    params = count_params(config)
    try:
        attention = config.attention
    except ValueError:  # no softmax attention at all (a Mamba model, or DeepSeek's latent attention)
        attention = None
    latent = next((layer.mixer for layer in config.layers if layer.mixer is not None and layer.mixer.kind == "mla"),
                  None)  # fmt: skip
    facts = {
        "name": arg,
        "description": hub.REGISTRY[arg].description if arg in hub.REGISTRY else extra.pop("title", None),
        "architecture": config.architecture,
        "parameters": params.total if params else None,
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "layers": config.num_layers,
        "attention_heads": attention.num_heads if attention else latent.num_heads if latent else None,
        "latent_size": latent.kv_lora_rank + latent.qk_rope_head_dim if latent else None,  # MLA: numbers cached
        "kv_heads": attention.kv_heads if attention else None,
        "head_dim": attention.head_dim if attention else None,
        "vocab_size": config.vocab_size,
        "rope_theta": config.rope.theta,
        "path": str(path),
        "file_bytes": _bytes_on_disk(path),
        "sha256": hub.REGISTRY[arg].sha256 if arg in hub.REGISTRY else None,
        **expected_decode_path(config).to_dict(),  # on a CPU: the C step, or the modules and why
    }
    facts.update(extra)
    return facts


def _gguf(path: Path) -> tuple[Any, dict]:
    import gguf

    from kvlab.config.gguf import config_from_gguf
    from kvlab.gguf_file import GGUFFile

    file = GGUFFile(path)
    meta = file.metadata
    types = Counter(info.type_name for info in file.tensors.values())
    try:
        file_type = gguf.LlamaFileType(int(meta["general.file_type"])).name.removeprefix("MOSTLY_")
    except (KeyError, ValueError):
        file_type = None
    return config_from_gguf(file), {
        "title": meta.get("general.name"),
        "format": "gguf",
        "quantization": file_type or types.most_common(1)[0][0],
        "tensor_types": dict(types.most_common()),
        "chat_template": meta.get("tokenizer.chat_template"),
        "license": meta.get("general.license") or meta.get("general.license.name"),
    }


def _folder(path: Path) -> tuple[Any, dict]:
    from kvlab.config import load_config

    config = load_config(path)
    weights = config.file_weights
    tokenizer_config = path / "tokenizer_config.json"
    template = None
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    elif tokenizer_config.is_file():
        template = json.loads(tokenizer_config.read_text()).get("chat_template")
    return config, {
        "title": path.name,
        "format": "safetensors",
        "quantization": config.quantization.name if config.quantization else config.dtype,
        "tensor_types": dict(weights.bytes_by_type) if weights else {},
        "chat_template": template if isinstance(template, str) else None,
        "license": _readme_license(path / "README.md"),
    }


def _readme_license(readme: Path) -> str | None:
    """`license:` of a model card's YAML front matter."""
    if not readme.is_file():
        return None
    front = re.match(r"---\n(.*?)\n---", readme.read_text(errors="replace"), re.S)
    found = re.search(r"^license:\s*(\S+)", front.group(1), re.M) if front else None
    return found.group(1) if found else None


def _bytes_on_disk(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def render(facts: dict[str, Any], template_lines: int = 6) -> str:
    """The facts in ollama's sections: Model, File, Template (its first lines), License."""
    heads = f"{facts['attention_heads']} ({facts['kv_heads']} KV heads, head dim {facts['head_dim']})"
    if facts.get("latent_size"):
        heads = f"{facts['attention_heads']} (latent attention: one latent of {facts['latent_size']} numbers cached)"
    model = [
        ("architecture", facts["architecture"]),
        ("parameters", short_count(facts["parameters"]) if facts["parameters"] else "unknown"),
        ("quantization", facts["quantization"]),
        ("context length", f"{facts['context_length']:,}" if facts["context_length"] else "unknown"),
        ("embedding length", f"{facts['embedding_length']:,}"),
        ("layers", facts["layers"]),
        ("attention heads", heads if facts["attention_heads"] else "none"),
        ("vocabulary", f"{facts['vocab_size']:,}" if facts["vocab_size"] else "unknown"),
        ("decode on a CPU", "the C step (kvlab/backends/cpu.py)" if not facts["decode_path_reason"]
         else f"the PyTorch modules: {facts['decode_path_reason']}"),
    ]
    file = [("path", facts["path"]), ("size", f"{facts['file_bytes'] / 1e6:.1f} MB"), ("format", facts["format"])]
    if facts["tensor_types"]:
        unit = " tensors" if facts["format"] == "gguf" else " bytes"
        file.append(("tensor types", ", ".join(f"{n:,} {t}" for t, n in facts["tensor_types"].items()) + unit))
    if facts["sha256"]:
        file.append(("sha256", facts["sha256"]))
    width = max(len(k) for k, _ in model + file)
    sections = [f"  {facts['description']}" if facts["description"] else "", _section("Model", model, width),
                _section("File", file, width)]  # fmt: skip
    template = facts["chat_template"]
    if template:
        lines = template.strip().splitlines()
        shown = [f"    {line}" for line in lines[:template_lines]]
        if len(lines) > template_lines:
            shown.append(f"    … {len(lines) - template_lines} more lines (`kvlab show {facts['name']} --template`)")
        sections.append("  Template\n" + "\n".join(shown))
    else:
        sections.append("  Template\n    none (no chat template: `kvlab run` with a raw prompt)")
    sections.append(f"  License\n    {facts['license'] or 'not stated in the file'}")
    return "\n\n".join(s for s in sections if s) + "\n"


def _section(title: str, rows: list[tuple[str, Any]], width: int) -> str:
    return f"  {title}\n" + "\n".join(f"    {k.ljust(width)}    {v}" for k, v in rows)


def short_count(n: int) -> str:
    """Parameters as ollama writes them: 134,515,008 → 134.5M; 1,543,714,304 → 1.5B."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def require_template(facts: dict[str, Any]) -> str:
    if not facts["chat_template"]:
        raise KvlabError(f"{facts['name']} has no chat template")
    return facts["chat_template"]
