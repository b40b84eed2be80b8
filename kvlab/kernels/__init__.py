"""Compute kernels behind the model's layers."""

from kvlab.kernels.gemv import decode_threads, linear

__all__ = ["decode_threads", "linear"]
