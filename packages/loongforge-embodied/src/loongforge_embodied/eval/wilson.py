"""Wilson score interval for a success rate (sound at 0 / n and n / n, unlike the normal approximation)."""

from __future__ import annotations

import math


def wilson_interval(successes: int, n: int, *, z: float = 1.959964) -> tuple[float, float]:
    """The two-sided interval of a binomial proportion at ``z`` (default 95%); (0, 1) for n = 0."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # NOTE: exact ends at 0 / n and n / n (the formula gives them up to rounding)
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


def difference_interval(k1: int, n1: int, k2: int, n2: int, *, z: float = 1.959964) -> tuple[float, float, float]:
    """``p1 - p2`` of two independent success rates with Newcombe's hybrid score interval (his method 10: the two
    Wilson intervals combined; sound at 0 / n where the normal approximation's interval collapses to a point).
    Returns (difference, low, high); a low above 0 says policy 1 beats policy 2 at that level."""
    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = wilson_interval(k1, n1, z=z)
    l2, u2 = wilson_interval(k2, n2, z=z)
    d = p1 - p2
    return d, d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)
