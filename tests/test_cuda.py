"""The same engine on a CUDA device: nothing in kvlab may assume the CPU.

Skipped where torch sees no CUDA device (CI's machine); run them on a GPU with `pytest -m cuda`.
The oracle is the same as on the CPU: transformers on the same weights, on the same device.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvlab import LLM, SamplingParams
from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine
from kvlab.reference import ReferenceEngine
from kvlab.runner.driver import ModelDriver
from kvlab.kv.cache import ContiguousKVCache
from kvlab.model.loader import load_model
from kvlab.output.result import RequestMetrics
from test_paged import run_all as run_to_completion
from tiny import ARCHS, build_tiny

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    """(kind, our model on CUDA, transformers' model on CUDA) on the same float32 weights."""
    import transformers

    directory = build_tiny(request.param, tmp_path_factory.mktemp(request.param))
    ours = load_model(directory, device="cuda")
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to("cuda").eval()
    return request.param, ours, ref


def prompts(n: int, length: int = 12, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (length + 5 * i,), generator=g).tolist() for i in range(n)]


def transformers_greedy(ref, ids: list[int], steps: int) -> list[int]:
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids], device="cuda"), max_new_tokens=steps, do_sample=False,
                           eos_token_id=None, pad_token_id=0)  # like ignore_eos: EOS may be drawn, and goes on
    return out[0, len(ids) :].tolist()


def run_all(engine: LLMEngine, batch: list[list[int]], params=GREEDY) -> list[list[int]]:
    return run_to_completion(engine, batch, params)  # the CPU tests' helper, with this file's defaults


def test_weights_and_cache_live_on_the_device(pair):
    _, ours, _ = pair
    assert {p.device.type for p in ours.model.parameters()} == {"cuda"}
    engine = LLMEngine(ours, None, EngineConfig(kv_memory_bytes=1 << 21))  # Gemma 3's 512 tokens: 192 blocks
    assert engine.cache.device.type == "cuda"


def test_logits_on_cuda_match_transformers(pair):
    kind, ours, ref = pair
    ids = torch.tensor(prompts(1, length=40)[0], device="cuda")[None]
    with torch.inference_mode():
        expected = ref(ids).logits
        cache = ContiguousKVCache.for_model(ours.config, 64, device="cuda")
        got = ModelDriver(ours.model).run(ids, cache, logits_index=torch.arange(40, device="cuda"))
    assert got.device.type == "cuda"
    assert (got - expected).abs().max().item() < 1e-4, kind


def test_batched_paged_engine_on_cuda_matches_transformers_generate(pair):
    kind, ours, ref = pair
    batch = prompts(4, seed=1)
    expected = [transformers_greedy(ref, p, 32) for p in batch]
    engine = LLMEngine(ours, None, EngineConfig(max_num_batched_tokens=24))  # prompts split into chunks
    assert run_all(engine, batch) == expected, kind
    assert run_all(engine, batch) == expected, "second run: prefix-cache hits"
    assert engine.kv.pool.check_integrity().used == 0
    burst = [p[:20] for p in prompts(4, length=20, seed=3)]  # fresh prompts of one length: one attention call
    assert run_all(LLMEngine(ours, None), burst) == [transformers_greedy(ref, p, 32) for p in burst], kind


def test_contiguous_and_no_cache_engines_agree_on_cuda(pair):
    _, ours, _ = pair
    ids = prompts(1, seed=2)[0]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    cached = list(ReferenceEngine(ours).generate(ids, params, RequestMetrics()))
    recomputed = list(ReferenceEngine(ours, use_cache=False).generate(ids, params, RequestMetrics()))
    assert cached == recomputed and len(cached) == 12


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_weights_and_cache_on_cuda(tmp_path, dtype):
    directory = build_tiny("qwen3", tmp_path)
    full, half = load_model(directory, device="cuda"), load_model(directory, dtype=dtype, device="cuda")
    ids = torch.tensor(prompts(1, length=30, seed=3)[0], device="cuda")[None]
    with torch.inference_mode():
        logits = []
        for loaded in (full, half):
            cache = ContiguousKVCache.for_model(loaded.config, 32, dtype=loaded.model.dtype, device="cuda")
            logits.append(ModelDriver(loaded.model).run(ids, cache).float())
            assert cache.k[0].dtype == loaded.model.dtype
    scale = logits[0].abs().max().item()
    assert (logits[0] - logits[1]).abs().max().item() < 0.05 * scale
    engine = LLMEngine(half, None)
    out = run_all(engine, prompts(3, seed=4), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [len(o) for o in out] == [8, 8, 8]


def test_the_calculators_bytes_are_what_cuda_allocates():
    """Qwen3-0.6B's real cache shape, 512 tokens in bf16: seed 000's 114,688 bytes per token, on the GPU."""
    from kvlab.memory import kv_bytes, load_config

    config = load_config("qwen3-0.6b")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    cache = ContiguousKVCache.for_model(config, 512, dtype=torch.bfloat16, device="cuda")
    allocated = torch.cuda.memory_allocated() - before
    assert allocated == cache.nbytes() == kv_bytes(load_config("qwen3-0.6b"), context=512, kv_dtype="bfloat16")
    assert cache.bytes_per_token() == 114_688
    del cache


def _bundled(name: str) -> str:
    from importlib.resources import files

    return files("kvlab.configs").joinpath(f"{name}.json").read_text()


def test_qwen3_shaped_model_on_cuda_matches_transformers(tmp_path):
    """Qwen3-0.6B's real widths and vocabulary (4 of its 28 layers, random weights): 32 greedy tokens."""
    import transformers

    cfg = json.loads(_bundled("qwen3-0.6b"))
    cfg.update(num_hidden_layers=4, torch_dtype="float32")
    cfg.pop("layer_types", None)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg)).eval()
    model.save_pretrained(tmp_path)
    ref = model.to("cuda")
    ours = load_model(tmp_path, device="cuda")
    g = torch.Generator().manual_seed(5)
    batch = [torch.randint(100, 150_000, (n,), generator=g).tolist() for n in (7, 40, 130)]
    expected = [transformers_greedy(ref, p, 32) for p in batch]
    assert run_all(LLMEngine(ours, None), batch) == expected


