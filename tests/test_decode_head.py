"""The decode step's head in C (backends/cpu.py, decode.c's kvlab_decode_head): the final norm and the LM
head at the logits rows, after the layers, in one call.

Checked here, for a float head and GGUF blocks (Q8_0, Q4_1; Gemma 3's offset norm and soft-capped logits; a
tied head; the int8 activation setting's interleaved head), one sequence and several:
  - each decode step's logits are the very bits the modules' head gives after the same layers;
  - the C head is the one that ran (the backend describes it and takes the step);
  - a forward hook on the LM head or the final norm sends the step back to the modules, and sees it.
"""

from __future__ import annotations

import pytest
import torch

from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine
from kvlab.kernels.decode import library
from kvlab.model.loader import load_model
from kvlab.quant.activations import with_activation_setting
from kvlab.sampling import SamplingParams
from tiny import add_tiny_tokenizer, build_tiny, build_tiny_gguf

pytestmark = pytest.mark.skipif(not library(), reason="no C compiler: the fused step is not built")

MODELS = [("llama", "F32", None), ("llama-tied", "Q8_0", None), ("gemma3", "Q4_1", None), ("qwen2", "Q8_0", "int8")]


@pytest.fixture(scope="module", params=MODELS, ids=lambda m: "-".join(x for x in m if x))
def loaded(request, tmp_path_factory):
    kind, quant, setting = request.param
    directory = tmp_path_factory.mktemp(kind)
    hf = build_tiny(kind, directory / "hf")
    add_tiny_tokenizer(hf)
    if quant == "F32":
        model = load_model(hf)
    else:
        model = load_model(build_tiny_gguf(hf, directory / "model.gguf", quant=quant))
    return with_activation_setting(model, setting) if setting else model


def serve_comparing(engine: LLMEngine, batch: int, steps: int) -> int:
    """Decode `batch` sequences for `steps` tokens; every fused step's logits computed twice from the same
    cache, the head in C and by the modules, and compared bit for bit. Returns the steps compared."""
    driver = engine.runner.driver
    run, compared = driver.run, []

    def both(input_ids, kv, meta=None, logits_index=None):
        backend = driver._fused_step(input_ids, kv, meta, logits_index)
        if backend is None:
            return run(input_ids, kv, meta, logits_index)
        assert backend.head is not None and backend._head_applies(logits_index.numel(), driver.policy)
        before = [t.clone() for t in engine.cache.tensors()]
        in_c = run(input_ids, kv, meta, logits_index)
        for t, saved in zip(engine.cache.tensors(), before):
            t.copy_(saved)
        head, backend.head = backend.head, None  # the modules' head after the same layers
        try:
            modules = run(input_ids, kv, meta, logits_index)
        finally:
            backend.head = head
        assert in_c.shape == modules.shape and torch.equal(in_c, modules)
        compared.append(in_c.shape[1])
        return in_c

    driver.run = both
    try:
        g = torch.Generator().manual_seed(batch)
        params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
        for _ in range(batch):
            engine.add_request(torch.randint(5, 400, (int(torch.randint(3, 30, (1,), generator=g)),),
                                             generator=g).tolist(), params)  # fmt: skip
        while engine.has_unfinished_requests:
            engine.step()
    finally:
        driver.run = run
    return len(compared)


@pytest.mark.parametrize("batch", [1, 5])
def test_the_c_head_gives_the_modules_logits_bit_for_bit(loaded, batch):
    engine = LLMEngine(loaded, None, EngineConfig(max_num_batched_tokens=64, kv_memory_bytes=1 << 22))
    assert serve_comparing(engine, batch, steps=6) >= 5


def greedy(engine: LLMEngine, prompt: list[int], n: int) -> list[int]:
    rid = engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished and out.request_id == rid:
                return list(out.output.outputs[0].token_ids)
    raise AssertionError("the request did not finish")


def test_a_hook_on_the_head_or_the_norm_sends_the_step_back_to_the_modules(loaded):
    engine = LLMEngine(loaded, None, EngineConfig(max_num_batched_tokens=64, kv_memory_bytes=1 << 22))
    model = engine.runner.driver.model
    plain = greedy(engine, [7, 8, 9, 10], 5)
    for module in (model.lm_head, model.norm):
        seen = []
        handle = module.register_forward_hook(lambda m, args, out: seen.append(out.shape))
        try:
            tokens = greedy(engine, [7, 8, 9, 10], 5)
        finally:
            handle.remove()
        assert tokens == plain
        assert len(seen) == 5  # the prompt's pass and the four decode steps: every one through the module
