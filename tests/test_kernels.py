"""The decode GEMV kernel: same numbers as BLAS, same tokens with it on or off, shapes checked on every path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvlab.kernels import gemv
from kvlab.kernels.gemv import gemv_available, linear
from kvlab.kernels.policy import DEFAULT_MAX_KERNEL_ROWS, ThreadPolicy

needs_kernel = pytest.mark.skipif(not gemv_available(), reason="no C compiler: BLAS serves every call")


@needs_kernel
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.0), (torch.float16, 0.0)])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 17, 32])
@pytest.mark.parametrize("in_f, out_f", [(64, 96), (577, 1003), (13, 5), (1536, 576)])
def test_kernel_matches_blas(dtype, tol, rows, in_f, out_f):
    g = torch.Generator().manual_seed(rows * 1000 + in_f)
    w = torch.randn(out_f, in_f, generator=g).to(dtype)
    x = torch.randn(1, rows, in_f, generator=g).to(dtype)
    b = torch.randn(out_f, generator=g).to(dtype)
    for bias in (None, b):
        got = linear(x, w, bias)
        assert got.shape == (1, rows, out_f) and got.dtype == dtype
        # reference: float32 math on the same (rounded) inputs, rounded once to the output dtype
        ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        scale = ref.abs().max().item()
        if dtype == torch.float32:
            assert (got - ref).abs().max().item() <= tol * max(scale, 1.0)
        else:  # one rounding of the float32 result: within one unit in the last place
            assert torch.allclose(got.float(), ref.to(dtype).float(), rtol=2 ** -7, atol=1e-3 * scale)


def test_disabled_or_many_rows_use_blas(monkeypatch):
    calls = []
    monkeypatch.setattr(gemv, "_gemv", lambda *a: calls.append(1) or F.linear(a[1], a[2], a[3]))
    w, x = torch.randn(32, 16), torch.randn(1, 16)
    with ThreadPolicy(use_kernels=False).active():
        linear(x, w)
    assert calls == []
    linear(torch.randn(DEFAULT_MAX_KERNEL_ROWS + 1, 16), w)  # prefill-sized: BLAS
    with ThreadPolicy(max_kernel_rows=0).active():  # a crossover that sends everything to BLAS
        linear(x, w)
    assert calls == []
    if gemv_available():
        linear(x, w)
        assert calls == [1]


@needs_kernel
def test_greedy_tokens_identical_with_and_without_kernel(tiny_llm):
    from kvlab import SamplingParams

    p = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    with_kernel = tiny_llm.generate("The capital of France is", p).token_ids
    tiny_llm.policy.use_kernels = False  # the LLM's own policy: its engine reads it at every pass
    try:
        without = tiny_llm.generate("The capital of France is", p).token_ids
    finally:
        tiny_llm.policy.use_kernels = True
    assert with_kernel == without


@needs_kernel
def test_back_to_back_calls_of_different_sizes_on_an_oversubscribed_pool():
    """Small and large calls alternate while more workers than cores contend: a worker that wakes late
    must never compute or count a chunk under the wrong call (each result is bit-identical)."""
    import time

    g = torch.Generator().manual_seed(0)
    small, large, x = torch.randn(32, 64, generator=g), torch.randn(4096, 64, generator=g), torch.randn(1, 64, generator=g)
    with ThreadPolicy(threads=8).active():
        want_small, want_large = linear(x, small).clone(), linear(x, large).clone()
        end, calls = time.perf_counter() + 2.0, 0
        while time.perf_counter() < end:
            assert torch.equal(linear(x, small), want_small) and torch.equal(linear(x, large), want_large)
            calls += 1
        assert calls > 100


@needs_kernel
@pytest.mark.parametrize("rows, n", [(1, 64), (5, 577), (32, 896)])
def test_c_rms_norm_matches_the_pytorch_formula(rows, n):
    from kvlab.kernels.gemv import rms_norm, small_ops_apply

    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(1, rows, n, generator=g) * 3, torch.randn(n, generator=g)
    assert small_ops_apply(x, rows)
    expected = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    got = rms_norm(x, w, 1e-6)
    assert got.shape == x.shape
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


@needs_kernel
@pytest.mark.parametrize("B, T, heads, D", [(1, 1, 12, 64), (4, 1, 9, 128), (1, 3, 5, 32)])
def test_c_rope_matches_the_pytorch_rotation_in_place(B, T, heads, D):
    from kvlab.kernels.gemv import rope_in_place, small_ops_apply

    g = torch.Generator().manual_seed(D)
    qkv = torch.randn(B, T, heads + 3, D, generator=g)  # as in the model: rotate the first `heads` heads
    x = qkv[:, :, :heads]
    cos, sin = torch.randn(B, T, 1, D, generator=g), torch.randn(B, T, 1, D, generator=g)
    expected = torch.addcmul(x * cos, x.roll(D // 2, dims=-1), sin)
    untouched = qkv[:, :, heads:].clone()
    assert small_ops_apply(x, B * T) and rope_in_place(x, cos, sin)
    assert (x - expected).abs().max().item() < 1e-5
    assert torch.equal(qkv[:, :, heads:], untouched)


def test_small_ops_stay_in_pytorch_where_c_does_not_apply():
    from kvlab.kernels.gemv import rope_in_place, small_ops_apply

    assert not small_ops_apply(torch.randn(1, 1, 64, dtype=torch.bfloat16), 1)
    rows = DEFAULT_MAX_KERNEL_ROWS + 1
    with ThreadPolicy(threads=2, use_kernels=False).active():
        assert not small_ops_apply(torch.randn(1, rows, 64), rows)  # the kernels off: PyTorch's ops
    x = torch.randn(1, 1, 4, 64).transpose(2, 3)  # not [.., heads, D] with D contiguous
    assert not rope_in_place(x, torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4))


@needs_kernel
def test_small_ops_over_a_prompts_rows_give_each_row_the_bits_it_has_alone():
    """A prompt's rows split over the pool's threads: every row the same bits as computed alone (the
    decode step's own functions), the gated activation the same with gate and up apart or fused."""
    from kvlab.kernels.decode import activation_ids
    from kvlab.kernels.gemv import gated_act, rms_norm, rope_in_place, small_ops_apply

    g = torch.Generator().manual_seed(7)
    rows, n, inter, heads, D = 300, 576, 1536, 5, 64
    x, w = torch.randn(1, rows, n, generator=g) * 3, torch.randn(n, generator=g)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 4
    qkv = torch.randn(1, rows, heads + 2, D, generator=g)
    cos, sin = torch.randn(1, rows, 1, D, generator=g), torch.randn(1, rows, 1, D, generator=g)
    silu = activation_ids()["silu"]
    with ThreadPolicy(threads=2).active():
        assert small_ops_apply(x, rows)
        norm = rms_norm(x, w, 1e-6)
        act = gated_act(gate_up[:, :inter], gate_up[:, inter:], silu)
        apart = gated_act(gate_up[:, :inter].contiguous(), gate_up[:, inter:].contiguous(), silu)
        rotated = qkv.clone()
        assert rope_in_place(rotated[:, :, :heads], cos, sin)
    with ThreadPolicy(threads=1).active():
        for r in (0, 1, 149, 299):
            assert torch.equal(norm[:, r], rms_norm(x[:, r : r + 1], w, 1e-6)[:, 0])
            assert torch.equal(act[r], gated_act(gate_up[r : r + 1, :inter], gate_up[r : r + 1, inter:], silu)[0])
            alone = qkv[:, r : r + 1].clone(memory_format=torch.contiguous_format)
            assert rope_in_place(alone[:, :, :heads], cos[:, r : r + 1].contiguous(), sin[:, r : r + 1].contiguous())
            assert torch.equal(rotated[:, r], alone[:, 0])
    assert torch.equal(act, apart)
    assert torch.equal(rotated[:, :, heads:], qkv[:, :, heads:])  # v's heads untouched


@pytest.mark.parametrize(
    "x_shape, w_shape, b_shape",
    [((1, 5), (8, 3), None), ((40, 5), (8, 3), None), ((2, 3), (8, 3), (5,)), ((2, 3), (8, 3), (1, 8)),
     ((), (8, 3), None), ((1, 3), (8, 3, 1), None)],
)  # fmt: skip
def test_linear_refuses_shapes_that_do_not_fit(x_shape, w_shape, b_shape):
    """Where F.linear raises, so does linear, on the kernel's path (decode-sized) and on BLAS's."""
    x, w = torch.randn(x_shape), torch.randn(w_shape)
    with pytest.raises(ValueError):
        linear(x, w, None if b_shape is None else torch.randn(b_shape))


@needs_kernel
def test_a_strided_bias_is_read_by_its_strides():
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(37, 64, generator=g), torch.randn(2, 64, generator=g)
    bias = torch.randn(37, 2, generator=g)[:, 1]  # every other float of its storage
    assert not bias.is_contiguous()
    got = linear(x, w, bias)
    assert torch.equal(got, linear(x, w, bias.contiguous()))
    assert (got - F.linear(x, w, bias)).abs().max().item() < 1e-4


@needs_kernel
def test_explicit_threads_override_the_policy_in_force(monkeypatch):
    seen = []
    monkeypatch.setattr(gemv, "_gemv_into", lambda *a: seen.append(a[-1]))
    w, x = torch.randn(32, 16), torch.randn(1, 16)
    with ThreadPolicy(threads=3).active():
        linear(x, w, threads=5)
        linear(x, w)
    assert seen == [5, 3]
    with pytest.raises(ValueError):
        linear(x, w, threads=0)


@needs_kernel
def test_two_models_generating_in_two_threads_get_their_tokens_alone(tiny_chat_model):
    """Two engines with thread policies of their own (1 and 2 threads) share the kernels' pool; side by
    side they must give the tokens each gives alone (before the pool refused a second caller, they did
    not, in about one run of this test in three)."""
    import threading

    from kvlab import LLM, SamplingParams

    p = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time"]
    llms = [LLM(tiny_chat_model, threads=1), LLM(tiny_chat_model, threads=2)]
    assert [llm.policy.threads for llm in llms] == [1, 2]
    alone = [llm.generate(prompt, p).token_ids for llm, prompt in zip(llms, prompts)]
    together: list = [None, None]

    def run(i: int):
        together[i] = [llms[i].generate(prompts[i], p).token_ids for _ in range(6)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert together == [[alone[0]] * 6, [alone[1]] * 6]


@needs_kernel
@pytest.mark.parametrize("rows, intermediate", [(1, 64), (5, 1541), (16, 1536)])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_c_gated_activation_matches_pytorch(rows, intermediate, activation):
    """act(gate) · up, 8 values at a time with a polynomial e^x (and the tail one by one with libm's):
    within a few float32 roundings of the exact function, finite at both ends of e^x's range."""
    from kvlab.kernels.decode import activation_ids
    from kvlab.kernels.gemv import gated_act

    g = torch.Generator().manual_seed(intermediate)
    gate_up = torch.randn(rows, 2 * intermediate, generator=g) * 6
    gate_up[0, :8] = torch.tensor([-200.0, 200.0, 0.0, -90.0, 89.0, 1e-30, -1e-30, -4.73])  # exp's range, 0, tanh's 0
    gate_up[-1, intermediate - 3 : intermediate] = torch.tensor([-120.0, 95.0, 2.5])  # the tail's elements
    gate, up = gate_up.double().chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    got = gated_act(gate_up[:, :intermediate], gate_up[:, intermediate:], activation_ids()[activation])
    assert got.shape == (rows, intermediate) and torch.isfinite(got).all()
    # act(g) / g lies in [0, 1]: |g · up| is the scale of each value's rounding
    assert ((got.double() - act * up).abs() <= 1e-6 * (gate * up).abs() + 1e-37).all()


def _causal_mask(B: int, T: int, L: int, window: int | None = None) -> torch.Tensor:
    q, k = torch.arange(L - T, L)[:, None], torch.arange(L)[None, :]
    visible = (k <= q) & (k > q - window) if window else k <= q
    return visible[None, None].expand(B, 1, T, L).clone()


def _prompt_case(B, H, Hkv, T, L, D, masked: str, seed: int):
    """q, k, v at the strides the modules hand over (views into fused products) and a mask: causal where
    T < L or asked ("mask"; a second sequence two keys shorter: padding past its end), a window of 7."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).transpose(1, 2)  # the modules' [B, H, T, D] view
    kv = torch.randn(B, L, 2 * Hkv, D, generator=g)
    k, v = kv[:, :, :Hkv].transpose(1, 2), kv[:, :, Hkv:].transpose(1, 2)
    mask = None
    if masked == "mask" or T < L:
        mask = _causal_mask(B, T, L)
        if B > 1:
            mask[1, :, :, -2:] = False
            mask[1, :, :, 0] = True  # (every query still sees a key)
    if masked == "window":
        mask = _causal_mask(B, T, L, window=7)
    return q, k, v, mask


@needs_kernel
@pytest.mark.parametrize("B, H, Hkv, T, L, D", [(8, 9, 3, 64, 64, 64), (2, 14, 2, 40, 300, 64), (1, 4, 4, 70, 70, 128),
                                                 (3, 6, 2, 5, 9, 32), (2, 4, 1, 33, 33, 80), (1, 2, 1, 3, 3, 256),
                                                 # tiles seeing up to 256 keys take the short form, later ones the
                                                 # running softmax: both in one call; at head sizes 128 and 256
                                                 (1, 4, 2, 300, 300, 64), (2, 6, 3, 20, 250, 128),
                                                 (1, 2, 1, 17, 240, 256)])  # fmt: skip
@pytest.mark.parametrize("masked", ["causal", "mask", "window"])
def test_c_prompt_attention_matches_sdpa(B, H, Hkv, T, L, D, masked):
    """kernels/gemv.py's prompt_attention (prompt_attention.c) against PyTorch's SDPA: grouped query heads, queries
    after cached keys, a mask (padding past one sequence's end, a sliding window), head sizes on and off the
    vector widths, q, k and v at the strides the modules hand over (views into fused products)."""
    q, k, v, mask = _prompt_case(B, H, Hkv, T, L, D, masked, seed=B * 100 + T)
    with ThreadPolicy(threads=2).applied():
        got = gemv.prompt_attention(q, k, v, mask, 0.125)
    assert got is not None and got.shape == (B, H, T, D)
    assert got.transpose(1, 2).is_contiguous()  # laid out [B, T, H, D]: the output projection's rows, no copy between
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True, scale=0.125)
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-5)
    # each sequence's rows are its own: alone, the same bits as among the others
    with ThreadPolicy(threads=1).applied():
        alone = gemv.prompt_attention(q[-1:], k[-1:], v[-1:], None if mask is None else mask[-1:], 0.125)
    assert torch.equal(alone, got[-1:])


@needs_kernel
@pytest.mark.parametrize("L", [40, 300])
def test_c_prompt_attention_gives_zeros_to_a_query_that_sees_no_key(L):
    """A query whose mask row is all False (a padded row) gets zeros, not SDPA's NaN, in both the short form
    (every key within 256) and the running softmax; its neighbours' rows are SDPA's."""
    B, H, Hkv, T, D = 1, 4, 2, 20, 64
    g = torch.Generator().manual_seed(L)
    q, k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, L, D, generator=g), torch.randn(B, Hkv, L, D, generator=g)
    mask = _causal_mask(B, T, L)
    mask[0, 0, 5] = False
    with ThreadPolicy(threads=2).applied():
        got = gemv.prompt_attention(q, k, v, mask, 0.125)
    assert got is not None and torch.equal(got[:, :, 5], torch.zeros(B, H, D))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.125)
    keep = torch.arange(T) != 5
    torch.testing.assert_close(got[:, :, keep], ref[:, :, keep], rtol=0, atol=2e-5)


@needs_kernel
def test_c_prompt_attention_leaves_what_it_does_not_take_to_pytorch():
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
    assert gemv.prompt_attention(q.double(), k.double(), k.double(), None, 0.25) is None  # float32 only
    assert gemv.prompt_attention(q, torch.randn(1, 3, 3, 16), torch.randn(1, 3, 3, 16), None, 0.25) is None  # 4 % 3
    assert gemv.prompt_attention(q, k, k, torch.ones(1, 1, 3, 3), 0.25) is None  # a float mask
    assert gemv.prompt_attention(q, k, torch.randn(1, 2, 3, 8), None, 0.25) is None  # v's width differs
    with ThreadPolicy(threads=2, use_kernels=False).applied():
        assert gemv.prompt_attention(q, k, k, None, 0.25) is None  # the policy keeps the kernels off


def _bf16_reference(q, k, v, mask, scale):
    """The bfloat16 form's numbers in float64: q, k, v rounded to bfloat16, the softmax's weights too (their
    sum not), every product exact."""
    r = [t.to(torch.bfloat16).double() for t in (q, k, v)]
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(group, 1) for t in r[1:])
    s = (r[0] @ kk.transpose(-1, -2)) * scale
    T, L = q.shape[2], k.shape[2]
    allowed = _causal_mask(q.shape[0], T, L) if mask is None else mask
    s = s.masked_fill(~allowed, float("-inf"))
    w = torch.exp(s - s.amax(-1, keepdim=True)).nan_to_num(0.0)
    total = w.sum(-1, keepdim=True)
    out = (w.to(torch.bfloat16).double() @ vv) / total
    return out.nan_to_num(0.0).float()


@needs_kernel
@pytest.mark.parametrize("B, H, Hkv, T, L, D", [(8, 9, 3, 64, 64, 64), (2, 14, 2, 40, 300, 64), (1, 4, 4, 70, 70, 128),
                                                 (3, 6, 2, 5, 9, 32), (1, 2, 1, 17, 240, 256), (1, 4, 1, 300, 300, 64)])
@pytest.mark.parametrize("masked", ["causal", "mask", "window"])
def test_c_prompt_attention_on_bfloat16_tiles(B, H, Hkv, T, L, D, masked):
    """The int8 setting's prompt attention (bf16=True): on a machine with AMX tiles for bfloat16, the
    numbers of q, k, v and the weights rounded to bfloat16 and summed in float32; each sequence's rows its
    own (alone, the same bits). Elsewhere the float32 form's very numbers."""
    from kvlab.kernels import quant

    q, k, v, mask = _prompt_case(B, H, Hkv, T, L, D, masked, seed=B * 10 + T)
    with ThreadPolicy(threads=2).applied():
        got = gemv.prompt_attention(q, k, v, mask, 0.125, bf16=True)
        exact = gemv.prompt_attention(q, k, v, mask, 0.125)
    assert got is not None and got.transpose(1, 2).is_contiguous()
    if not quant.bf16_prompt_rows():
        assert torch.equal(got, exact)  # no tiles: the float32 form
        return
    torch.testing.assert_close(got, _bf16_reference(q, k, v, mask, 0.125), rtol=0, atol=1e-2)
    torch.testing.assert_close(got, exact, rtol=0, atol=5e-2)  # and near the float32 form
    assert not torch.equal(got, exact)  # (it did round)
    with ThreadPolicy(threads=1).applied():
        alone = gemv.prompt_attention(q[-1:], k[-1:], v[-1:], None if mask is None else mask[-1:], 0.125, bf16=True)
    assert torch.equal(alone, got[-1:])


@needs_kernel
def test_c_prompt_attention_on_tiles_past_a_chunk_of_keys_rescales_as_it_goes():
    """Past 4,096 keys (prompt_attention.c's BF16_ATTN_CHUNK) a work item's rows go chunk after chunk with a
    running softmax: still the bfloat16 numbers (to their rounding), a row's bits its own in a batch; a mask
    that hides the first chunk from some rows (their running softmax starts in the second)."""
    from kvlab.kernels import quant

    B, H, Hkv, T, L, D = 2, 4, 2, 24, 9000, 64
    g = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, Hkv, L, D, generator=g), torch.randn(B, Hkv, L, D, generator=g)
    mask = _causal_mask(B, T, L)
    mask[1, :, :12, :5000] = False  # sequence 1's first 12 queries see keys from 5,000 on only
    got = gemv.prompt_attention(q, k, v, mask, 0.125, bf16=True)
    if not quant.bf16_prompt_rows():
        assert torch.equal(got, gemv.prompt_attention(q, k, v, mask, 0.125))
        return
    torch.testing.assert_close(got, _bf16_reference(q, k, v, mask, 0.125), rtol=0, atol=1e-2)
    alone = gemv.prompt_attention(q[1:], k[1:], v[1:], mask[1:], 0.125, bf16=True)
    assert torch.equal(alone, got[1:])


@needs_kernel
def test_c_prompt_attention_on_tiles_gives_zeros_to_a_query_that_sees_no_key_and_leaves_odd_heads_to_float32():
    B, H, Hkv, T, L = 1, 4, 2, 20, 40
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(B, H, T, 64, generator=g), torch.randn(B, Hkv, L, 64, generator=g), torch.randn(B, Hkv, L, 64, generator=g)
    mask = _causal_mask(B, T, L)
    mask[0, 0, 5] = False
    got = gemv.prompt_attention(q, k, v, mask, 0.125, bf16=True)
    assert torch.equal(got[:, :, 5], torch.zeros(B, H, 64)) and torch.isfinite(got).all()
    # a head size off 32's multiples: the float32 form
    q80, k80 = torch.randn(1, 2, 3, 80, generator=g), torch.randn(1, 1, 3, 80, generator=g)
    assert torch.equal(gemv.prompt_attention(q80, k80, k80, None, 0.1, bf16=True), gemv.prompt_attention(q80, k80, k80, None, 0.1))


@needs_kernel
def test_a_prompt_attends_on_tiles_from_as_many_queries_as_the_bfloat16_products_take(monkeypatch):
    """CpuOps asks for the tiles where the layer allows them (the int8 setting) and the pass has at least
    quant.bf16_prompt_rows() queries (B · T), as the products go in bfloat16 from that many rows."""
    from kvlab.backends.ops import CpuOps
    from kvlab.kernels import quant

    asked = []
    monkeypatch.setattr(gemv, "prompt_attention", lambda *a, bf16=False: asked.append(bf16))
    monkeypatch.setattr(quant, "bf16_prompt_rows", lambda: 64)
    ops = CpuOps()
    for B, T, allowed in [(1, 63, True), (1, 64, True), (4, 16, True), (2, 64, False)]:
        ops.prompt_attention(torch.zeros(B, 2, T, 32), None, None, None, 0.1, bf16=allowed)
    assert asked == [False, True, True, False]
    monkeypatch.setattr(quant, "bf16_prompt_rows", lambda: 0)  # no tiles on this machine
    ops.prompt_attention(torch.zeros(1, 2, 64, 32), None, None, None, 0.1, bf16=True)
    assert asked[-1] is False
