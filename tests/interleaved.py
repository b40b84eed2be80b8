"""Shared by the interleaved settings' engine tests (`--activation-quant int8`, `bf16x3`): a tiny model in a
mix of GGUF block formats, prompts of many lengths, and an engine run to the end."""

from __future__ import annotations

import torch

from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine
from kvlab.kernels import ThreadPolicy
from kvlab.sampling import SamplingParams
from tiny import add_tiny_tokenizer, build_tiny, build_tiny_gguf

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def mixed(name: str) -> str:
    """A Q4_K_M-like mix: attention Q8_0, MLP Q4_1 / Q5_0, the rest Q4_0."""
    return "Q8_0" if "attn" in name else "Q4_1" if "ffn_up" in name else "Q5_0" if "ffn_down" in name else "Q4_0"


def mixed_gguf(arch: str, directory):
    """A tiny `arch` model (head_dim 32, with a tokenizer) written as a GGUF file in `mixed` formats."""
    directory = build_tiny(arch, directory, head_dim=32)
    add_tiny_tokenizer(directory)
    return build_tiny_gguf(directory, directory / "m.gguf", mixed)


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(3, 500, (int(length),), generator=g).tolist() for length in torch.randint(1, 40, (n,), generator=g)]


def run_all(engine: LLMEngine, batch: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens, all of them added to the engine at once."""
    ids = [engine.add_request(p, GREEDY) for p in batch]
    done = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output.token_ids
    return [done[i] for i in ids]


def assert_together_as_alone(loaded, n: int, any_rows: bool = True) -> None:
    """n requests' greedy tokens, decoded together, are each one's alone: on the C decode step (which must
    take the model, at any batch where `any_rows`) and on the modules' path, which calls the same kernels.
    Each prompt is prefilled in a pass of its own (pack_prompts=False): what is compared is the batched
    decode step."""
    batch = prompts(n)
    config = EngineConfig(enable_prefix_caching=False, max_num_seqs=n, pack_prompts=False)
    c_step = LLMEngine(loaded, None, config)
    assert c_step.decode_path.backend is not None, c_step.decode_path.reason
    assert c_step.decode_path.backend.any_rows or not any_rows
    alone = [run_all(c_step, [p])[0] for p in batch]
    assert run_all(c_step, batch) == alone
    modules = LLMEngine(loaded, None, config, policy=ThreadPolicy(fused_decode=False))
    assert run_all(modules, batch) == alone
