"""The fused decode step (a step's decoder layers in one C call) against the model's own modules, pass for pass.

Its products and norms are the same C kernels, so only attention and SiLU differ in the order of
their sums: logits within 1e-5 of the layer-by-layer path, and the same greedy tokens in a batched
run with prompts of different lengths, prefix hits and chunked prefill.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine
from kvlab.kernels import ThreadPolicy
from kvlab.backends.cpu import CpuDecodeBackend
from kvlab.kernels.decode import library
from kvlab.model import loader
from kvlab.model.loader import load_model
from kvlab.sampling import SamplingParams
from tiny import add_tiny_tokenizer, build_tiny, build_tiny_gguf

pytestmark = pytest.mark.skipif(not library(), reason="no C compiler: the fused step is not built")


def mixed(name: str) -> str:
    return "Q4_0" if name.endswith("attn_q.weight") else "Q8_0" if name.endswith(("attn_v.weight", "ffn_down.weight")) else "Q5_0"


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "llama-tied", "gguf-mixed"])
def model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param != "gguf-mixed":
        return load_model(build_tiny(request.param, directory))
    build_tiny("qwen2", directory)
    add_tiny_tokenizer(directory)
    path = build_tiny_gguf(directory, directory / "m.gguf", quant=mixed)
    saved = loader.native_blocks_supported
    loader.native_blocks_supported = lambda device: True
    try:
        return load_model(path)
    finally:
        loader.native_blocks_supported = saved


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(5, 400, (k,), generator=g).tolist() for k in lengths]


def serve(loaded, batch: list[list[int]], fused: bool, record: list | None = None, **config) -> list[list[int]]:
    """Greedy tokens of every prompt, served together; `record` collects each decode step's logits."""
    policy = ThreadPolicy(fused_decode=fused)
    config = {"max_num_batched_tokens": 24, "kv_memory_bytes": 1 << 22, **config}
    engine = LLMEngine(loaded, None, EngineConfig(**config), policy=policy)
    if record is not None:
        forward = engine.runner.forward
        engine.runner.forward = lambda inputs: record.append(forward(inputs).clone()) or record[-1]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in batch]
    done = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output.token_ids
    assert engine.ledger().is_balanced and engine.kv.pool.check_integrity().used == 0
    return [done[i] for i in ids]


def test_the_model_is_taken_by_the_fused_step(model):
    assert isinstance(CpuDecodeBackend.build(model.model), CpuDecodeBackend)


def test_greedy_tokens_and_logits_agree_with_the_layer_by_layer_path(model):
    batch = prompts(6, seed=1) + [prompts(1, seed=1)[0] + [7, 8, 9]]  # the last one shares a prefix
    fused_logits, plain_logits = [], []
    fused = serve(model, batch, fused=True, record=fused_logits)
    plain = serve(model, batch, fused=False, record=plain_logits)
    assert fused == plain
    assert len(fused_logits) == len(plain_logits)
    for a, b in zip(fused_logits, plain_logits):
        assert a.shape == b.shape
        if not a.numel():  # a step with nothing to sample (prompt chunks only)
            continue
        assert (a - b).abs().max() <= 1e-5 * max(b.abs().max().item(), 1.0)


def test_many_sequences_over_many_keys_agree_too(model):
    """16 sequences over 131-146 keys: past attention.c's AHEAD_KEYS (2,048 sequence × keys), the form of
    the attention that asks for the rows of keys and values ahead."""
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(5, 400, (131 + k,), generator=g).tolist() for k in range(16)]
    config = {"max_num_batched_tokens": 512, "kv_memory_bytes": 1 << 24, "enable_prefix_caching": False}
    fused_logits, plain_logits = [], []
    fused = serve(model, batch, fused=True, record=fused_logits, **config)
    plain = serve(model, batch, fused=False, record=plain_logits, **config)
    assert fused == plain
    decodes = [(a, b) for a, b in zip(fused_logits, plain_logits) if a.shape[0] == 16]
    assert len(decodes) >= 5  # steps of all 16 sequences, each over 16 × 147 or more sequence × keys
    for a, b in decodes:
        assert (a - b).abs().max() <= 1e-5 * max(b.abs().max().item(), 1.0)


