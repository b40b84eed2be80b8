"""Wave 3 on a CUDA device: mixtures of experts, Gated DeltaNet hybrids, latent attention and MTP.

test_cuda.py's checks on the dense families, made for the wave-3 ones: each tiny random checkpoint
(tests/tiny_moe.py, tiny_hybrid.py, tiny_deepseek.py) loaded on the device against transformers' own model
on the same float32 weights there: logits within 1e-4 of its largest, and the greedy tokens of prompts
served together by the paged engine (chunked prefill, batched decode) equal to its generate. Then MTP
speculation against the same oracle, and a GGUF file and a quantized KV cache on the device against the
same on the CPU. Skipped where torch sees no CUDA device; `DEVICE` is the one place the device is named.
"""

from __future__ import annotations

import pytest
import torch
from test_cuda import prompts
from test_paged import run_all
from tiny import add_tiny_tokenizer
from tiny_deepseek import DEEPSEEK_KINDS, build_tiny_deepseek
from tiny_hybrid import HYBRID_ARCHS, build_tiny_hybrid
from tiny_moe import MOE_ARCHS, build_tiny_moe, build_tiny_moe_gguf

from kvlab import LLM, SamplingParams
from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine
from kvlab.kv.cache import ContiguousKVCache
from kvlab.model.loader import load_model
from kvlab.runner.driver import ModelDriver

DEVICE = "cuda"

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
BUILDERS = {"moe": build_tiny_moe, "hybrid": build_tiny_hybrid, "mla": build_tiny_deepseek}
ARCHS = [("moe", k) for k in MOE_ARCHS] + [("hybrid", k) for k in HYBRID_ARCHS] + [("mla", k) for k in DEEPSEEK_KINDS]


def small_engine(loaded, **config) -> LLMEngine:
    """Blocks of 4 and a budget of 16 tokens: the prompts (12-27 tokens) cross blocks and split into chunks."""
    return LLMEngine(loaded, None, EngineConfig(block_size=4, kv_memory_bytes=1 << 21, max_num_batched_tokens=16,
                                                **config))  # fmt: skip


def reference_greedy(ref, ids: list[int], steps: int) -> list[int]:
    """transformers' greedy continuation on the device its model is on (EOS drawn and gone past, as ignore_eos)."""
    prompt = torch.tensor([ids], device=ref.device)
    with torch.inference_mode():
        out = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps, do_sample=False,
                           eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module", params=ARCHS, ids=[kind for _, kind in ARCHS])
def pair(request, tmp_path_factory):
    """(kind, our model on the device, transformers' model on the device) on the same float32 weights."""
    import transformers

    family, kind = request.param
    directory = BUILDERS[family](kind, tmp_path_factory.mktemp(kind))
    ours = load_model(directory, device=DEVICE)
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(DEVICE).eval()
    return kind, ours, ref


def test_logits_on_the_device_match_transformers(pair):
    """Every position of a 40-token prompt in one pass (a hybrid's prompt: a chunk of the delta rule)."""
    kind, ours, ref = pair
    held = list(ours.model.parameters()) + list(ours.model.buffers())
    assert {t.device.type for t in held} == {DEVICE}, kind
    ids = torch.tensor(prompts(1, length=40)[0], device=DEVICE)[None]
    with torch.inference_mode():
        expected = ref(ids).logits
        cache = ContiguousKVCache.for_model(ours.config, 64, device=DEVICE)
        got = ModelDriver(ours.model).run(ids, cache, logits_index=torch.arange(40, device=DEVICE))
    assert got.device.type == DEVICE
    assert expected.std() > 0.5, "logits too flat to test anything"
    assert (got - expected).abs().max().item() < 1e-4 * max(expected.abs().max().item(), 1.0), kind


