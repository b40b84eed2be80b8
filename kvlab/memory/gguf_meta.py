"""GGUF file -> ModelSpec: geometry from the metadata, exact weight bytes from the tensor infos.

Keys are llama.cpp's, prefixed by the architecture (`llama.block_count`, ...). Per-layer arrays
(`head_count_kv` with 0 for recurrent layers) are honoured. llama.cpp keeps the KV cache in f16 by
default and every recurrent state in f32, so those are the spec's defaults here.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from kvlab.errors import KvlabError
from kvlab.memory.spec import (
    MLA, Attention, DenseMLP, FileWeights, GatedDeltaNet, Layer, Mamba2, ModelSpec, MoE, ParamCounts,
)

# llama.cpp hard-codes these interleavings: layer i is sliding unless i % period == period - 1
SWA_PERIODS = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2, "cohere2": 4}
GATED_DELTANET_ARCHS = {"qwen3next", "qwen35", "qwen35moe"}  # other ssm_* blocks are Mamba-2


def spec_from_gguf(path: Path, *, name: str | None = None) -> ModelSpec:
    """Read a .gguf file's metadata and tensor infos into a ModelSpec with exact weight bytes."""
    header = read_gguf_header(path)
    meta = _Meta(header.metadata, path)
    arch = meta.str("general.architecture")
    n = meta.int(f"{arch}.block_count")
    hidden = meta.int(f"{arch}.embedding_length")
    recurrent = {int(t.name.split(".")[1]) for t in header.tensors if t.name.startswith("blk.") and ".ssm_" in t.name}
    layers = tuple(_layer(meta, arch, i, i in recurrent) for i in range(n))
    weights = _file_weights(header, path, meta, arch)
    vocab = meta.int(f"{arch}.vocab_size", required=False)
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if vocab is None and isinstance(tokens, ArrayInfo):
        vocab = tokens.count
    has_state = any(isinstance(layer.mixer, (GatedDeltaNet, Mamba2)) for layer in layers)
    return ModelSpec(
        name=name or path.stem,
        architecture=arch,
        source=str(path),
        hidden_size=hidden,
        vocab_size=vocab,
        tie_embeddings=weights.params is not None and weights.params.lm_head == 0,
        layers=layers,
        dtype="float16",  # llama.cpp's default cache type
        max_context=meta.int(f"{arch}.context_length", required=False),
        state_dtype="float32" if has_state else None,  # llama.cpp keeps recurrent states in f32
        file_weights=weights,
        notes=("GGUF: KV sized in f16 (llama.cpp's default cache type) unless --kv-dtype says otherwise",),
    )


# ------------------------------------------------------------------ reading the header
# GGUF v2/v3, little-endian: magic, version u32, tensor count u64, kv count u64, then the key-value
# pairs, then one info per tensor (name, dims, type, offset). Walking it directly takes milliseconds;
# gguf.GGUFReader builds numpy views of every tokenizer string and takes seconds (tests compare both).

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
MAX_SMALL_ARRAY = 4096  # longer arrays (vocabularies) are kept as their length only


@dataclass(frozen=True)
class ArrayInfo:
    """A long metadata array, kept as its element count."""

    count: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type_name: str  # GGML type: F32, F16, Q4_K, ...
    n_elements: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict
    tensors: tuple[TensorInfo, ...]


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise KvlabError(f"{self.path}: GGUF header is truncated")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        if self.pos + length > len(self.buf):
            raise KvlabError(f"{self.path}: GGUF header is truncated")
        text = bytes(self.buf[self.pos:self.pos + length]).decode("utf-8", errors="replace")
        self.pos += length
        return text

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, count = self.unpack("<I"), self.unpack("<Q")
            if count <= MAX_SMALL_ARRAY:
                return [self.value(elem) for _ in range(count)]
            if elem in _SCALARS:  # skip fixed-size elements at once
                self.pos += count * struct.calcsize(_SCALARS[elem])
            elif elem == _STRING:  # a vocabulary: hop over each length-prefixed string
                for _ in range(count):
                    self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]
            else:
                for _ in range(count):
                    self.value(elem)
            return ArrayInfo(count)
        raise KvlabError(f"{self.path}: unknown GGUF value type {kind}")


