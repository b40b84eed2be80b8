"""The ops a device kind runs the model's modules with: chosen once per model, in force around its passes.

    ops = ops_for(model.device)                  # the driver, when it is built (at load)
    with ops.applied(policy, num_rows):          # around one forward (kvlab/runner/driver.py)
        model(...)                               # the modules ask `current_ops()` for their products

The modules are one description of every layer; which code computes a product, a norm or a rotation
is not theirs to decide by looking at a tensor's device. They ask the ops in force:

- `TorchOps` is PyTorch's own code and runs on any device. It is also what a module runs when it is
  called outside a driver (a test poking one layer): correct anywhere, never fast by accident.
- `CpuOps` hands decode-sized passes to the C kernels (kvlab/kernels/: the streaming GEMV, the block
  formats' products, the small ops of a decode step, a prompt's attention, the Gated DeltaNet's and the
  experts' C calls)
  where the thread policy in force says so, and names the C decode backend (backends/cpu.py).
- `CudaOps` is today PyTorch's code with GGUF blocks kept on the device (dequantized per layer); a CUDA
  fast path is its methods overridden here, and a CUDA decode backend a file beside cpu.py that its
  `decode_backend` names.

The kernels under kvlab/kernels/ never ask which device a tensor is on: the ops that call them are the
CPU's. Which ops a device kind gets is the one table `OPS`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from kvlab.kernels.policy import ThreadPolicy, current


class TorchOps:
    """PyTorch's own code, on any device."""

    name = "torch"
    decode_backend: str | None = None  # the name of the decode backend it runs decode steps on (kvlab/backends)
    keeps_blocks = False  # GGUF blocks stay packed on this device (else they are expanded at load)
    kernel_rows = False  # decode-sized passes have kernels here (speculative drafts are capped to their rows)

    @contextmanager
    def applied(self, policy: ThreadPolicy, num_rows: int, packed: frozenset = frozenset()) -> Iterator[ThreadPolicy]:
        """Around a forward of `num_rows` tokens (of a model holding GGUF blocks in the formats `packed`):
        these ops and `policy` in force (PyTorch's thread count set for the pass)."""
        with self.active(), policy.applied(self.torch_threads(policy, num_rows, packed)):
            yield policy

    @contextmanager
    def active(self) -> Iterator[TorchOps]:
        """These ops in force in this thread for the block's duration (a test running one module)."""
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)

    def torch_threads(self, policy: ThreadPolicy, num_rows: int, packed: frozenset = frozenset()) -> int:
        return policy.threads

    # ---- the products ---------------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] @ weight[out, in]ᵀ (+ bias)."""
        return F.linear(x, weight, bias)

    def products_apart(self, num_rows: int) -> bool:
        """Whether a fused matrix's parts are multiplied one by one for a pass of `num_rows` rows."""
        return False

    def packed_applies(self, x: torch.Tensor, formats: list[str], whole: bool = True) -> bool:
        """Whether `packed_linear` takes x [rows, in] times parts in `formats` (see kernels/quant.applies)."""
        return False

    def packed_linear(self, x: torch.Tensor, parts, out_features: int) -> torch.Tensor:
        """x [rows, in] times the parts stacked by rows, float32: here each part dequantized, then F.linear."""
        return torch.cat([F.linear(x.float(), self.dequantize(part)) for part in parts], dim=-1)

    def gated_product(self, x: torch.Tensor, parts, activation_id: int) -> torch.Tensor | None:
        """A gated MLP's act(gate) · up [..., I] in one pass, parts its stored [gate, up] (PackedTensor), with
        the bits of the product followed by the activation; None where this device has no such pass."""
        return None

    def dequantize(self, part) -> torch.Tensor:
        """A packed part's weights as float32 [rows, in], the reference's bits."""
        return part.dequantize()

    def mxfp4_applies(self, x: torch.Tensor) -> bool:
        return False

    def mxfp4_matmul(self, x: torch.Tensor, part) -> torch.Tensor:
        """x [rows, in] · Wᵀ for an MXFP4 part, float32: here the reference's weights, then F.linear."""
        return F.linear(x.float(), self.dequantize(part))

    def chunked_experts(self, num_rows: int, formats: list[str] = ()) -> bool:
        """Whether one expert's `num_rows` prompt rows (its matrix in `formats`) go to the block kernels in
        decode-sized chunks."""
        return False

    def experts_applies(self, x: torch.Tensor, formats: list[str]) -> bool:
        """Whether a prompt's routed experts run as one C call (kernels/moe_prefill.py)."""
        return False

    # ---- the small ops of a decode step ---------------------------------------------------------------

    def small_ops(self, x: torch.Tensor, tokens: int) -> bool:
        """Whether rms_norm, gated_act and rope_in_place take x (a decode-sized float32 pass)."""
        return False

    def deltanet_applies(self, conv: torch.Tensor, ssm: torch.Tensor, rows: int) -> bool:
        """Whether a Gated DeltaNet decode segment of `rows` sequences runs as one C call."""
        return False

    # ---- attention ------------------------------------------------------------------------------------

    def prompt_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         scale: float, bf16: bool = False) -> torch.Tensor | None:
        """Attention of a pass of several new queries per sequence (model/attention.py's sdpa_attention: q
        [B, H, T, D], k and v [B, Hkv, L, D], a causal `mask` or none), or None: the caller runs PyTorch's.
        `bf16`: the model's prompt passes may attend in bfloat16 (the int8 setting's: kvlab.quant.activations)."""
        return None

    def paged_attention(self, cache, layer: int, q: torch.Tensor, group, g: int, positions: torch.Tensor,
                        softmax) -> torch.Tensor | None:
        """Attention of a group of one-token rows (q [H, B, D], their K/V stored) read from the paged cache's
        codes in place (kv/paged.py's attend; `softmax`: the layer's), or None: the cache gathers them."""
        return None

    def kv_write(self, fmt, x: torch.Tensor, slots: torch.Tensor, parts: list[torch.Tensor]) -> bool:
        """A pass's keys or values x [N, Hkv, D] into a layer's storage `parts` at `slots`, encoded in `fmt`
        (kv/formats.py's KVFormat, as kv/paged.py's write stores it); False: not taken, the caller encodes."""
        return False

    def kv_read(self, fmt, parts: list[torch.Tensor], blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Whole blocks `blocks` [n] of a layer's storage `parts` decoded from `fmt` (kv/paged.py's gather):
        [n · block size, Hkv, D] of `dtype`, the values index_select and fmt.decode give; None: the
        caller decodes them."""
        return None

    # ---- sampling ---------------------------------------------------------------------------------------

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of logits [rows, V]: the first of its largest (a NaN counts as the largest),
        as `argmax(dim=-1)` gives it, through `max`, whose CPU reduction is 2-3x faster over a batch's rows."""
        return logits.max(dim=-1).indices


