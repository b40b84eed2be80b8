"""Compute kernels behind the model's layers, and the thread policy that says how they use the CPU."""

from kvlab.kernels.gemv import linear
from kvlab.kernels.policy import ThreadPolicy, current

__all__ = ["ThreadPolicy", "current", "linear"]
