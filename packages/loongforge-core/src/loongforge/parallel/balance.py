"""Data-parallel load balancing: each step's global batch, unchanged, placed over the DP ranks and their
micro-batches so that every rank has about the same compute.

A sample is described by three numbers (:data:`Features`): ``Σl²`` and ``Σl`` over the sequences attended
separately in it (a packed row's samples: attention is quadratic in each, the rest of a layer linear) and its
image patch count (a vision tower's work). A micro-batch costs ``a·Σl² + b·Σl + c + v·patches``
(:class:`CostModel`); the coefficients start at :data:`DEFAULT_COST` and are fitted by least squares
(:func:`fit_cost_model`) from micro-batch times measured on warm-up steps.

:func:`balance` places the samples: greedy longest-first into the least loaded rank that has room (every rank
takes the same number of samples, every micro-batch ``micro_batch_size``), then pairwise swaps between the most
loaded rank and the others while they lower it; the same again over each rank's micro-batches. It is a pure
function of the costs, so every rank computes the same placement, and the global batch is the same samples
whatever the placement: with a token-sum loss normalised by the global token count, the loss does not change.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

Features = tuple[float, float, float]  # (Σl², Σl, image patches) of one sample or one micro-batch


@dataclass(frozen=True)
class CostModel:
    """Cost of a micro-batch: ``a·Σl² + b·Σl + c + v·patches`` (any unit: only ratios matter)."""

    a: float
    b: float
    c: float = 0.0
    v: float = 0.0

    def sample(self, f: Features) -> float:
        """A sample's share (the per-micro-batch constant ``c`` is not a sample's)."""
        return self.a * f[0] + self.b * f[1] + self.v * f[2]

    def microbatch(self, samples: Sequence[Features]) -> float:
        return self.c + sum(self.sample(f) for f in samples)


# NOTE: attention over l tokens costs about 4·h·l² flops against the rest of a layer's 24·h²·l: they are equal near
# l = 6·h; 1/4096 assumes h ≈ 700 (a small model). A patch is counted as a token. Fitting replaces all of it.
DEFAULT_COST = CostModel(a=1 / 4096, b=1.0, c=0.0, v=1.0)


def fit_cost_model(features: Sequence[Features], seconds: Sequence[float], *,
                   counts: Sequence[int] | None = None) -> CostModel | None:
    """Least-squares coefficients (seconds) from measured micro-batches: ``features[k]`` is micro-batch k's summed
    features, ``seconds[k]`` its time, ``counts[k]`` how many micro-batches the row sums (default 1: it multiplies
    ``c``). Terms that never vary (no images) get 0; a coefficient that comes out negative is dropped and the rest
    refitted. None when the measurements cannot determine a model (too few, or nothing but noise)."""
    import numpy as np

    if len(features) != len(seconds):
        raise ValueError(f"{len(features)} feature rows but {len(seconds)} times")
    counts = [1] * len(features) if counts is None else counts
    x = np.array([[f[0], f[1], n, f[2]] for f, n in zip(features, counts, strict=True)], dtype=np.float64).reshape(-1, 4)
    y = np.asarray(seconds, dtype=np.float64)
    active = [j for j in range(4) if np.any(x[:, j] != 0)]
    while active:
        cols = x[:, active]
        if len(y) < len(active) or np.linalg.matrix_rank(cols) < len(active):
            # NOTE: columns that move together (every row the same length) cannot be told apart: drop the last
            if len(active) == 1:
                return None
            active = active[:-1]
            continue
        scale = np.abs(cols).max(axis=0)  # NOTE: Σl² is ~l times Σl: scale the columns so lstsq is well posed
        coef = np.linalg.lstsq(cols / scale, y, rcond=None)[0] / scale
        if (coef >= 0).all():
            if not (coef > 0).any():
                return None
            full = [0.0] * 4
            for j, c in zip(active, coef, strict=True):
                full[j] = float(c)
            return CostModel(a=full[0], b=full[1], c=full[2], v=full[3])
        active = [j for j, c in zip(active, coef, strict=True) if c >= 0] if (coef >= 0).any() else []
    return None


def imbalance(loads: Sequence[float]) -> float:
    """max / mean of the ranks' loads (1.0: perfectly even)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class Placement:
    """``microbatches[r][m]``: positions (in the global batch) of rank r's micro-batch m; the ranks' costs with the
    plain in-order placement (``before``) and with this one (``after``)."""

    microbatches: list[list[list[int]]]
    before: list[float]
    after: list[float]