class CudaOps(TorchOps):
    """CUDA: PyTorch's code, GGUF blocks kept on the device. A CUDA fast path overrides methods here."""

    name = "cuda"
    keeps_blocks = True  # dequantized per layer on the device (kvlab/quant/linear.py)


class CpuOps(TorchOps):
    """The CPU: the C kernels for decode-sized passes and GGUF blocks, PyTorch (BLAS) for the rest."""

    name = "cpu"
    decode_backend = "cpu-c"  # backends/cpu.py: each decoder layer one C call
    kernel_rows = True

    @property
    def keeps_blocks(self) -> bool:
        from kvlab.kernels import quant

        return quant.available()

    def torch_threads(self, policy, num_rows, packed=frozenset()):
        # a pass whose products the kernels' pool takes (decode-sized, or a prompt over GGUF blocks the
        # kernels take: see quant.pool_takes): PyTorch's small ops on one thread. Woken by an op on two,
        # its OpenMP workers spin for a while (libgomp's default) on the cores the pool needs: a 64-token
        # prompt of SmolLM2 took 1.6x as long (300 vs 185 ms, side by side); 256 tokens with 8-bit
        # activations 1.15-1.6x (SmolLM2, Qwen2.5-0.5B). Past ONE_THREAD_ROWS the elementwise ops over the
        # pass gain more from two threads than the spinning costs: Qwen2.5-0.5B's 512-row passes ran 7-13%
        # slower on one
        from kvlab.kernels import quant
        from kvlab.kernels.gemv import gemv_available

        prompt_on_pool = packed and num_rows <= ONE_THREAD_ROWS and quant.pool_takes(num_rows, packed, policy)
        on_pool = policy.kernel_sized(num_rows) or prompt_on_pool
        return 1 if on_pool and gemv_available() else policy.threads

    def linear(self, x, weight, bias=None):
        from kvlab.kernels.gemv import linear

        return linear(x, weight, bias)

    def products_apart(self, num_rows: int) -> bool:
        # a prompt on a CPU: one BLAS product per part ran 4-7% faster than one over the whole fused matrix
        # (SmolLM2's gate/up, 256 and 1,024 tokens, measured side by side)
        return num_rows > current().max_kernel_rows

    def packed_applies(self, x, formats, whole=True):
        from kvlab.kernels import quant

        return quant.applies(x, formats, whole)

    def packed_linear(self, x, parts, out_features):
        from kvlab.kernels import quant

        return quant.packed_linear(x, parts, out_features)

    def gated_product(self, x, parts, activation_id):
        # --activation-quant int8's prompt-sized passes: gate and up together (on the bfloat16 tiles,
        # vpdpbusd or AVX2), the activation taken as their sums leave the tiles or registers (kernels/quant_i8.c
        # kvlab_i8_gated), where the MLP's own path writes both out and reads them back for gated_act,
        # whose bits these are
        from kvlab.kernels import quant

        in_features = parts[0].shape[1]
        rows = x.numel() // in_features
        x2 = x.reshape(rows, in_features)
        if not (self.packed_applies(x2, [p.fmt for p in parts]) and self.small_ops(x2, rows)):
            return None  # the MLP's own path would not take the C kernels' bits
        y = quant.gated_product(x2, *parts, activation_id, current().threads)
        return None if y is None else y.view(*x.shape[:-1], y.shape[-1])

    def dequantize(self, part):
        from kvlab.kernels import mxfp4, quant

        return mxfp4.dequantize(part) if part.fmt == "MXFP4" else quant.dequantize(part)

    def mxfp4_applies(self, x):
        from kvlab.kernels import mxfp4

        return mxfp4.applies(x)

    def mxfp4_matmul(self, x, part):
        from kvlab.kernels import mxfp4

        return mxfp4.matmul(x, part)

    def chunked_experts(self, num_rows, formats=()):
        # a prompt's rows for one expert (about tokens · k / E of them): the block kernels over chunks of rows
        # read the expert's blocks a few times, where BLAS would first expand them all to float32 (3× slower
        # for Qwen3-30B-A3B's experts at 64 rows); up to CHUNKED_ROWS chunks. Interleaved experts
        # (--activation-quant int8) always: in passes of a prompt's size their products would go in
        # bfloat16, where kernels/moe.c's tiles (a prompt's experts in one C call) compute every row in int8
        from kvlab.kernels import quant

        rows = current().max_kernel_rows
        if any(quant.is_interleaved(f) for f in formats):
            return num_rows > rows
        return rows < num_rows <= CHUNKED_ROWS * rows

    def experts_applies(self, x, formats):
        from kvlab.kernels import moe_prefill, quant

        return quant.applies(x, formats, whole=False) and moe_prefill.available()

    def small_ops(self, x, tokens):
        from kvlab.kernels.gemv import small_ops_apply

        return small_ops_apply(x, tokens)

    def prompt_attention(self, q, k, v, mask, scale, bf16=False):
        # in bfloat16 where the pass's products are: from quant.bf16_prompt_rows() rows (the pass's queries)
        from kvlab.kernels import quant
        from kvlab.kernels.gemv import prompt_attention

        rows = quant.bf16_prompt_rows() if bf16 else 0
        return prompt_attention(q, k, v, mask, scale, bf16=0 < rows <= q.shape[0] * q.shape[2])

    def paged_attention(self, cache, layer, q, group, g, positions, softmax):
        from kvlab.backends.cpu_attention import attend_rows

        policy = current()
        if not (policy.use_kernels and policy.fused_decode):  # without the decode step: PyTorch's, the reference
            return None
        return attend_rows(cache, layer, q, group, g, positions, softmax)

    def kv_write(self, fmt, x, slots, parts):
        from kvlab.kernels.decode import kv_write
        from kvlab.kv.formats import unrotated

        base = unrotated(fmt)
        if base.name not in KV_WRITES or not current().use_kernels:
            return False
        return kv_write(base.name, base is not fmt, x, slots, parts)

    def kv_read(self, fmt, parts, blocks, dtype):
        from kvlab.kernels.decode import kv_gather
        from kvlab.kv.formats import unrotated

        base = unrotated(fmt)
        policy = current()
        if base.name not in KV_READS or dtype != torch.float32 or not policy.use_kernels:
            return None
        return kv_gather(base.name, base is not fmt, parts, blocks, policy.threads)

    def deltanet_applies(self, conv, ssm, rows):
        from kvlab.kernels import deltanet

        return deltanet.applies(conv, ssm, rows)

    def greedy_tokens(self, logits):
        # one C pass per row, the rows over the pool's threads: 16 rows of 49,152 logits took 0.4-0.9 ms
        # through PyTorch's reduction, most of a batch's sampling (the same picks: tests/test_sampling_batched.py)
        from kvlab.kernels.gemv import argmax_rows

        policy = current()
        picks = argmax_rows(logits, policy.threads) if policy.use_kernels else None
        return picks if picks is not None else super().greedy_tokens(logits)


