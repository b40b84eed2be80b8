"""kernels/probe.c's multiply-add rate: the arithmetic roof the lab's batching experiment sets a decode step
against. Its value is the machine's; what is checked is that it is measured at all and of a sane size."""

from __future__ import annotations

import math

import pytest

from kvlab.kernels import gemv
from kvlab.kernels.probe import mac_rate

pytestmark = pytest.mark.skipif(not gemv.gemv_available(), reason="no C compiler: no kernels to probe")


@pytest.mark.parametrize("threads", [0, 1, 2])
def test_the_rate_is_a_finite_number_of_a_cpus_size(threads):
    """At least one G MAC/s (any vector unit), at most 10,000 per thread (a miscount by the lanes or the
    chains would be orders of magnitude off); 0 threads is taken as 1."""
    rate = mac_rate(threads, seconds=0.02)
    assert rate is not None and math.isfinite(rate)
    assert 1.0 < rate < 10_000.0 * max(1, threads), rate
