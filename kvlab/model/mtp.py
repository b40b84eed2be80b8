"""A model's own multi-token-prediction module (Qwen3.5 / Qwen3-Next `mtp.*`), run as a draft model.

At position p it reads the target's hidden state h_p (after the target's final norm, as vLLM feeds it) and
the embedding of the token after it, x_{p+1}, and predicts x_{p+2}:

    u = fc([norm_e(embed(x_{p+1})) ; norm_h(h_p)])       fc: [E, 2E]
    u = decoder layer (gated attention over the module's own K/V, the layer's MLP)
    h'_{p+1} = norm(u),  logits = lm_head(h'_{p+1})          embedding, rotary table and LM head: the target's

A later draft step feeds h' back as the hidden state. The weights are read from the checkpoint only when
MTP speculation is asked (`load_mtp_head`); the target model never holds them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kvlab.config import ModelConfig
from kvlab.errors import KvlabError
from kvlab.model.layers import Linear
from kvlab.model.transformer import make_layer, make_norm

_OWN = {"mtp.fc.weight": "fc", "mtp.pre_fc_norm_embedding.weight": "pre_fc_norm_embedding",
        "mtp.pre_fc_norm_hidden.weight": "pre_fc_norm_hidden"}  # fmt: skip


class MTPLayers(nn.Module):
    """The module's decoder layer and final norm, under the names kvlab.model.weights loads."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([make_layer(config, 0)])
        self.norm = make_norm(config, config.hidden_size)


class MTPHead(nn.Module):
    """Runs like a model under a ModelRunner; `hidden_in` [1, N, E] (the hidden state of every packed row) is
    set by the proposer before each pass, `hidden_out` [1, S, E] holds the rows the logits came from."""

    def __init__(self, target, config: ModelConfig):
        super().__init__()
        layer = dataclasses.replace(config.mtp_layers[0], mtp=False)
        self.config = dataclasses.replace(config, layers=(layer,), mtp_layers=(), tie_word_embeddings=False)
        E = config.hidden_size
        self.fc = Linear(2 * E, E)
        self.pre_fc_norm_embedding = make_norm(self.config, E)
        self.pre_fc_norm_hidden = make_norm(self.config, E)
        self.block = MTPLayers(self.config)
        self.layers = self.block.layers  # what decode backends and the runner ask of a model
        self._target = (target,)  # shared, not owned: the embedding, rotary table and LM head
        self.hidden_in: torch.Tensor | None = None
        self.hidden_out: torch.Tensor | None = None

    @property
    def rotary(self):
        return self._target[0].rotary

    @property
    def device(self) -> torch.device:
        return self.block.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.block.norm.weight.dtype

    def forward(self, input_ids, cache, meta, logits_index: torch.Tensor | None = None) -> torch.Tensor:
        target = self._target[0]
        e = self.pre_fc_norm_embedding(target.embed_tokens(input_ids))  # [1, N, E]
        h = self.pre_fc_norm_hidden(self.hidden_in.to(e.dtype))
        x = self.fc(torch.cat([e, h], dim=-1))
        cos, sin = self.rotary(meta.positions, x.dtype)
        x = self.block.layers[0](x, cos, sin, cache, meta)
        x = x[:, -1:] if logits_index is None else x[:, logits_index]
        self.hidden_out = self.block.norm(x)  # [1, S, E]
        logits = target.lm_head(self.hidden_out).float()
        return logits[:, -1] if logits_index is None else logits


def load_mtp_head(loaded) -> MTPHead:
    """The MTP module of `loaded` — a Hugging Face folder's `mtp.*` tensors, or a GGUF file's first nextn block
    (`blk.N.nextn.*` and the block's own layer tensors; expanded to floats) — on the target's device and dtype."""
    from kvlab.model.hybrid_weights import from_qwen_hybrid
    from kvlab.model.weights import load_weights

    config, model = loaded.config, loaded.model
    with torch.device("meta"):
        head = MTPHead(model, config)
    own, layer_tensors = _gguf_tensors(loaded) if loaded.path.is_file() else _folder_tensors(loaded)
    missing = sorted(set(_OWN.values()) - set(own))
    if missing or not layer_tensors:
        raise KvlabError(f"{loaded.path.name} declares an MTP layer but has no {missing[0] if missing else 'layer'} "
                         "tensors for it")  # fmt: skip
    for name, t in own.items():
        getattr(head, name).weight = nn.Parameter(t.to(device=model.device, dtype=model.dtype), requires_grad=False)
    load_weights(head.block, from_qwen_hybrid(iter(layer_tensors), head.config), model.dtype, model.device)
    return head.eval()


def _folder_tensors(loaded) -> tuple[dict, list]:
    """(fc and the two pre-fc norms by module name, the layer's and final norm's tensors under HF layer-0 names)."""
    from kvlab.model.weights import iter_safetensors

    own, layer_tensors = {}, []
    for name, t in iter_safetensors(loaded.path):
        if name in _OWN:
            own[_OWN[name]] = t
        elif name.startswith("mtp.layers.0."):
            layer_tensors.append(("model.layers.0." + name.removeprefix("mtp.layers.0."), t))
        elif name == "mtp.norm.weight":
            layer_tensors.append(("model.norm.weight", t))
    return own, layer_tensors


def _gguf_tensors(loaded) -> tuple[dict, list]:
    """The same from llama.cpp's names (its converter added 1 to every norm: the GGUF config has no offset)."""
    import numpy as np

    from kvlab.gguf_file import GGUFFile
    from kvlab.model.weights import _GGUF_TO_HF

    # the loader's parse, or the file parsed again where LLM() has let that go (its metadata only)
    gguf, prefix = loaded.gguf or GGUFFile(loaded.path), f"blk.{loaded.config.num_layers}."
    nextn = {"nextn.eh_proj.weight": "fc", "nextn.enorm.weight": "pre_fc_norm_embedding",
             "nextn.hnorm.weight": "pre_fc_norm_hidden"}  # fmt: skip
    own, layer_tensors = {}, []
    for name in gguf.tensors:
        if not name.startswith(prefix):
            continue
        rest = name.removeprefix(prefix)
        w = torch.from_numpy(np.array(gguf.dequantize(name), dtype=np.float32))
        if rest in nextn:
            own[nextn[rest]] = w
        elif rest == "nextn.shared_head_norm.weight":
            layer_tensors.append(("model.norm.weight", w))
        elif rest in _GGUF_TO_HF:
            layer_tensors.append((_GGUF_TO_HF[rest].format(i=0), w.reshape(1, -1) if "shexp" in rest and w.dim() == 1 else w))
    return own, layer_tensors
