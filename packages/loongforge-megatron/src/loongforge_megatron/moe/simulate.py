"""Replay expert loads through replica planners and score each plan on the step it is used for.

At every step ``t`` a planner sees only the loads of steps before ``t`` (EPLB-style: the mean over a history window;
ours: the same window, plus its previous plan) and is judged on step ``t``'s real loads:

- imbalance: max / mean - 1 of the EP ranks' tokens, averaged over layers; mean and p99 over steps;
- traffic: link-cost-weighted bytes of the token dispatch + combine (``placement.traffic``);
- migration: link-cost-weighted bytes of replica weights copied because a spare slot changed expert;
- sync: link-cost-weighted bytes of the per-step replica refresh (weights out, gradients back), reported apart;
- solve time of the planner per call (all layers).

``synthetic_loads`` makes Zipf-popular experts with injected hot experts and temporal drift.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from loongforge_megatron.moe.placement import (
    Placement,
    PlacementError,
    Topology,
    cross_node_tokens,
    migration,
    no_replicas,
    plan,
    plan_eplb,
    replica_sync,
    traffic,
    validate,
)

PLANNERS = ("none", "eplb", "ours")


@dataclass(frozen=True)
class Shape:
    """The sizes that turn tokens and expert copies into bytes (bf16): hidden size and expert FFN size."""

    hidden: int
    ffn: int
    dtype_bytes: int = 2

    @property
    def token_bytes(self) -> int:
        return 2 * self.hidden * self.dtype_bytes  # dispatch and combine

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden * self.ffn * self.dtype_bytes  # gate, up, down


def synthetic_loads(*, steps: int, layers: int, experts: int, tokens: int, zipf: float = 1.0, hot: int = 2,
                    hot_factor: float = 4.0, drift: float = 0.05, hot_every: int = 50, seed: int = 0) -> np.ndarray:
    """``[steps, layers, experts]`` token counts: per layer a shuffled Zipf(``zipf``) popularity, ``hot`` experts
    ``hot_factor`` x hotter (a new hot set every ``hot_every`` steps), log-popularity drifting by ``drift`` (a
    random walk) per step, ``tokens`` routed tokens (x top-k) sampled per step and layer."""
    rng = np.random.default_rng(seed)
    base = np.log(1.0 / np.arange(1, experts + 1) ** zipf)
    logp = np.stack([rng.permutation(base) for _ in range(layers)])
    out = np.empty((steps, layers, experts))
    boost = np.zeros((layers, experts))
    for t in range(steps):
        if hot and t % max(hot_every, 1) == 0:
            boost[:] = 0
            for layer in range(layers):
                boost[layer, rng.choice(experts, hot, replace=False)] = np.log(hot_factor)
        logp += drift * rng.standard_normal(logp.shape)
        p = np.exp(logp + boost)
        p /= p.sum(1, keepdims=True)
        out[t] = rng.poisson(p * tokens)
    return out


def _imbalance(rank_loads: np.ndarray) -> np.ndarray:
    mean = rank_loads.mean(1)
    return np.where(mean > 0, rank_loads.max(1) / np.maximum(mean, 1e-12) - 1, 0.0)


def replay(trace: np.ndarray, topology: Topology, *, slots_per_rank: int, shape: Shape, window: int = 10,
           interval: int = 1) -> dict[str, dict[str, float]]:
    """Scores of ``none``, ``eplb`` and ``ours`` on ``trace[steps, layers, experts]`` (all-zero layers, i.e. dense
    ones, dropped); plans are remade every ``interval`` steps from the last ``window`` steps."""
    trace = np.asarray(trace, dtype=np.float64)
    if trace.ndim != 3 or trace.shape[0] < 2:
        raise PlacementError(f"a trace must be [steps >= 2, layers, experts] token counts, got shape {trace.shape}")
    trace = trace[:, trace.sum((0, 2)) > 0]
    if trace.shape[1] == 0:
        raise PlacementError("the trace has no MoE layer with routed tokens")
    steps, layers, experts = trace.shape
    validate(trace[0], topology, slots_per_rank)  # NOTE: one line for an impossible layout, before any replay
    planners: dict[str, Callable[[np.ndarray, Placement | None], Placement]] = {
        "none": lambda h, prev: no_replicas(experts, topology, layers),
        "eplb": lambda h, prev: plan_eplb(h, topology, slots_per_rank),
        "ours": lambda h, prev: plan(h, topology, slots_per_rank, previous=prev),
    }
    out = {}
    for name, make in planners.items():
        current: Placement | None = None
        imb, tok, cross, mig, sync, solve = [], [], [], [], [], []
        for t in range(1, steps):
            if current is None or (t - 1) % interval == 0:
                history = trace[max(0, t - window):t].mean(0)
                start = time.perf_counter()
                new = make(history, current)
                solve.append(time.perf_counter() - start)
                mig.append(migration(current, new, topology).sum() * shape.expert_bytes)
                current = new
            else:
                mig.append(0.0)
            now = trace[t]
            imb.append(_imbalance(current.rank_loads(now)).mean())
            tok.append(traffic(current, now, topology).sum() * shape.token_bytes)
            cross.append(cross_node_tokens(current, now, topology).sum())
            sync.append(replica_sync(current, topology).sum() * shape.expert_bytes if name != "none" else 0.0)
        imb_a = np.asarray(imb)
        out[name] = {"imbalance_mean": float(imb_a.mean()), "imbalance_p99": float(np.percentile(imb_a, 99)),
                     "traffic_gb": float(np.mean(tok)) / 1e9, "cross_node_tokens": float(np.mean(cross)), "migration_gb": float(np.mean(mig)) / 1e9,
                     "sync_gb": float(np.mean(sync)) / 1e9, "solve_ms": 1e3 * float(np.mean(solve))}
    return out


def cross_node_bound(trace: np.ndarray, topology: Topology, *, slots_per_rank: int) -> float:
    """The fewest cross-node tokens per step any plan with this slot budget can reach on ``trace`` (balance ignored):
    every replica on a node without a copy keeps at most ``1 / nodes`` of its expert's tokens on that node, so the
    best plan gives the ``ranks x spare`` slots to the largest of those savings (steps 1.., as ``replay`` scores)."""
    trace = np.asarray(trace, dtype=np.float64)[1:]
    nodes = topology.nodes
    spare = topology.ranks * (slots_per_rank - trace.shape[2] // topology.ranks)
    base = trace.sum(2) * (nodes - 1) / nodes
    if nodes == 1 or spare == 0:
        return float(base.sum(1).mean())
    gains = np.sort(np.repeat(trace / nodes, nodes - 1, axis=2), axis=2)[:, :, ::-1][:, :, :spare].sum(2)
    return float((base - gains).sum(1).mean())


def table(results: dict[str, dict[str, float]], *, title: str = "") -> str:
    """The scores of ``replay`` side by side as a Markdown table (per step; GB are link-cost-weighted)."""
    head = ("| planner | imbalance mean | imbalance p99 | traffic GB/step | migration GB/step | traffic+migration vs "
            "eplb | replica sync GB/step | solve ms |")
    lines = [f"**{title}**", ""] if title else []
    lines += [head, "|" + "---|" * 8]
    ref = results["eplb"]["traffic_gb"] + results["eplb"]["migration_gb"]
    for name, r in results.items():
        both = r["traffic_gb"] + r["migration_gb"]
        lines.append(f"| {name} | {r['imbalance_mean']:.3f} | {r['imbalance_p99']:.3f} | {r['traffic_gb']:.4g} | "
                     f"{r['migration_gb']:.4g} | {both / ref if ref else float('nan'):.2f}x | {r['sync_gb']:.4g} | "
                     f"{r['solve_ms']:.2f} |")
    return "\n".join(lines)


def plot(cases: dict[str, dict[str, dict[str, float]]], path: str) -> bool:
    """Bar charts of imbalance and traffic + migration per case and planner; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    names = list(cases)
    width = 0.8 / len(PLANNERS)
    for i, planner in enumerate(PLANNERS):
        x = np.arange(len(names)) + i * width
        axes[0].bar(x, [cases[c][planner]["imbalance_mean"] for c in names], width, label=planner)
        axes[1].bar(x, [cases[c][planner]["traffic_gb"] + cases[c][planner]["migration_gb"] for c in names], width,
                    label=planner)
    for ax, label in zip(axes, ("imbalance (max/mean - 1), next step", "traffic + migration, GB/step (weighted)"),
                         strict=True):
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=15, fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
