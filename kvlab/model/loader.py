"""Open a model argument (registry name, .gguf file, or Hugging Face directory) as a ready model."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlab.config import ModelConfig, load_config, read_json
from kvlab.config.gguf import config_from_gguf
from kvlab.errors import KvlabError
from kvlab.gguf_file import GGUFFile
from kvlab.model.auto_dtype import auto_dtype
from kvlab.model.huge_pages import into_huge_pages
from kvlab.model.mla import join_kv_b
from kvlab.model.registry import architecture_of, check_architecture_name
from kvlab.model.transformer import Transformer
from kvlab.model.weights import from_gpt_oss, iter_gguf, iter_safetensors, load_weights
from kvlab.quant.quantize import QUANTIZATIONS
from kvlab.quant.transform import quantize_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    path: Path  # the .gguf file or the directory it came from
    load_s: float
    weight_format: str = ""  # how the matrices are held: 'float32', 'Q4_1 + Q8_0 (as stored)', ...
    gguf: GGUFFile | None = None  # the parsed file (its tokenizer is read from the same parse); LLM() lets it go

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights held in memory (a tied matrix counts once), as the layers report them."""
        return self.model.weight_bytes()

    def decode_weight_bytes(self) -> int:
        """Weight bytes one decode step streams, as the layers report them (see Transformer.decode_read_bytes)."""
        return self.model.decode_read_bytes()


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise KvlabError(f"unknown dtype '{name}': use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_source(source: str | Path) -> Path:
    """A registry name becomes the pulled file's path; a path must exist."""
    from kvlab.hub import resolve_model

    return Path(resolve_model(str(source)))


def load_model(
    source: str | Path,
    dtype="float32",
    device="cpu",
    max_positions: int | None = None,
    dequantize: bool = False,
    quantization: str | None = None,
    huge_pages: bool = True,
) -> LoadedModel:
    """Read the config and weights of `source` and build the model on `device`.

    `dtype` is the activations' (and every float weight's) type, or "auto" (model/auto_dtype.py). A GGUF
    file's matrices stay in their own block formats unless `dequantize` expands them to `dtype` at load
    (the float path, for comparisons); `quantization` ("q8_0", "q4_0") turns a float checkpoint's matrices into blocks.
    On a CPU the weights a decode step reads whole are then copied into huge pages (model/huge_pages.py);
    `huge_pages=False` leaves them where they loaded (a caller about to repack them: with_activation_setting).
    """
    start = time.perf_counter()
    device = torch.device(device)
    dtype = dtype if dtype == "auto" else parse_dtype(dtype)  # "auto" is resolved once the config is read
    path = resolve_source(source)
    gguf = None
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise KvlabError(f"no config.json in {path}: a model directory needs one")
        raw = read_json(path / "config.json")
        raw = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
        check_architecture_name(str(raw.get("model_type")), (raw.get("architectures") or [raw.get("model_type")])[0])
        config = load_config(path)
        architecture = architecture_of(config)
        tensors = iter_safetensors(path)
        if architecture.family == "gpt_oss":  # its experts' own layout (interleaved gate/up, transposed)
            tensors = from_gpt_oss(tensors)
        elif architecture.family in ("qwen3_5", "qwen3_next"):  # gated q_proj, Qwen3-Next's grouped projections
            from kvlab.model.hybrid_weights import from_qwen_hybrid

            tensors = from_qwen_hybrid(tensors, config)
    elif path.is_file():
        gguf = GGUFFile(path)
        config = config_from_gguf(gguf)
        architecture = architecture_of(config)
        native = keeps_blocks(path, device, dequantize, quantization)
        tensors = iter_gguf(gguf, config, architecture.gguf_permuted_qk, native=native)
        if architecture.family == "deepseek_v3":  # kv_b as floats, joined from llama.cpp's k_b and v_b
            tensors = join_kv_b(tensors)
        elif architecture.family in ("qwen3_5", "qwen3_next"):  # A from −exp(A_log), the gated q_proj split
            from kvlab.model.hybrid_weights import from_qwen_hybrid

            tensors = from_qwen_hybrid(tensors, config)
    else:
        raise KvlabError(f"no such model file or directory: {path}")
    if dtype == "auto":
        dtype = parse_dtype(auto_dtype(config, device))
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise KvlabError(f"unknown --quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
    with torch.device("meta"):
        model = Transformer(config, max_positions=1)  # rotary tables are built for real below
    load_weights(model, tensors, dtype, device)
    if quantization:
        quantize_model(model, quantization)
    positions = max_positions or config.max_position_embeddings
    model.build_rotary(positions, device)
    model.eval()
    if huge_pages:
        into_huge_pages(model)
    return LoadedModel(model=model, config=config, path=path, load_s=time.perf_counter() - start,
                       weight_format=weight_format(model, quantization), gguf=gguf)  # fmt: skip


def keeps_blocks(path: Path, device: torch.device, dequantize: bool = False, quantization: str | None = None) -> bool:
    """Whether loading `path` keeps its matrices in their stored block formats (a GGUF file, no
    --dequantize or --quantization, and kernels for blocks on this device)."""
    return path.is_file() and not dequantize and not quantization and native_blocks_supported(torch.device(device))


def native_blocks_supported(device: torch.device) -> bool:
    """Whether matrices can stay in their block formats here at a usable speed: on a CPU with the C
    kernels, or on CUDA (dequantized per layer on the device); elsewhere they are expanded at load (the
    device's ops say: kvlab/backends/ops.py)."""
    from kvlab.backends.ops import ops_for

    return ops_for(device).keeps_blocks


def weight_format(model: Transformer, quantization: str | None = None) -> str:
    """The matrices' storage in words: 'float32', 'Q4_1 + Q8_0 (as in the file)', 'q8_0 (quantized at load)'."""
    from kvlab.model.experts import Experts
    from kvlab.quant.linear import PackedLinear

    formats = {f for m in model.modules() if isinstance(m, PackedLinear) for f in m.formats}
    formats |= {f for m in model.modules() if isinstance(m, Experts) for fs in m.formats.values() for f in fs}
    formats = sorted(formats)
    if quantization:
        return f"{quantization} (quantized at load)"
    if formats:
        return " + ".join(formats) + " (as stored)"
    return str(model.dtype).removeprefix("torch.")
