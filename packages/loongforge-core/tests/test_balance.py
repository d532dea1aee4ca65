"""DP load balancing: every sample placed exactly once, a skewed global batch evened out, the cost fit."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from loongforge.parallel.balance import (
    DEFAULT_COST,
    CostModel,
    LoadBalancer,
    balance,
    fit_cost_model,
    imbalance,
)


def _vlm_batch(n: int, *, seed: int) -> list[tuple[float, float, float]]:
    """Packed multimodal samples: lognormal text lengths, and images of mixed sizes on half of them."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        lengths = [max(8, int(rng.lognormvariate(6.0, 1.0))) for _ in range(rng.randint(1, 3))]
        patches = rng.choice([0, 0, 64, 256, 1024, 4096])
        out.append((float(sum(x * x for x in lengths)), float(sum(lengths)), float(patches)))
    return out


@pytest.mark.parametrize(("micro_batch_size", "microbatches"), [(1, 4), (2, 8), (4, 2)])
def test_every_sample_is_placed_exactly_once(micro_batch_size, microbatches):
    feats = _vlm_batch(8 * microbatches * micro_batch_size, seed=micro_batch_size)
    placed = balance(feats, ranks=8, microbatches=microbatches, micro_batch_size=micro_batch_size)
    got = Counter(i for rank in placed.microbatches for mb in rank for i in mb)
    assert got == Counter(range(len(feats)))
    assert len(placed.microbatches) == 8
    assert all(len(rank) == microbatches and all(len(mb) == micro_batch_size for mb in rank)
               for rank in placed.microbatches)


def test_lognormal_vlm_batch_is_evened_out_over_eight_ranks():
    """Over eight global batches the in-order placement is max/mean >= 1.3 (median); the balanced one is <= 1.05 on
    every batch."""
    before = []
    for seed in range(8):
        feats = _vlm_batch(8 * 8 * 2, seed=100 + seed)
        placed = balance(feats, ranks=8, microbatches=8, micro_batch_size=2)
        before.append(imbalance(placed.before))
        assert imbalance(placed.after) <= 1.05, (seed, imbalance(placed.after))
        assert sum(placed.before) == pytest.approx(sum(placed.after))  # the same samples, only moved
    assert sorted(before)[len(before) // 2] >= 1.3, before


def test_microbatches_within_a_rank_are_evened_out_too():
    feats = _vlm_batch(2 * 4 * 2, seed=7)
    placed = balance(feats, ranks=2, microbatches=4, micro_batch_size=2)
    for rank in placed.microbatches:
        costs = [DEFAULT_COST.microbatch([feats[i] for i in mb]) for mb in rank]
        in_order = [DEFAULT_COST.microbatch([feats[i] for i in sorted(sum(rank, []))[k::4]]) for k in range(4)]
        assert max(costs) <= max(in_order)


def test_placement_is_a_function_of_the_costs():
    feats = _vlm_batch(64, seed=3)
    a = balance(feats, ranks=8, microbatches=4, micro_batch_size=2)
    b = balance(list(feats), ranks=8, microbatches=4, micro_batch_size=2)
    assert a.microbatches == b.microbatches


def test_wrong_batch_size_is_refused():
    with pytest.raises(ValueError, match=r"ranks \* microbatches \* micro_batch_size = 2 \* 2 \* 1 = 4"):
        balance(_vlm_batch(5, seed=0), ranks=2, microbatches=2, micro_batch_size=1)


def test_fit_recovers_known_coefficients():
    true = CostModel(a=3e-7, b=2e-4, c=5e-3, v=1e-4)
    rng = random.Random(0)
    rows, secs, counts = [], [], []
    for _ in range(40):
        k = rng.randint(1, 4)  # micro-batches summed in the row
        mbs = [_vlm_batch(2, seed=rng.randint(0, 10**6)) for _ in range(k)]
        f = tuple(sum(s[j] for mb in mbs for s in mb) for j in range(3))
        rows.append(f), counts.append(k)
        secs.append(true.a * f[0] + true.b * f[1] + true.c * k + true.v * f[2])
    got = fit_cost_model(rows, secs, counts=counts)
    for name in "abcv":
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-6), name


def test_fit_without_images_or_with_too_few_rows():
    feats = [(float(x * x), float(x), 0.0) for x in (100, 300, 700, 1200)]
    got = fit_cost_model(feats, [2e-6 * f[0] + 1e-3 * f[1] + 0.01 for f in feats])
    assert got.v == 0 and got.a == pytest.approx(2e-6) and got.b == pytest.approx(1e-3) and got.c == pytest.approx(0.01)
    assert fit_cost_model(feats[:1], [1.0]) is not None  # one row: one coefficient
    assert fit_cost_model([], []) is None


def test_balancer_uses_the_fit_from_its_step_on():
    lb = LoadBalancer()
    fit = CostModel(a=1.0, b=0.0)
    lb.use(fit, from_step=5)
    assert lb.cost(4) == DEFAULT_COST and lb.cost(5) == fit
    lb.use(None, from_step=9)
    assert lb.cost(9) == fit


def test_progress_line_shows_the_dp_imbalance(tmp_path):
    from loongforge.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path, enabled=False)
    line = logger._progress_line(1, {"loss": 1.0, "dp_imbalance_before": 1.42, "dp_imbalance_after": 1.01}, 0.0)
    assert "dp imbalance 1.42->1.01" in line