def test_llm_on_cuda_gives_the_cpu_text(tiny_chat_model):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    cpu, gpu = LLM(tiny_chat_model, max_model_len=256), LLM(tiny_chat_model, device="cuda", max_model_len=256)
    questions = ["hello there", "the capital of France is"]
    assert [o.token_ids for o in gpu.generate(questions, params)] == [o.token_ids for o in cpu.generate(questions, params)]
    sampled = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    first, second = gpu.generate("hello", sampled), gpu.generate("hello", sampled)
    assert first.token_ids == second.token_ids
    assert first.metrics.kv_cache_bytes > 0 and first.ttft_s > 0
    chat = gpu.chat([{"role": "user", "content": "hi"}], params)
    assert chat.generated_tokens == 24


def test_kvlab_run_on_cuda_prints_its_json(tiny_chat_model, capsys):
    from kvlab.cli import main

    assert main(["run", str(tiny_chat_model), "hello", "--device", "cuda", "--json", "--max-tokens", "8",
                 "--ignore-eos"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["generated_tokens"] == 8 and out["kv_cache_bytes"] > 0
    assert out["peak_memory_bytes"] > 0


def test_server_on_cuda_answers_a_chat_completion(tiny_chat_model):
    from fastapi.testclient import TestClient

    from kvlab.server.app import ServerConfig, create_app
    from kvlab.server.async_engine import AsyncEngine

    llm = LLM(tiny_chat_model, device="cuda", max_model_len=256)
    app = create_app(llm, AsyncEngine(llm.engine), ServerConfig(model_name="tiny"))
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
    with TestClient(app, base_url="http://localhost") as client:  # the Host header must name this server
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] <= 8
        streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
        assert streamed.text.rstrip().endswith("data: [DONE]")
    assert llm.engine.kv.pool.num_used_blocks == 0


def test_a_gguf_keeps_its_blocks_on_cuda_and_agrees_with_the_cpu(tmp_path):
    """On CUDA the blocks stay stored (dequantized layer by layer on the device by the reference code);
    logits agree with the same file on the CPU, and greedy tokens with its expanded float copy."""
    from kvlab.quant.linear import PackedLinear
    from tiny import add_tiny_tokenizer, build_tiny_gguf

    directory = tmp_path / "m"
    build_tiny("qwen2", directory)
    add_tiny_tokenizer(directory)
    path = build_tiny_gguf(directory, tmp_path / "q.gguf", quant=lambda name: "Q4_0" if "attn_q" in name else "Q8_0")
    gpu, cpu = load_model(path, device="cuda"), load_model(path, dequantize=True)
    assert isinstance(gpu.model.layers[0].attn.qkv_proj, PackedLinear)
    assert gpu.model.layers[0].attn.qkv_proj.packed_0.device.type == "cuda"
    ids = torch.tensor([prompts(1, length=20, seed=5)[0]])
    a = ModelDriver(gpu.model).run(ids.cuda(), ContiguousKVCache.for_model(gpu.config, 32, device="cuda"))
    b = ModelDriver(cpu.model).run(ids, ContiguousKVCache.for_model(cpu.config, 32))
    assert (a.cpu() - b).abs().max().item() < 1e-4 * max(b.abs().max().item(), 1.0)
    batch = prompts(3, seed=6)
    assert run_all(LLMEngine(gpu, None), batch) == run_all(LLMEngine(cpu, None), batch)
