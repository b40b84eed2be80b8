"""Query-key dependency counts for one head in one layer (seed 004): what a KV cache saves.

A prompt of n positions is prefilled once: position i attends to positions 1..i, n(n+1)/2 pairs.
Each of m later positions is fed in one at a time. With a cache, step k only adds the new query row
(n + k pairs). Without one, step k recomputes the whole prefix of n + k positions from scratch.
These are dependency counts, not FLOPs or time.
"""

from __future__ import annotations

from kvlab.errors import KvlabError

MAX_POSITIONS = 10**9


def _check(n: int, m: int) -> None:
    for label, value in (("n", n), ("m", m)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_POSITIONS:
            raise KvlabError(f"--pairs {label} must be a whole number in 0..{MAX_POSITIONS:,}, got {value!r}")
    if n + m == 0:
        raise KvlabError("--pairs needs at least one position (n + m >= 1)")


def pairs_with_cache(n: int, m: int) -> int:
    """n(n+1)/2 + mn + m(m+1)/2 pairs: the prefill triangle, then one new row per step. (6, 2) -> 36."""
    _check(n, m)
    return n * (n + 1) // 2 + m * n + m * (m + 1) // 2


def pairs_without_cache(n: int, m: int) -> int:
    """The prefill triangle, then the full triangle of n + k positions at each step k. (6, 2) -> 85.

    Sum of triangles T(p) = p(p+1)/2 for p = n and p = n+1 .. n+m; the sum T(1) + ... + T(k) is the
    tetrahedral number k(k+1)(k+2)/6.
    """
    _check(n, m)

    def tetra(k: int) -> int:
        return k * (k + 1) * (k + 2) // 6

    return n * (n + 1) // 2 + tetra(n + m) - tetra(n)


def pairs_steps(n: int, m: int) -> list[tuple[int, int, int]]:
    """(positions so far, pairs added with a cache, pairs computed without) for the prefill and each step."""
    _check(n, m)
    rows = [(n, n * (n + 1) // 2, n * (n + 1) // 2)] if n else []
    for k in range(1, m + 1):
        p = n + k
        rows.append((p, p, p * (p + 1) // 2))
    return rows
