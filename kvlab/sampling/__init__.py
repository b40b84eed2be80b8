"""Logits → tokens: SamplingParams (no torch needed) and the Sampler (kvlab.sampling.sampler)."""

from kvlab.sampling.params import SamplingParams

__all__ = ["SamplingParams"]