def balance(features: Sequence[Features], *, ranks: int, microbatches: int, micro_batch_size: int,
            cost: CostModel = DEFAULT_COST) -> Placement:
    """Place one global batch (``ranks * microbatches * micro_batch_size`` samples) over the ranks and their
    micro-batches, evening out the ranks' costs, then the micro-batches' within each rank."""
    n = ranks * microbatches * micro_batch_size
    if len(features) != n:
        raise ValueError(f"a global batch of {len(features)} samples is not ranks * microbatches * "
                         f"micro_batch_size = {ranks} * {microbatches} * {micro_batch_size} = {n}")
    costs = [cost.sample(f) for f in features]
    constant = cost.c * microbatches

    def in_order(r: int) -> list[int]:  # the plain schedule: micro-batch m of rank r is one contiguous block
        return [m * micro_batch_size * ranks + r * micro_batch_size + b
                for m in range(microbatches) for b in range(micro_batch_size)]

    before = [constant + sum(costs[i] for i in in_order(r)) for r in range(ranks)]
    per_rank = _partition(costs, list(range(n)), bins=ranks, capacity=microbatches * micro_batch_size)
    out = [_partition(costs, sorted(mine), bins=microbatches, capacity=micro_batch_size) for mine in per_rank]
    after = [constant + sum(costs[i] for i in mine) for mine in per_rank]
    return Placement(microbatches=[[sorted(mb) for mb in rank] for rank in out], before=before, after=after)


def _partition(costs: Sequence[float], items: list[int], *, bins: int, capacity: int) -> list[list[int]]:
    """``items`` into ``bins`` bins of exactly ``capacity`` each, the largest bin load as small as found:
    longest-first greedy, then swaps out of the most loaded bin."""
    if bins == 1:
        return [list(items)]
    order = sorted(items, key=lambda i: (-costs[i], i))
    out: list[list[int]] = [[] for _ in range(bins)]
    load = [0.0] * bins
    for i in order:
        b = min((k for k in range(bins) if len(out[k]) < capacity), key=lambda k: (load[k], k))
        out[b].append(i)
        load[b] += costs[i]
    for _ in range(4 * bins * capacity):  # NOTE: bounded; each swap strictly lowers the pair's larger load
        h = max(range(bins), key=lambda k: (load[k], -k))
        best = None  # (new larger load of the pair, other bin, item out of h, item into h)
        for o in range(bins):
            gap = load[h] - load[o]
            if o == h or gap <= 0:
                continue
            others = sorted(out[o], key=lambda j: costs[j])
            keys = [costs[j] for j in others]
            for i in out[h]:
                # the ideal partner costs costs[i] - gap / 2 (both bins end at the mean of the two)
                at = bisect.bisect_left(keys, costs[i] - gap / 2)
                for k in (at - 1, at):
                    if 0 <= k < len(others):
                        d = costs[i] - keys[k]
                        if 0 < d < gap:
                            worst = max(load[h] - d, load[o] + d)
                            if best is None or worst < best[0]:
                                best = (worst, o, i, others[k])
        if best is None:
            break
        _, o, i, j = best
        out[h].remove(i), out[o].remove(j)
        out[h].append(j), out[o].append(i)
        d = costs[i] - costs[j]
        load[h], load[o] = load[h] - d, load[o] + d
    return out


class LoadBalancer:
    """The cost model a run places its global batches with: :data:`DEFAULT_COST` until it is fitted, the fit from
    step ``fitted_from`` on (so a step's placement is a function of the step: every rank, and a worker making
    steps ahead, agree on it)."""

    def __init__(self, *, warmup_steps: int = 3, default: CostModel = DEFAULT_COST):
        self.warmup_steps, self.default = warmup_steps, default
        self.fitted: CostModel | None = None
        self.fitted_from: int | None = None

    def cost(self, step: int) -> CostModel:
        if self.fitted is not None and self.fitted_from is not None and step >= self.fitted_from:
            return self.fitted
        return self.default

    def use(self, model: CostModel | None, *, from_step: int) -> None:
        """Place steps ``from_step`` onwards with ``model`` (None: keep the current one)."""
        if model is not None:
            self.fitted, self.fitted_from = model, from_step

    def place(self, features: Sequence[Features], *, step: int, ranks: int, microbatches: int,
              micro_batch_size: int) -> Placement:
        return balance(features, ranks=ranks, microbatches=microbatches, micro_batch_size=micro_batch_size,
                       cost=self.cost(step))
