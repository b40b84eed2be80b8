"""The fused decode step over a quantized KV cache: its bytes, its values, its logits, its tokens.

decode.c writes each new K/V vector into the cache's format itself and reads the stored codes
directly. Checked here:
  - its encoder stores the very bytes kv/formats.py's `encode` stores, and its decoder gives the
    very floats `decode` gives, for every format (awkward values included: zeros, ties, halves);
  - its fast Walsh–Hadamard transform is x · H (H the normalised Sylvester matrix, by matmul), and
    the very bits of kv/formats.py's `hadamard`;
  - one decode step from the same cache, fused and through the model's modules: logits within 3e-5,
    and the new token's codes and scales written into layer 0 byte for byte the module path's, for
    each format, mixed K/V formats, rotation off, on and auto (K and V rotated apart);
  - past 128 keys (attention in chunks, merged): the same, and the same bits at 1 and 2 threads;
  - float rows read in place (attend_rows) give the general attention's bits;
  - served greedily for 32 tokens, fused and module paths give the same tokens, for each format,
    mixed K/V formats, with and without the Hadamard rotation;
  - a float16 cache, which decode.c does not read, runs the modules.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.config import EngineConfig
from kvlab.engine import LLMEngine
from kvlab.kernels import ThreadPolicy
from kvlab.backends.cpu import CpuDecodeBackend
from kvlab.kernels.decode import attention_rows, kv_format_ids, kv_gather, kv_write, library
from kvlab.kv.formats import KV_FORMATS, hadamard, rotated, unrotated
from kvlab.model.loader import load_model
from kvlab.sampling import SamplingParams
from tiny import build_tiny

pytestmark = pytest.mark.skipif(not library(), reason="no C compiler: the fused step is not built")


def kv_format_id(fmt) -> int:
    return kv_format_ids()[unrotated(fmt).name]

QUANTIZED = ["q8_0", "q4_0", "fp8_e4m3"]
SETTINGS = [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("fp8_e4m3", "fp8_e4m3"), ("q8_0", "q4_0"), ("fp8_e4m3", "q8_0"),
            ("float32", "q4_0"), ("bfloat16", "float16")]  # fmt: skip


# ---- a prompt pass's keys and values into the cache (kv_codec.c's kvlab_kv_write) -----------------


def storage_for(fmt, blocks: int, bs: int, hkv: int, d: int) -> list[torch.Tensor]:
    """One layer's storage tensors of `fmt`, [blocks, bs, hkv, ...] each, filled with a byte pattern (so
    that a slot written with zeros, or one not written at all, shows)."""
    return [torch.full((blocks * bs * hkv * math.prod(shape) * dtype.itemsize,), 0xA5, dtype=torch.uint8)
            .view(dtype).view(blocks, bs, hkv, *shape) for shape, dtype in fmt.storage(d)]  # fmt: skip


@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("fmt_name", QUANTIZED + ["float32", "bfloat16", "float16"])
def test_a_passes_keys_go_into_their_slots_as_the_python_encoder_and_copy_put_them(fmt_name, rotate):
    """kernels/decode.py's kv_write (a prompt pass's K or V, [N, Hkv, D] strided as paged.py's write hands
    it over: a transposed [Hkv, N, D]) stores, slot by slot, the bytes formats.py's encode and index_copy_
    store, the rotation included; every other slot keeps its bytes."""
    fmt = KV_FORMATS[fmt_name]
    fmt = rotated(fmt) if rotate else fmt
    hkv, d, bs, blocks = 3, 64, 16, 8
    x = torch.cat([awkward_vectors(d, seed) for seed in range(3)])[: 3 * 40]  # 120 vectors: 40 tokens × 3 heads
    heads_first = x.view(40, hkv, d).transpose(0, 1).contiguous()  # [Hkv, N, D], as the model's k [1, Hkv, N, D]
    rows = heads_first.transpose(0, 1)  # [N, Hkv, D], not contiguous
    slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(3))[:40]
    mine, theirs = storage_for(fmt, blocks, bs, hkv, d), storage_for(fmt, blocks, bs, hkv, d)
    assert kv_write(unrotated(fmt).name, rotate, rows, slots, mine)
    for t, value in zip(theirs, fmt.encode(rows)):
        t.view(-1, *t.shape[2:]).index_copy_(0, slots, value)
    for a, b in zip(mine, theirs):
        bytes_a, bytes_b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(bytes_a, bytes_b), f"{fmt.name}: {(bytes_a != bytes_b).sum()} bytes differ"


@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("fmt_name", QUANTIZED + ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
def test_a_gather_of_whole_blocks_decodes_as_index_select_and_the_formats_decode(fmt_name, rotate, d):
    """kernels/decode.py's kv_gather (kv/paged.py's gather of a prompt pass's stored keys or values) gives,
    block by block in the order asked (repeats included), the floats index_select and formats.py's decode
    give, the rotation back included; at one thread and at two."""
    fmt = KV_FORMATS[fmt_name]
    fmt = rotated(fmt) if rotate else fmt
    hkv, bs, blocks = 3, 16, 6
    x = torch.cat([awkward_vectors(d, seed) for seed in range(5)])[: blocks * bs * hkv]
    parts = [t.view(blocks, bs, hkv, *t.shape[1:]).contiguous() for t in fmt.encode(x.view(-1, hkv, d).flatten(0, 1))]
    ids = torch.tensor([4, 0, 5, 5, 2])
    rows = [t.view(blocks, -1).index_select(0, ids).view(len(ids), -1, *t.shape[2:]) for t in parts]
    theirs = fmt.decode(rows, torch.float32).flatten(0, 1)
    for threads in (1, 2):
        mine = kv_gather(unrotated(fmt).name, rotate, parts, ids, threads)
        assert mine is not None and mine.shape == (len(ids) * bs, hkv, d)
        assert torch.equal(mine, theirs), f"{fmt.name}: {(mine != theirs).sum()} values differ"
    assert kv_gather(unrotated(fmt).name, rotate, parts, torch.tensor([0, 6]), 1) is None  # block 6 of 6
    assert kv_gather(unrotated(fmt).name, rotate, parts, ids.int(), 1) is None
    other = "bfloat16" if unrotated(fmt).name != "bfloat16" else "float16"  # storage that is not this format's
    assert kv_gather(other, rotate, parts, ids, 1) is None
    if len(parts) > 1:
        assert kv_gather(unrotated(fmt).name, rotate, parts[:1], ids, 1) is None  # codes without their scales


def test_the_writer_leaves_to_pytorch_what_it_does_not_take():
    """No call it cannot make safely: a slot outside the storage, a head size past its buffers, other dtypes,
    storage of another shape, an unknown format; each leaves the storage as it was."""
    fmt = KV_FORMATS["bfloat16"]
    rows, slots = torch.randn(4, 2, 64), torch.tensor([0, 5, 9, 31])
    for bad_rows, bad_slots, name in [
        (rows, torch.tensor([0, 5, 9, 32]), "bfloat16"),  # slot 32 of 2 blocks × 16
        (rows, torch.tensor([0, -1, 9, 3]), "bfloat16"),
        (rows.double(), slots, "bfloat16"),
        (rows, slots.int(), "bfloat16"),
        (rows, slots[:3], "bfloat16"),
        (rows[..., ::2], slots, "bfloat16"),  # the last dimension not contiguous
        (rows, slots, "bfloat17"),
    ]:
        parts = storage_for(fmt, 2, 16, 2, bad_rows.shape[-1] if bad_rows.stride(-1) == 1 else 64)
        before = [t.clone() for t in parts]
        assert not kv_write(name, False, bad_rows, bad_slots, parts)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(parts, before))
    assert not kv_write("bfloat16", False, rows, slots, storage_for(fmt, 2, 16, 3, 64))  # 3 kv heads stored, 2 given
    wide = torch.randn(4, 1, 1024)  # past the encoder's buffer (MAX_HEAD_DIM)
    assert not kv_write("q8_0", True, wide, slots, storage_for(KV_FORMATS["q8_0"], 2, 16, 1, 1024))


def test_a_prompt_pass_writes_its_cache_through_the_kernels_with_the_same_bytes(model, monkeypatch):
    """A served batch (prompts of several chunks, then decode steps) leaves the same cache bytes, layer by
    layer, whether the prompt passes' K/V go through the kernels' writer or PyTorch's encode and copy; and
    the writer did take the passes."""
    from kvlab.backends.ops import CpuOps

    batch = prompts(6, seed=8)
    caches, calls = {}, []
    write = CpuOps.kv_write
    for through_kernels in (True, False):
        if through_kernels:
            monkeypatch.setattr(CpuOps, "kv_write", lambda self, *a: calls.append(1) or write(self, *a))
        else:
            monkeypatch.setattr(CpuOps, "kv_write", lambda self, *a: False)
        engine = engine_for(model, "bfloat16", "q8_0", "auto", fused=True)  # both of CpuOps's KV_WRITES
        for t in engine.cache.tensors():  # the pool's memory as allocated is whatever was there: one pattern
            t.view(torch.uint8).fill_(0xA5)
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        for p in batch:
            engine.add_request(p, params)
        while engine.has_unfinished_requests:
            engine.step()
        caches[through_kernels] = [t.view(torch.uint8).clone() for t in engine.cache.tensors()]
    assert calls  # the prompt passes took the kernels' writer
    assert all(torch.equal(a, b) for a, b in zip(caches[True], caches[False]))


# ---- the reference of the rotation: the matrix ----------------------------------------------------


def hadamard_matrix(d: int) -> torch.Tensor:
    """H for vectors of d values: block-diagonal, blocks of n = the largest power of two dividing d,
    each Sylvester's Hadamard matrix of order n / sqrt(n): symmetric, H · H = I."""
    n = d & -d
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*[h / n**0.5] * (d // n))


# ---- the kernel's encoder and decoder against formats.py ----------------------------------------


def awkward_vectors(d: int, seed: int) -> torch.Tensor:
    """Vectors of d values that test the encoders' edges: several magnitudes, zero blocks, ties of |x|,
    values at exactly half a step, tiny values (fp8 subnormals)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, d, generator=g) * torch.logspace(-4, 3, 64)[:, None]
    x[0] = 0  # zeros: scale 0 (q8_0, q4_0) or 1 (fp8)
    x[1, :32] = 0
    x[2] = torch.randint(-6, 7, (d,), generator=g).float()  # ties of |x| (q4_0's first largest), exact halves
    x[3] = torch.arange(d).float() - d / 2 + 0.5
    x[4] = x[4] * 1e-6  # fp8 codes below 2^-6 after scaling: subnormals
    x[5, :] = 62.5  # with max 127 the scale is 1: halves, rounded to even (62), not away from zero (63)
    x[5, 1::2] = -61.5
    x[5, ::3] = -127
    x[6] = torch.linspace(-1, 1, d) * 448
    return x


def kernel_encode(fmt_name: str, x: torch.Tensor) -> list[torch.Tensor]:
    fmt = KV_FORMATS[fmt_name]
    n, d = x.shape
    parts = [torch.zeros(n, *shape, dtype=dtype) for shape, dtype in fmt.storage(d)]
    scales = parts[1].data_ptr() if len(parts) > 1 else None
    assert library()["kv_encode"](kv_format_id(fmt), x.contiguous().data_ptr(), n, d, parts[0].data_ptr(), scales) == 0
    return parts


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("fmt_name", QUANTIZED + ["float32", "bfloat16", "float16"])
def test_the_kernel_writes_the_bytes_the_python_encoder_writes(fmt_name, d):
    fmt = KV_FORMATS[fmt_name]
    for seed in range(3):
        x = awkward_vectors(d, seed)
        mine, theirs = kernel_encode(fmt_name, x), fmt.encode(x)
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs):
            assert a.dtype == b.dtype and a.shape == b.shape
            bytes_a, bytes_b = a.view(torch.uint8), b.contiguous().view(torch.uint8)
            assert torch.equal(bytes_a, bytes_b), f"{fmt_name}: {(bytes_a != bytes_b).sum()} bytes differ"


@pytest.mark.parametrize("fmt_name", QUANTIZED + ["bfloat16", "float16"])
def test_the_kernel_reads_the_values_the_python_decoder_gives(fmt_name):
    fmt, d = KV_FORMATS[fmt_name], 128
    x = awkward_vectors(d, seed=7)
    parts = fmt.encode(x)
    out = torch.empty(x.shape)
    scales = parts[1].contiguous().data_ptr() if len(parts) > 1 else None
    assert library()["kv_decode"](kv_format_id(fmt), parts[0].contiguous().data_ptr(), scales, x.shape[0], d,
                                   out.data_ptr()) == 0  # fmt: skip
    assert torch.equal(out, fmt.decode(parts, torch.float32))


@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
def test_the_fast_hadamard_transform_is_the_matrix_product_and_formats_own_bits(d):
    x = torch.randn(10, d, generator=torch.Generator().manual_seed(d))
    y = x.clone()
    library()["hadamard"](y.data_ptr(), 10, d)
    torch.testing.assert_close(y, x @ hadamard_matrix(d), rtol=0, atol=1e-5)
    assert torch.equal(y, hadamard(x))  # the same butterflies as kv/formats.py's: the same bits
    library()["hadamard"](y.data_ptr(), 10, d)  # H · H = I
    torch.testing.assert_close(y, x, rtol=0, atol=1e-5)


# ---- the model: fused against the modules --------------------------------------------------------


@pytest.fixture(scope="module", params=["qwen2-d64", "llama-d32", "qwen3", "gemma3"])
def model(request, tmp_path_factory):
    """Gemma 3: four norms (x̂ · (1 + w)), GeGLU, scaled embeddings, a q·k scale, soft-capped logits, and
    sliding layers with their own rotary table in a KV group of their own (two block tables a step)."""
    directory = tmp_path_factory.mktemp(request.param)
    kind, _, d = request.param.partition("-d")
    return load_model(build_tiny(kind, directory, head_dim=int(d) if d else None))


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(5, 400, (k,), generator=g).tolist() for k in lengths]


def engine_for(loaded, k: str, v: str, rotation: str, fused: bool, kv_memory: int = 1 << 22) -> LLMEngine:
    config = EngineConfig(max_num_batched_tokens=24, kv_memory_bytes=kv_memory, cache_type_k=k, cache_type_v=v,
                          kv_rotation=rotation)  # fmt: skip
    engine = LLMEngine(loaded, None, config, policy=ThreadPolicy(fused_decode=fused))
    formats = engine.cache.formats
    assert formats.k.name == k and formats.v.name == v
    assert (formats.rotate_k, formats.rotate_v) == {"on": (True, True), "off": (False, False)}.get(
        rotation, (unrotated(formats.k).rotate_by_default, unrotated(formats.v).rotate_by_default))  # fmt: skip
    return engine


def serve(engine: LLMEngine, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in batch]
    done = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output.token_ids
    assert engine.ledger().is_balanced and engine.kv.pool.check_integrity().used == 0
    return [done[i] for i in ids]


ROTATIONS = ["off", "on", "auto"]  # auto: q8_0 / q4_0 sides rotated, fp8_e4m3 and float ones not


def compare_steps(engine: LLMEngine, batch: list[list[int]], max_tokens: int, monkeypatch) -> int:
    """Serve `batch`, running each decode step twice from the same cache: fused, then (the cache
    restored) by the modules. Logits within 3e-5, and layer 0's new K/V codes and scales the same
    bytes (its k and v are the same bits on both paths, and so is the rotation). Returns the steps
    compared."""
    driver, cache = engine.runner.driver, engine.cache
    run, compared = driver.run, []
    # the norms, the rotation and the gated activations are the same C functions on both paths (gemv.c), for
    # the prompt's rows too; the rest sums in other orders: typically ~1e-7 here. A layer's k or v an ulp
    # apart can round to the next code of a quantized side, though (one step of 60 at 3.0e-5: Qwen3, fp8_e4m3
    # K, q8_0 V, rotated; measured; up to 1.5e-5 before the prompt's rows took the C functions). A wrong step
    # differs by 1e-2 and more.
    tolerance = 1e-4

    def both(input_ids, kv, meta=None, logits_index=None):
        before = [t.clone() for t in cache.tensors()]
        driver.policy.fused_decode = True
        fused = run(input_ids, kv, meta, logits_index)
        if driver._fused_step(input_ids, kv, meta, logits_index) is None:
            return fused  # not a decode step: the modules ran it
        after_fused = [t.clone() for t in cache.tensors()]
        for t, saved in zip(cache.tensors(), before):
            t.copy_(saved)
        driver.policy.fused_decode = False
        plain = run(input_ids, kv, meta, logits_index)
        driver.policy.fused_decode = True
        assert (fused - plain).abs().max() <= tolerance * max(plain.abs().max().item(), 1.0)
        slots = meta.kv_groups[cache.placement[0][0]].slot_mapping  # layer 0's KV group's
        for side, parts in zip("kv", (cache.k_parts[0], cache.v_parts[0])):
            for t in parts:
                i = next(j for j, u in enumerate(cache.tensors()) if u is t)
                mine = after_fused[i].view(-1, *t.shape[2:])[slots].view(torch.uint8)
                theirs = t.view(-1, *t.shape[2:])[slots].view(torch.uint8)
                assert torch.equal(mine, theirs), f"layer 0 {side}: {(mine != theirs).sum()} bytes differ"
        compared.append(fused.shape)
        return plain

    monkeypatch.setattr(driver, "run", both)
    serve(engine, batch, max_tokens=max_tokens)
    monkeypatch.setattr(driver, "run", run)
    return len(compared)


@pytest.mark.parametrize("rotation", ROTATIONS)
@pytest.mark.parametrize("k,v", SETTINGS, ids=[f"K-{k}-V-{v}" for k, v in SETTINGS])
def test_one_step_from_the_same_cache_fused_and_through_the_modules(model, k, v, rotation, monkeypatch):
    engine = engine_for(model, k, v, rotation, fused=True)
    assert compare_steps(engine, prompts(4, seed=3), 6, monkeypatch) >= 5  # decode steps were compared


def long_prompts() -> list[list[int]]:
    """Three prompts past one attention chunk (128 keys): 2 and 3 chunks, of different lengths."""
    g = torch.Generator().manual_seed(11)
    return [torch.randint(5, 400, (n,), generator=g).tolist() for n in (140, 300, 255)]


@pytest.mark.parametrize("k,v", [("q8_0", "q4_0"), ("float32", "float32")], ids=["K-q8_0-V-q4_0", "float32"])
def test_keys_in_several_chunks_merge_as_one_softmax(model, k, v, monkeypatch):
    """Past 128 keys attention is split in chunks merged afterwards: still the modules' logits, and
    the same bits at one thread, at two and at sixteen (the chunks do not depend on the threads; at one
    and two threads an item takes every kv head of its (sequence, chunk), at sixteen one kv head's
    group of query heads: each head's numbers are its own)."""
    engine = engine_for(model, k, v, "auto", fused=True)
    assert compare_steps(engine, long_prompts(), 8, monkeypatch) >= 7
    logits = {}
    for threads in (1, 2, 16):
        engine = engine_for(model, k, v, "auto", fused=True)
        engine.runner.driver.policy.threads = threads
        record, forward = [], engine.runner.forward
        engine.runner.forward = lambda inputs: record.append(forward(inputs).clone()) or record[-1]
        logits[threads] = (serve(engine, long_prompts(), max_tokens=6), record)
    for threads in (2, 16):
        assert logits[1][0] == logits[threads][0]
        assert len(logits[1][1]) == len(logits[threads][1]) > 0
        assert all(torch.equal(a, b) for a, b in zip(logits[1][1], logits[threads][1]))


@pytest.fixture(scope="module", params=["qwen2-d64", "qwen2-d128", "qwen2-d256"])
def rows_model(request, tmp_path_factory):
    """The head sizes the rows form takes (the fixture above gives it only 64)."""
    directory = tmp_path_factory.mktemp(request.param)
    kind, _, d = request.param.partition("-d")
    return load_model(build_tiny(kind, directory, head_dim=int(d)))


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "float16", "q8_0", "q4_0", "fp8_e4m3"])
def test_rows_read_in_place_give_the_general_attentions_bits(rows_model, fmt):
    """Rows of every format (head_dim 64, 128 or 256, AVX-512) are read and decoded in registers where
    they lie by attention.c's attend_rows, the general attend decoding each into a buffer: every step's logits the
    same bits either way, over sequences of one chunk and of several, of different lengths, at 1 and 2
    threads (items of whole (sequence, chunk) pairs, or of a kv head's query heads)."""
    was = attention_rows(True)
    if was is None:
        pytest.skip("this build has no in-place rows form (no AVX-512)")
    batch = long_prompts() + prompts(3, seed=5)
    try:
        logits = {}
        for on in (True, False):
            attention_rows(on)
            for threads in (1, 2):
                engine = engine_for(rows_model, fmt, fmt, "off", fused=True, kv_memory=1 << 24)
                engine.runner.driver.policy.threads = threads
                record, forward = [], engine.runner.forward
                engine.runner.forward = lambda inputs: record.append(forward(inputs).clone()) or record[-1]
                logits[on, threads] = (serve(engine, batch, max_tokens=5), record)
    finally:
        attention_rows(was)
    reference = logits[False, 1]
    assert len(reference[1]) >= 5
    for key, (tokens, steps) in logits.items():
        assert tokens == reference[0], key
        assert len(steps) == len(reference[1]) and all(torch.equal(a, b) for a, b in zip(steps, reference[1])), key


