"""ModelDriver: the one place a forward pass of the model is run.

    logits = driver.run(input_ids, cache)                 # a contiguous cache: planned, run, committed
    logits = driver.run(input_ids, paged, meta, index)    # the paged cache: the runner built `meta`

Every caller of the model (the serving engine's runner, the reference engine, the lab, the tests)
goes through it, so the device's ops (kvlab/backends/ops.py: which code computes a module's products
and small ops, chosen here once), the thread policy (its engine's own: kvlab.kernels.policy), inference
mode and the plan → forward → commit order live in one place. A paged decode step runs on the model's decode
backend (kvlab/backends: on a CPU a step's decoder layers in one C call) where there is one, else the modules.
"""

from __future__ import annotations

import torch

from kvlab.backends.ops import ops_for
from kvlab.kernels import ThreadPolicy
from kvlab.kv.cache import KVCache, SingleBatchKVCache
from kvlab.quant.linear import PackedLinear


class ModelDriver:
    """Runs `model` under `policy` (its engine's thread policy; by default torch's thread count) with its
    device's ops (kvlab/backends/ops.py; `ops` given: those, as a test runs PyTorch's own on a CPU)."""

    def __init__(self, model, policy: ThreadPolicy | None = None, ops=None):
        self.model = model
        self.policy = policy or ThreadPolicy()
        self.ops = ops or ops_for(model.device)  # chosen once, in force around every pass
        self._decode_path = None  # the decode backend (kvlab/backends), chosen at the first decode pass
        # the formats of the GGUF blocks kept packed: a prompt's products may run on the kernels' pool too
        # (ops.torch_threads)
        modules = model.modules() if model is not None else ()
        self.packed = frozenset(f for m in modules if isinstance(m, PackedLinear) for f in m.formats)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        meta=None,
        logits_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] through the model: logits [B, V] of each sequence's last new token, or
        [B, N, V] at `logits_index`.

        Without `meta` the cache plans the pass (it must be a SingleBatchKVCache: every sequence gains
        T tokens) and records it once the forward has written its K/V.
        """
        planned = meta is None
        if planned:
            if not isinstance(cache, SingleBatchKVCache):
                raise TypeError(f"{type(cache).__name__} needs the pass's metadata from its caller")
            meta = cache.plan(input_ids.shape[1])
        with self.ops.applied(self.policy, input_ids.numel(), self.packed):
            fused = self._fused_step(input_ids, cache, meta, logits_index)
            if fused is not None:
                logits = fused.run(input_ids, cache, meta, logits_index, self.policy)
            else:
                logits = self.model(input_ids, cache, meta, logits_index=logits_index)
        if planned:
            cache.commit(meta)
        return logits

    def _fused_step(self, input_ids, cache, meta, logits_index):
        """The decode backend if this pass is one it runs (a paged decode step), else None."""
        if not self.policy.fused_decode or logits_index is None:
            return None
        backend = self.decode_path().backend
        return backend if backend is not None and backend.applies(input_ids, cache, meta, self.policy) else None

    def decode_path(self, cache=None):
        """The decode backend chosen for this model (kvlab/backends), once; with `cache`, whether that
        cache takes it too (the reason where it does not)."""
        if self._decode_path is None:
            from kvlab.backends import choose_decode_path

            self._decode_path = choose_decode_path(self.model, ops=self.ops)
        path = self._decode_path
        if cache is not None and path.backend is not None:
            from kvlab.backends import DecodePath

            reason = path.backend.cache_reason(cache)
            return DecodePath(None, reason) if reason else path
        return path

    def append(self, ids: list[int], cache: SingleBatchKVCache) -> torch.Tensor:
        """Append `ids` to the single sequence in `cache`: logits [V] of the last one."""
        return self.run(torch.tensor([ids], dtype=torch.long, device=self.device), cache)[0]
