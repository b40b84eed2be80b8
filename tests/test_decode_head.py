"""The decode step's ends in C (backends/cpu.py): the token table's rows looked up and dequantized
(quant.c's kvlab_quant_dequantize_rows) before the layers, and the final norm and the LM head at the logits
rows after them (decode.c's kvlab_decode_head), each in one call.

Checked here, for a float model and GGUF blocks (Q8_0, Q4_1; Gemma 3's offset norm, scaled embeddings and
soft-capped logits; a tied head; the int8 activation setting's interleaved head), one sequence and several:
  - each decode step's logits are the very bits the modules' embedding and head give around the same layers;
  - the C ends are the ones that ran (the backend describes them and takes the step; a float table stays
    the module's);
  - a forward hook on the embedding, the LM head or the final norm sends that end back to the module, and
    sees it; a token id outside the table, or a logits row outside the step, is refused before anything
    is read or written; the head's call gives the modules' logits for rows in any order.
"""

from __future__ import annotations

import ctypes

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


def serve_comparing(engine: LLMEngine, loaded, batch: int, steps: int) -> int:
    """Decode `batch` sequences for `steps` tokens; every fused step's logits computed twice from the same
    cache, the head in C and by the modules, and compared bit for bit. Returns the steps compared."""
    driver = engine.runner.driver
    run, compared = driver.run, []

    def both(input_ids, kv, meta=None, logits_index=None):
        backend = driver._fused_step(input_ids, kv, meta, logits_index)
        if backend is None:
            return run(input_ids, kv, meta, logits_index)
        assert backend.head is not None and backend._head_applies(logits_index.numel(), driver.policy)
        assert (backend.embed_fmt is not None) == (loaded.weight_format != "float32")
        before = [t.clone() for t in engine.cache.tensors()]
        in_c = run(input_ids, kv, meta, logits_index)
        for t, saved in zip(engine.cache.tensors(), before):
            t.copy_(saved)
        (head, backend.head), (fmt, backend.embed_fmt) = (backend.head, None), (backend.embed_fmt, None)
        try:  # the modules' embedding and head around the same layers
            modules = run(input_ids, kv, meta, logits_index)
        finally:
            backend.head, backend.embed_fmt = head, fmt
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
    assert serve_comparing(engine, loaded, batch, steps=6) >= 5


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
    for module in (model.lm_head, model.norm, model.embed_tokens):
        seen = []
        handle = module.register_forward_hook(lambda m, args, out: seen.append(out.shape))
        try:
            tokens = greedy(engine, [7, 8, 9, 10], 5)
        finally:
            handle.remove()
        assert tokens == plain
        assert len(seen) == 5  # the prompt's pass and the four decode steps: every one through the module


def test_logits_rows_outside_the_step_are_refused_before_anything_is_written(loaded):
    engine = LLMEngine(loaded, None, EngineConfig(max_num_batched_tokens=64, kv_memory_bytes=1 << 22))
    greedy(engine, [7, 8, 9], 2)  # the first decode step chooses the backend
    backend = engine.runner.driver.decode_path().backend
    desc, norm, eps = backend.head
    x = torch.randn(2, desc.in_features)
    for rows in ([0, 2], [-1]):
        index = torch.tensor(rows, dtype=torch.int64)
        logits, normed = torch.full((len(rows), desc.out_features), 7.0), torch.full((len(rows), desc.in_features), 7.0)
        status = backend.lib["head"](ctypes.byref(desc), norm, eps, x.data_ptr(), *x.shape, index.data_ptr(), len(rows),
                                     normed.data_ptr(), logits.data_ptr(), 1)  # fmt: skip
        assert status == -1 and bool((logits == 7.0).all()) and bool((normed == 7.0).all())
    index = torch.tensor([1, 0], dtype=torch.int64)
    logits, normed = torch.empty(2, desc.out_features), torch.empty(2, desc.in_features)
    assert backend.lib["head"](ctypes.byref(desc), norm, eps, x.data_ptr(), *x.shape, index.data_ptr(), 2,
                               normed.data_ptr(), logits.data_ptr(), 1) == 0  # fmt: skip
    driver = engine.runner.driver  # the modules under the driver's ops: the kernels a step's modules take
    with torch.inference_mode(), driver.ops.applied(driver.policy, 2, driver.packed):
        expected = driver.model.lm_head(driver.model.norm(x[index][None])).float()[0]
    assert torch.equal(logits, expected)  # rows 1 and 0, in that order (the soft-cap comes after the call)


def test_a_token_outside_the_table_is_refused_before_it_is_read(loaded):
    engine = LLMEngine(loaded, None, EngineConfig(max_num_batched_tokens=64, kv_memory_bytes=1 << 22))
    greedy(engine, [7, 8, 9], 2)  # the first decode step chooses the backend
    backend = engine.runner.driver.decode_path().backend
    if loaded.weight_format == "float32":  # a float table: the module looks its rows up (and refuses them)
        assert backend.embed_fmt is None
        return
    vocab = engine.runner.driver.model.embed_tokens.shape[0]
    with pytest.raises(IndexError, match="outside the vocabulary"):
        backend._embed(torch.tensor([[3, vocab]]))
    with pytest.raises(IndexError, match="outside the vocabulary"):
        backend._embed(torch.tensor([[-1]]))
    assert torch.equal(backend._embed(torch.tensor([[3, vocab - 1]])),
                       engine.runner.driver.model.embed_tokens(torch.tensor([[3, vocab - 1]]))[0])
