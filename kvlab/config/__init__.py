"""Configs: what a model is (ModelConfig, read once per source) and how an engine runs it (EngineConfig).

    from kvlab.config import load_config
    config = load_config("qwen3-0.6b")      # bundled name, config.json, HF dir, .gguf, registry name, dict
    config.layers[0].mixer                   # Attention(num_heads=16, kv_heads=8, head_dim=128, ...)

No module here imports torch.
"""

from kvlab.config.engine import EngineConfig
from kvlab.config.hf import config_from_hf
from kvlab.config.layers import MLA, Attention, DenseMLP, GatedDeltaNet, Layer, Mamba2, Mixer, MoE
from kvlab.config.model import FileWeights, ModelConfig, ParamCounts, QuantScheme
from kvlab.config.rope import RopeConfig
from kvlab.config.sources import bundled_dir, bundled_names, load_config, read_json

__all__ = [
    "Attention", "DenseMLP", "EngineConfig", "FileWeights", "GatedDeltaNet", "Layer", "MLA", "Mamba2", "Mixer", "ModelConfig",
    "MoE", "ParamCounts", "QuantScheme", "RopeConfig", "bundled_dir", "bundled_names", "config_from_hf",
    "load_config", "read_json",
]
