"""Compute kernels behind the model's layers."""

from kvlab.kernels.gemv import linear

__all__ = ["linear"]
