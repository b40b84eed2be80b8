"""The device's ops (kvlab/backends/ops.py): which code computes a module's products and small ops is chosen
once per model, by its device, and put in force by the driver; the kernels never ask a tensor's device.

PyTorch's own ops are what CUDA (and any device without kernels) runs. Run here on a CPU, they must give
the C kernels' tokens: that proves the code a GPU takes without needing one."""

from __future__ import annotations

import pytest
import torch

from kvlab.backends.ops import ONE_THREAD_ROWS, OPS, TORCH, CpuOps, CudaOps, TorchOps, current_ops, ops_for
from kvlab.kernels import ThreadPolicy
from kvlab.kernels.decode import library
from kvlab.kv.cache import ContiguousKVCache
from kvlab.model.loader import load_model
from kvlab.runner.driver import ModelDriver
from tiny import add_tiny_tokenizer, build_tiny, build_tiny_gguf

needs_kernels = pytest.mark.skipif(not library(), reason="no C compiler: the CPU's ops have no kernels")


def test_each_device_kind_gets_its_ops():
    assert isinstance(ops_for("cpu"), CpuOps) and ops_for(torch.device("cpu")) is OPS["cpu"]
    assert isinstance(ops_for("cuda:1"), CudaOps) and ops_for("cuda").keeps_blocks
    assert ops_for("meta") is TORCH and ops_for("mps") is TORCH and not TORCH.keeps_blocks
    assert current_ops() is TORCH  # outside any driver: PyTorch's own code, correct on every device
    with ops_for("cpu").active():
        assert current_ops() is OPS["cpu"]
    assert current_ops() is TORCH


def test_a_driver_puts_its_models_ops_in_force_around_a_pass(tmp_path):
    loaded = load_model(build_tiny("llama", tmp_path, head_dim=32))
    seen = []
    hook = loaded.model.layers[0].register_forward_hook(lambda *args: seen.append(current_ops()))
    driver = ModelDriver(loaded.model, ThreadPolicy(threads=1))
    assert driver.ops is OPS["cpu"]
    driver.run(torch.tensor([[5, 6, 7]]), ContiguousKVCache.for_model(loaded.config, 8))
    assert seen == [OPS["cpu"]] and current_ops() is TORCH
    plain = ModelDriver(loaded.model, ops=TORCH)
    plain.run(torch.tensor([[5]]), ContiguousKVCache.for_model(loaded.config, 8))
    assert seen[-1] is TORCH
    hook.remove()
    # the decode backend is the ops' choice too: the C step for the CPU's, the modules for PyTorch's
    assert driver.decode_path().name == "cpu-c"
    assert plain.decode_path().name == "modules" and "torch ops" in plain.decode_path().reason


@pytest.fixture(scope="module", params=["llama", "gemma3", "qwen3-q8_0.gguf", "llama-q4_1.gguf"])
def tiny(request, tmp_path_factory):
    kind, _, quant = request.param.partition("-")
    directory = build_tiny(kind, tmp_path_factory.mktemp(kind), head_dim=32)
    if quant:
        add_tiny_tokenizer(directory)
        return load_model(build_tiny_gguf(directory, directory / "m.gguf", quant.removesuffix(".gguf").upper()))
    return load_model(directory)