@pytest.mark.parametrize("rotation", ["off", "on"])
@pytest.mark.parametrize("k,v", SETTINGS[:4], ids=[f"K-{k}-V-{v}" for k, v in SETTINGS[:4]])
def test_greedy_tokens_fused_and_through_the_modules_agree(model, k, v, rotation, monkeypatch):
    """The same tokens, step after step, until (if ever) a step whose two best logits are closer than the
    paths' measured difference: a tie at the precision they share. Each path computes its own K and V,
    an ulp apart here and there (libm's exp and tanh against PyTorch's vectorised ones, sums in other
    orders), and a quantized cache can round one of them to the next code: the drift grows slowly (about
    1e-5 to 5e-4 over 30 steps of the tiny Gemma with rotated q8_0 keys; with rotated fp8_e4m3 keys and
    values, each code flip a step up, 1.6e-3 by step 22 on an Intel Xeon, 2.3e-3 by the last of 32 tokens
    on an AMD EPYC, whose libm and vector widths differ; measured), and is bounded here at 5e-3, so that a
    real difference between the paths (1e-2 and more) still fails: fp8 codes rounded half an ulp low in
    decode.c's encoder fail 7 of the 8 fp8 cases."""
    batch = prompts(5, seed=1) + [prompts(1, seed=1)[0] + [7, 8, 9]]  # the last one shares a prefix
    calls = []
    run = CpuDecodeBackend.run
    monkeypatch.setattr(CpuDecodeBackend, "run", lambda self, *a: calls.append(1) or run(self, *a))
    fused, fused_logits = serve_recording(engine_for(model, k, v, rotation, fused=True), batch, monkeypatch)
    assert len(calls) >= 31  # every decode step was fused
    plain, plain_logits = serve_recording(engine_for(model, k, v, rotation, fused=False), batch, monkeypatch)
    for a, b in zip(fused_logits, plain_logits):
        assert a.shape == b.shape  # the same batch in the same step, while the tokens are the same
        drift = (a - b).abs().max().item()
        assert drift <= 5e-3 * max(b.abs().max().item(), 1.0)
        flipped = a.argmax(-1) != b.argmax(-1)
        if flipped.any():
            best = b[flipped].topk(2, dim=-1).values
            assert (best[:, 0] - best[:, 1]).max().item() <= 2 * drift  # a tie at the paths' precision
            return  # the sequences part here, legitimately
    assert fused == plain