def test_batched_paged_engine_on_the_device_matches_transformers_generate(pair):
    """Four prompts served together: experts grouped over a batch's rows, a state slot per sequence, latents."""
    kind, ours, ref = pair
    batch = prompts(4, seed=1)
    engine = small_engine(ours)
    assert engine.cache.device.type == DEVICE
    assert run_all(engine, batch, GREEDY) == [reference_greedy(ref, p, 32) for p in batch], kind
    assert engine.kv.pool.check_integrity().used == 0


@pytest.mark.parametrize("kind", HYBRID_ARCHS)
def test_mtp_speculation_on_the_device_gives_transformers_tokens(tmp_path, kind):
    """The model's own MTP module drafting 3 tokens a step on the device: its drafts verified there, the output
    transformers' plain greedy tokens (it drops `mtp.*`)."""
    import transformers

    directory = build_tiny_hybrid(kind, tmp_path, mtp=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(DEVICE).eval()
    mtp = {"method": "mtp", "num_speculative_tokens": 3}
    llm = LLM(directory, device=DEVICE, max_num_seqs=8, speculative_config=mtp)
    batch = prompts(3, seed=7)
    got = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)]
    assert got == [reference_greedy(ref, p, 32) for p in batch], kind
    assert llm.engine.spec.stats.num_draft_tokens > 0


@pytest.mark.parametrize("kind, experts_type", [("qwen3_moe", "Q8_0"), ("gpt_oss", "MXFP4")])
def test_a_moe_gguf_keeps_its_experts_in_blocks_on_the_device_and_agrees_with_the_cpu(tmp_path, kind, experts_type):
    """The experts stay the file's blocks on the device (dequantized expert by expert there); logits and greedy
    tokens agree with the same file on the CPU (its experts on the C kernels)."""
    directory = add_tiny_tokenizer(build_tiny_moe(kind, tmp_path / "hf"))
    path = build_tiny_moe_gguf(directory, tmp_path / "m.gguf", experts_type=experts_type)
    gpu, cpu = load_model(path, device=DEVICE), load_model(path)
    experts = gpu.model.layers[0].mlp.experts
    assert experts.formats["gate_up"] == [experts_type] * 2 and experts.gate_up_0.device.type == DEVICE
    ids = torch.tensor([prompts(1, length=24, seed=5)[0]])
    with torch.inference_mode():
        a = ModelDriver(gpu.model).run(ids.to(DEVICE), ContiguousKVCache.for_model(gpu.config, 32, device=DEVICE))
        b = ModelDriver(cpu.model).run(ids, ContiguousKVCache.for_model(cpu.config, 32))
    assert (a.cpu() - b).abs().max().item() < 1e-4 * max(b.abs().max().item(), 1.0)
    batch = prompts(3, seed=6)
    assert run_all(small_engine(gpu), batch, GREEDY) == run_all(small_engine(cpu), batch, GREEDY)


@pytest.mark.parametrize("kv_cache_dtype", ["q8_0", "fp8_e4m3"])
def test_a_quantized_latent_cache_on_the_device_gives_the_cpus_tokens(tmp_path, kv_cache_dtype):
    """DeepSeek's latent (48 + 16 numbers: two q8_0 blocks, Hadamard-rotated; or fp8 with one scale) encoded and
    decoded on the device: the greedy tokens of the same model and format on the CPU."""
    directory = build_tiny_deepseek("q_lora", tmp_path)
    gpu, cpu = load_model(directory, device=DEVICE), load_model(directory)
    engine = small_engine(gpu, kv_cache_dtype=kv_cache_dtype)
    assert {t.device.type for t in engine.cache.tensors()} == {DEVICE}
    assert engine.cache.tensors()[0].dtype in (torch.int8, torch.uint8)  # codes, not floats
    batch = prompts(4, seed=8)
    assert run_all(engine, batch, GREEDY) == run_all(small_engine(cpu, kv_cache_dtype=kv_cache_dtype), batch, GREEDY)
    assert engine.kv.pool.check_integrity().used == 0
