"""ModelDriver: the one place a forward pass of the model is run.

    logits = driver.run(input_ids, cache)                 # a contiguous cache: planned, run, committed
    logits = driver.run(input_ids, paged, meta, index)    # the paged cache: the runner built `meta`

Every caller of the model (the serving engine's runner, the reference engine, the lab, the tests)
goes through it, so the thread policy (its engine's own: kvlab.kernels.policy), inference mode and
the plan → forward → commit order live in one place. A paged decode step on a CPU runs each decoder
layer as one C call (kernels/decode.py) instead of the layer's modules, where the model fits it.
"""

from __future__ import annotations

import torch

from kvlab.kernels import ThreadPolicy
from kvlab.kv.cache import KVCache, SingleBatchKVCache


class ModelDriver:
    """Runs `model` under `policy` (its engine's thread policy; by default torch's thread count)."""

    def __init__(self, model, policy: ThreadPolicy | None = None):
        self.model = model
        self.policy = policy or ThreadPolicy()
        self._fused = None  # the fused decode step (kernels/decode.py), made at the first decode pass

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
        with self.policy.applied(input_ids.numel(), self.device):
            fused = self._fused_step(input_ids, cache, meta, logits_index)
            if fused is not None:
                logits = fused.run(input_ids, cache, meta, logits_index, self.policy)
            else:
                logits = self.model(input_ids, cache, meta, logits_index=logits_index)
        if planned:
            cache.commit(meta)
        return logits

    def _fused_step(self, input_ids, cache, meta, logits_index):
        """The fused decode step if this pass is one it runs (a paged decode step on a CPU), else None."""
        if not self.policy.fused_decode or logits_index is None or self.device.type != "cpu":
            return None
        if not self.policy.kernel_sized(input_ids.numel()):
            return None
        if self._fused is None:
            from kvlab.kernels.decode import FusedDecode

            self._fused = FusedDecode.for_model(self.model) or False
        return self._fused if self._fused and self._fused.applies(input_ids, cache, meta, self.policy) else None

    def append(self, ids: list[int], cache: SingleBatchKVCache) -> torch.Tensor:
        """Append `ids` to the single sequence in `cache`: logits [V] of the last one."""
        return self.run(torch.tensor([ids], dtype=torch.long, device=self.device), cache)[0]