def read_gguf_header(path: Path) -> GGUFHeader:
    """Metadata and tensor infos of a GGUF file, from its header only (the weights are not read)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            c = _Cursor(buf, path)
            if bytes(buf[:4]) != b"GGUF":
                raise KvlabError(f"{path}: not a GGUF file (bad magic)")
            c.pos = 4
            version, n_tensors, n_kv = c.unpack("<I"), c.unpack("<Q"), c.unpack("<Q")
            if version not in (2, 3):
                raise KvlabError(f"{path}: GGUF version {version} is not supported (big-endian or too new)")
            metadata = {}
            for _ in range(n_kv):
                key = c.string()
                metadata[key] = c.value(c.unpack("<I"))
            tensors = []
            for _ in range(n_tensors):
                name = c.string()
                shape = tuple(c.unpack("<Q") for _ in range(c.unpack("<I")))
                kind, _offset = c.unpack("<I"), c.unpack("<Q")
                try:
                    qtype = GGMLQuantizationType(kind)
                except ValueError:
                    raise KvlabError(f"{path}: tensor {name} has unknown GGML type {kind}") from None
                block, size = GGML_QUANT_SIZES[qtype]
                count = math.prod(shape)
                tensors.append(TensorInfo(name, shape, qtype.name, count, count // block * size))
    except (OSError, ValueError) as e:
        raise KvlabError(f"{path}: not a readable GGUF file ({e})") from None
    return GGUFHeader(metadata, tuple(tensors))


class _Meta:
    """Typed access to GGUF metadata; a missing key is a one-line KvlabError naming it."""

    def __init__(self, metadata: dict, path: Path):
        self.fields, self.path = metadata, path

    def value(self, key: str):
        return self.fields.get(key)

    def str(self, key: str) -> str:
        value = self.value(key)
        if not isinstance(value, str):
            raise KvlabError(f"{self.path}: GGUF metadata has no '{key}'")
        return value

    def int(self, key: str, required: bool = True, layer: int | None = None) -> int | None:
        value = self.value(key)
        if isinstance(value, list) and layer is not None:  # per-layer array
            value = value[layer] if layer < len(value) else None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            if required:
                raise KvlabError(f"{self.path}: GGUF metadata has no '{key}', needed for the memory count")
            return None
        if value < (1 if required else 0) or value > 2**40:
            raise KvlabError(f"{self.path}: GGUF metadata '{key}' = {value} is out of range")
        return int(value)


def _layer(meta: _Meta, arch: str, i: int, recurrent: bool) -> Layer:
    """Block i: recurrent when it has ssm_* tensors, attention when it has KV heads, else MLP only."""
    heads = meta.int(f"{arch}.attention.head_count", required=False, layer=i) or 0
    kv_heads = meta.int(f"{arch}.attention.head_count_kv", required=False, layer=i)
    kv_heads = heads if kv_heads is None else kv_heads
    mixer = _recurrent(meta, arch) if recurrent else _attention(meta, arch, i, heads, kv_heads)
    mlp = _mlp(meta, arch, i)
    return Layer(mixer=mixer, mlp=mlp, norms=2)


def _attention(meta: _Meta, arch: str, i: int, heads: int, kv_heads: int):
    if kv_heads == 0 or heads == 0:
        return None
    rank = meta.int(f"{arch}.attention.kv_lora_rank", required=False)
    if rank:
        rope = meta.int(f"{arch}.rope.dimension_count")
        key = (meta.int(f"{arch}.attention.key_length_mla", required=False)
               or meta.int(f"{arch}.attention.key_length"))
        value = (meta.int(f"{arch}.attention.value_length_mla", required=False)
                 or meta.int(f"{arch}.attention.value_length"))
        return MLA(num_heads=heads, kv_lora_rank=rank, qk_rope_head_dim=rope, qk_nope_head_dim=key - rope,
                   v_head_dim=value, q_lora_rank=meta.int(f"{arch}.attention.q_lora_rank", required=False))
    hidden = meta.int(f"{arch}.embedding_length")
    key = meta.int(f"{arch}.attention.key_length", required=False) or hidden // heads
    value = meta.int(f"{arch}.attention.value_length", required=False) or key
    return Attention(num_heads=heads, kv_heads=kv_heads, head_dim=key, v_head_dim=value,
                     window=_window(meta, arch, i))


def _window(meta: _Meta, arch: str, i: int) -> int | None:
    window = meta.int(f"{arch}.attention.sliding_window", required=False)
    if not window:
        return None
    pattern = meta.value(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag per layer: True = sliding
        return window if i < len(pattern) and pattern[i] else None
    period = int(pattern) if isinstance(pattern, (int, float)) and pattern else SWA_PERIODS.get(arch)
    if period is None:
        return window  # every layer slides (Mistral-style)
    return window if i % period < period - 1 else None


def _recurrent(meta: _Meta, arch: str):
    kernel = meta.int(f"{arch}.ssm.conv_kernel")
    inner = meta.int(f"{arch}.ssm.inner_size")
    state = meta.int(f"{arch}.ssm.state_size")
    groups = meta.int(f"{arch}.ssm.group_count", required=False) or 1
    heads = meta.int(f"{arch}.ssm.time_step_rank")
    if arch in GATED_DELTANET_ARCHS:  # llama.cpp maps k heads to groups, v heads to dt rank
        return GatedDeltaNet(num_key_heads=groups, num_value_heads=heads, key_head_dim=state,
                             value_head_dim=inner // heads, conv_kernel=kernel)
    return Mamba2(num_heads=heads, head_dim=inner // heads, state_size=state, n_groups=groups, conv_kernel=kernel)


def _mlp(meta: _Meta, arch: str, i: int):
    experts = meta.int(f"{arch}.expert_count", required=False)
    leading_dense = meta.int(f"{arch}.leading_dense_block_count", required=False) or 0
    if experts and i >= leading_dense:
        return MoE(num_experts=experts, top_k=meta.int(f"{arch}.expert_used_count"),
                   expert_size=meta.int(f"{arch}.expert_feed_forward_length", required=False) or
                   meta.int(f"{arch}.feed_forward_length", layer=i))
    size = meta.int(f"{arch}.feed_forward_length", required=False, layer=i)
    return DenseMLP(size) if size else None


def _file_weights(header: GGUFHeader, path: Path, meta: _Meta, arch: str) -> FileWeights:
    """Exact tensor bytes by GGUF type, and parameters by role from the tensor names."""
    by_type: dict[str, int] = defaultdict(int)
    roles: dict[str, int] = defaultdict(int)
    for t in header.tensors:
        by_type[t.type_name] += t.n_bytes
        roles[_role(t.name, len(t.shape))] += t.n_elements
    experts = meta.int(f"{arch}.expert_count", required=False)
    used = meta.int(f"{arch}.expert_used_count", required=False)
    params = ParamCounts(
        embedding=roles["embedding"], lm_head=roles["lm_head"], dense=roles["dense"],
        experts=roles["experts"], experts_active=roles["experts"] * used // experts if experts and used else 0,
        routers=roles["routers"], vectors=roles["vectors"],
    )
    return FileWeights(
        path=str(path),
        tensor_bytes=sum(by_type.values()),
        num_elements=sum(roles.values()),
        bytes_by_type=tuple(sorted(by_type.items(), key=lambda kv: -kv[1])),
        file_bytes=path.stat().st_size,
        params=params,
    )


def _role(name: str, ndim: int) -> str:
    """What a GGUF tensor is, from llama.cpp's naming (blk.N.ffn_up_exps.weight, token_embd.weight...)."""
    if name.startswith("token_embd."):
        return "embedding"
    if name.startswith("output."):
        return "lm_head" if name.endswith(".weight") and ndim == 2 else "vectors"
    if "_exps." in name:
        return "experts"
    if "ffn_gate_inp" in name:
        return "routers"
    if ndim == 1 or "ssm_conv1d" in name or name.endswith((".ssm_a", ".ssm_d")):
        return "vectors"
    return "dense"