def test_a_step_that_is_not_all_decodes_runs_the_modules(model, monkeypatch):
    calls = []
    run = CpuDecodeBackend.run
    monkeypatch.setattr(CpuDecodeBackend, "run", lambda self, *a: calls.append(a[0].shape[1]) or run(self, *a))
    serve(model, prompts(3, seed=2), fused=True)
    assert calls and max(calls) <= 3  # only decode steps (one token per running sequence) were fused


def test_the_phase_clock_times_each_part_of_the_steps_and_changes_nothing(model):
    """Within phase_clock() every decode step adds its parts' wall time (the layers' products, their mixer,
    their other work, the LM head); the parts fit inside the steps' own time, the tokens are the ones an
    untimed run gives, and once the block is left nothing more is added."""
    import time

    from kvlab.backends.cpu import PHASES

    batch = prompts(4, seed=5)
    engine = LLMEngine(model, None, EngineConfig(max_num_batched_tokens=64, kv_memory_bytes=1 << 22))
    backend = engine.runner.driver.decode_path().backend
    assert isinstance(backend, CpuDecodeBackend)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)  # as serve() asks
    ids = [engine.add_request(p, params) for p in batch]
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.num_waiting:
        engine.step()  # the prompts: not decode steps
    done, spent = {}, 0.0
    with backend.phase_clock() as phases:
        assert phases.tolist() == [0.0] * len(PHASES)
        for _ in range(3):
            t = time.perf_counter()
            outputs = engine.step()
            spent += time.perf_counter() - t
            done.update({o.request_id: o.output.token_ids for o in outputs if o.finished})
        timed = phases.clone()
    assert all(seconds > 0 for seconds in timed.tolist()), dict(zip(PHASES, timed.tolist()))
    assert timed.sum().item() <= spent
    while engine.has_unfinished_requests:
        done.update({o.request_id: o.output.token_ids for o in engine.step() if o.finished})
    assert torch.equal(phases, timed)  # left the block: the later steps were not timed
    assert [done[i] for i in ids] == serve(model, batch, fused=True, max_num_batched_tokens=64)  # as untimed


def test_forward_hooks_see_each_hooked_layers_output_as_the_modules_give_it(model, monkeypatch):
    """The C step runs a step's layers in one call, but up to each layer with forward hooks (the MTP
    proposer's on the last): the hooks get that layer's output [1, B, E], the one the modules' own pass
    gives (within the fused path's tolerance), once per step, and the tokens do not change."""
    from kvlab.kernels import gemv

    layers = model.model.layers
    hooked = (1, len(layers) - 1)
    batch = prompts(3, seed=7)

    def run(fused: bool):
        seen = {i: [] for i in hooked}
        handles = [layers[i].register_forward_hook(lambda m, a, out, i=i: seen[i].append(out[0].clone())) for i in hooked]
        try:
            return serve(model, batch, fused=fused), seen
        finally:
            for h in handles:
                h.remove()

    calls = []
    bound = gemv._decode["layers"]
    monkeypatch.setitem(gemv._decode, "layers", lambda *a: calls.append(a[1]) or bound(*a))
    fused, fused_seen = run(True)
    plain, plain_seen = run(False)
    assert fused == plain
    steps = len(calls) // 2
    assert steps >= 10 and calls == [2, len(layers) - 2] * steps  # layers 0-1, then the rest: one call each
    for i in hooked:  # the two runs step alike: call for call, the same rows (prompt chunks, or decode rows)
        assert len(fused_seen[i]) == len(plain_seen[i]) >= steps
        for a, b in zip(fused_seen[i], plain_seen[i]):
            assert a.shape == b.shape and (a - b).abs().max() <= 1e-4 * max(b.abs().max().item(), 1.0)