def greedy(driver: ModelDriver, config, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after `prompt` (a contiguous cache: the prompt in one pass, then one token a pass),
    and the first decode pass's logits."""
    cache = ContiguousKVCache.for_model(config, len(prompt) + steps + 1)
    logits = driver.run(torch.tensor([prompt]), cache)
    tokens, first = [], None
    for _ in range(steps):
        tokens.append(int(logits[0].argmax()))
        logits = driver.run(torch.tensor([[tokens[-1]]]), cache)
        first = logits[0].clone() if first is None else first
    return tokens, first


@needs_kernels
def test_pytorchs_ops_on_a_cpu_give_the_kernels_tokens(tiny):
    """The same model through the CPU's ops (the GEMV, quant.c's block products, the small ops in C) and
    through PyTorch's (the GGUF blocks dequantized by the reference, as on CUDA): the same greedy tokens,
    logits within float32 rounding of each other."""
    from kvlab.kernels.gemv import pool_stats

    prompt = [(7 * i + 3) % 400 + 5 for i in range(24)]
    policy = ThreadPolicy(threads=2, fused_decode=False)  # the modules on both sides: their ops differ
    jobs = pool_stats()["generation"]
    kernels, k_logits = greedy(ModelDriver(tiny.model, policy), tiny.config, prompt, 12)
    assert pool_stats()["generation"] > jobs  # the kernels' pool ran the products
    jobs = pool_stats()["generation"]
    plain, t_logits = greedy(ModelDriver(tiny.model, policy, ops=CudaOps()), tiny.config, prompt, 12)
    assert pool_stats()["generation"] == jobs  # and not one of them here
    assert kernels == plain
    assert (k_logits - t_logits).abs().max() <= 1e-4 * t_logits.abs().max()


def test_pytorchs_ops_never_call_a_kernel(monkeypatch):
    """TorchOps (and so CUDA's) run no C code: every kernel entry point the CPU's ops use is poisoned."""
    from kvlab.kernels import deltanet, gemv, mxfp4, quant

    def poisoned(*args, **kwargs):
        raise AssertionError("a kernel was called under PyTorch's ops")

    for module, name in [(gemv, "linear"), (gemv, "small_ops_apply"), (quant, "applies"), (quant, "packed_linear"),
                         (quant, "dequantize"), (mxfp4, "applies"), (deltanet, "applies")]:  # fmt: skip
        monkeypatch.setattr(module, name, poisoned)
    ops = TorchOps()
    x = torch.randn(2, 16)
    w = torch.randn(8, 16)
    assert torch.equal(ops.linear(x, w), torch.nn.functional.linear(x, w))
    assert not ops.small_ops(x, 2) and not ops.packed_applies(x, ["Q8_0"]) and not ops.mxfp4_applies(x)
    assert not ops.products_apart(10**6) and not ops.chunked_experts(100) and not ops.experts_applies(x, ["Q8_0"])
    assert not ops.deltanet_applies(x, x, 1) and not ops.kernel_rows
    from kvlab.quant.linear import PackedTensor

    part = PackedTensor("F32", (8, 16), w.contiguous().view(torch.uint8).view(8, 64))
    assert torch.equal(ops.packed_linear(x, [part, part], 16), torch.cat([x @ w.T] * 2, dim=-1))


@needs_kernels
def test_a_pass_the_kernels_pool_takes_runs_pytorchs_ops_on_one_thread(tmp_path):
    """PyTorch's OpenMP workers, woken by an op on two threads, spin on the cores the kernels' pool needs:
    a pass whose products the pool takes (decode-sized, or a short prompt over GGUF blocks on the block
    tiles) runs PyTorch's small ops on one thread; a prompt that goes to BLAS keeps the policy's threads."""
    from kvlab.kernels import quant

    ops, policy = OPS["cpu"], ThreadPolicy(threads=2)
    blocks, interleaved = frozenset({"Q8_0", "Q4_K"}), frozenset({"Q8_0x16", "Q4_Kx16"})
    assert ops.torch_threads(policy, 1) == 1  # a decode step: the pool's, packed or not
    assert ops.torch_threads(policy, 64) == 2  # a float model's prompt: BLAS on both threads
    assert ops.torch_threads(policy, 64, blocks) == 1  # the block tiles take a short prompt
    limit = quant.PROMPT_TILE_ROWS.get(quant.isa())
    if limit is not None:  # past it, the matrix is dequantized for BLAS
        assert ops.torch_threads(policy, limit + 1, blocks) == 2
    # 8-bit activations: the interleaved matrices have no float copy, the pool takes every pass; a
    # matrix left exact among them goes to BLAS past the tiles' limit. PyTorch's ops of a big pass keep
    # both threads
    assert ops.torch_threads(policy, ONE_THREAD_ROWS, interleaved) == 1
    assert ops.torch_threads(policy, ONE_THREAD_ROWS + 1, interleaved) == 2  # a big pass's elementwise ops
    if limit is not None:
        assert ops.torch_threads(policy, limit + 1, interleaved | {"Q4_K"}) == 2
    assert ops.torch_threads(ThreadPolicy(threads=2, packed_prompts=False), 64, blocks) == 2
    assert TORCH.torch_threads(policy, 64, blocks) == 2  # PyTorch's ops: no pool to share with

    seen = []
    directory = build_tiny("llama", tmp_path, head_dim=32)
    add_tiny_tokenizer(directory)
    gguf = build_tiny_gguf(directory, tmp_path / "m.gguf", "Q8_0")
    for loaded, threads in ((load_model(directory), 2), (load_model(gguf), 1)):  # a 40-token prompt
        hook = loaded.model.layers[0].register_forward_hook(lambda *args: seen.append(torch.get_num_threads()))
        driver = ModelDriver(loaded.model, policy)
        assert driver.packed == ({"Q8_0"} if threads == 1 else set())
        driver.run(torch.tensor([list(range(5, 45))]), ContiguousKVCache.for_model(loaded.config, 48))
        assert seen[-1] == threads
        hook.remove()