def serve_recording(engine: LLMEngine, batch: list[list[int]], monkeypatch) -> tuple[list[list[int]], list]:
    """serve() for 32 greedy tokens, keeping the logits of every pass of the model."""
    driver, logits = engine.runner.driver, []
    run = driver.run
    def recorded(*args, **kwargs):
        out = run(*args, **kwargs)
        logits.append(out.float().clone())
        return out

    monkeypatch.setattr(driver, "run", recorded)
    tokens = serve(engine, batch, max_tokens=32)
    monkeypatch.setattr(driver, "run", run)
    return tokens, logits


def test_the_rotation_changes_what_is_stored(model):
    """Not a no-op: a rotated q8_0 cache written by the fused step holds other codes than a plain one."""
    batch = prompts(2, seed=5)
    stored = {}
    for rotation in ("off", "on"):
        engine = engine_for(model, "q8_0", "q8_0", rotation, fused=True)
        serve(engine, batch, max_tokens=4)
        stored[rotation] = [t.clone() for t in engine.cache.tensors()]
    assert not all(torch.equal(a, b) for a, b in zip(stored["off"], stored["on"]))


def test_every_kv_format_is_read_by_the_c_step(model, monkeypatch):
    assert set(kv_format_ids()) == set(KV_FORMATS)  # decode.c names every format the cache has
    engine = engine_for(model, "bfloat16", "bfloat16", "off", fused=True)
    assert engine.runner.driver.decode_path(engine.cache).backend is not None
    calls = []
    run = CpuDecodeBackend.run
    monkeypatch.setattr(CpuDecodeBackend, "run", lambda self, *a: calls.append(1) or run(self, *a))
    serve(engine, prompts(2, seed=4), max_tokens=4)
    assert len(calls) >= 3  # every decode step
