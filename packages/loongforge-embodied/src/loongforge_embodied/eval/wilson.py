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