# The KV formats whose prompt-pass writes the kernels' encoder takes (CpuOps.kv_write): where it beat PyTorch's
# encode and index_copy_. One layer's keys of a 512-token pass, SmolLM2's 3 kv heads (an Intel Xeon VM, 2
# threads): bfloat16 78 -> 41 us, q8_0 (rotated) 1,590 -> 1,017, q4_0 (rotated) 1,750 -> 1,262; not float32
# (62 against 65), float16 (85 against 133) or fp8_e4m3 (280 against 680), whose conversions PyTorch
# vectorises and the encoder makes one value at a time.
KV_WRITES = frozenset({"bfloat16", "q8_0", "q4_0"})
# The KV formats whose prompt-pass reads (a sequence's stored keys and values, decoded: CpuOps.kv_read) the
# kernels take: the coded ones, whose PyTorch decode (and rotation) is a dozen tensor ops over the gather.
KV_READS = frozenset({"q8_0", "q4_0", "fp8_e4m3"})
ONE_THREAD_ROWS = 256  # the largest prompt pass whose PyTorch ops take one thread (CpuOps.torch_threads)
CHUNKED_ROWS = 4  # up to this many chunks of the kernels' rows, a packed expert's product stays on the kernels
TORCH = TorchOps()
OPS: dict[str, TorchOps] = {"cpu": CpuOps(), "cuda": CudaOps()}  # device type → its ops; any other: TORCH


def ops_for(device: torch.device | str) -> TorchOps:
    """The ops of a device kind (the one place a device type chooses code)."""
    return OPS.get(torch.device(device).type, TORCH)


_current: ContextVar[TorchOps] = ContextVar("kvlab_ops", default=TORCH)


def current_ops() -> TorchOps:
    """The ops in force in this thread (a driver's, around its passes); outside any, PyTorch's own."""
    return _current.get()
