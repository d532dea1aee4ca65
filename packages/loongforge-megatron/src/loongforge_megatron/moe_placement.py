"""Static expert placement: reorder a MoE checkpoint's experts so every expert-parallel rank gets a balanced load.

megatron gives EP rank ``r`` the contiguous experts ``r*E/ep .. (r+1)*E/ep - 1``, so the busiest rank sets the
pace of the All2All and of the expert GEMMs. Renumbering experts changes nothing the model computes, provided the
router's rows (and DeepSeek's ``e_score_correction_bias``) are renumbered with them. ``plan_layer`` picks the order
from measured loads (``moe_imbalance.json``, written by every MoE training run); ``rebalance_hf`` writes the
renumbered HF checkpoint to continue training from.

Topology: with group-limited routing (DeepSeek's ``n_group`` / ``topk_group``, groups laid out to match nodes) an
expert must stay in its group. If each rank holds whole groups, groups move between ranks (group order); if each
group spans several ranks, experts move only among their group's ranks — the node a token's experts sit on
does not change, so inter-node traffic does not either.

The assignment is greedy longest-processing-time with equal slots per rank: each expert, busiest first, goes to
the least loaded rank that still has a free slot.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from loongforge.errors import CheckpointError

_EXPERT = re.compile(r"^(model\.layers\.(\d+)\.mlp\.experts\.)(\d+)(\..+)$")
_ROUTER = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate\.(weight|e_score_correction_bias)$")


def _lpt(loads: Sequence[float], items: Sequence[int], *, bins: int) -> list[list[int]]:
    """``items`` split into ``bins`` equal-size lists with balanced load (greedy, busiest first)."""
    per_bin = len(items) // bins
    out: list[list[int]] = [[] for _ in range(bins)]
    total = [0.0] * bins
    for i in sorted(items, key=lambda i: (-loads[i], i)):
        b = min((b for b in range(bins) if len(out[b]) < per_bin), key=lambda b: (total[b], b))
        out[b].append(i)
        total[b] += loads[i]
    return [sorted(b) for b in out]


def plan_layer(loads: Sequence[float], *, ep: int, groups: int = 1) -> list[int]:
    """New expert order (``order[new] = old``) for one layer: EP rank ``r`` then holds ``order[r*E/ep:(r+1)*E/ep]``."""
    n = len(loads)
    if ep < 1 or n % ep:
        raise CheckpointError(f"{n} experts do not split over ep = {ep}")
    if groups < 1 or n % groups:
        raise CheckpointError(f"{n} experts do not split into {groups} routing groups")
    size = n // groups
    members = [list(range(g * size, (g + 1) * size)) for g in range(groups)]
    if groups == 1 or ep % groups == 0:
        # every group spans ep / groups ranks: balance inside each group
        per_group = ep // groups if groups > 1 else ep
        return [e for g in members for rank in _lpt(loads, g, bins=per_group) for e in rank]
    if groups % ep == 0:
        # every rank holds groups / ep whole groups: move groups, keep each group's experts together
        group_load = [sum(loads[e] for e in g) for g in members]
        return [e for rank in _lpt(group_load, range(groups), bins=ep) for g in rank for e in members[g]]
    raise CheckpointError(f"ep = {ep} and {groups} routing groups: one must divide the other")


def rank_imbalance(loads: Sequence[float], order: Sequence[int], *, ep: int) -> float:
    """max / mean - 1 of the EP ranks' loads under ``order`` (the training metric's formula; 0 for no load)."""
    import torch

    from loongforge_megatron.engine.router_load import imbalance

    return imbalance(torch.tensor([[loads[e] for e in order]], dtype=torch.float64), ep=ep)["ep"][0] or 0.0


def _load_row(row: object, *, layer: int, num_experts: int, where: str | Path) -> list[float]:
    """One MoE layer's loads: ``num_experts`` non-negative numbers (``CheckpointError`` naming the layer else)."""
    ok = isinstance(row, list) and all(isinstance(x, int | float) and not isinstance(x, bool) and x >= 0 for x in row)
    if not ok or len(row) != num_experts:
        shown = f"{len(row)} values" if isinstance(row, list) else repr(row)[:40]
        raise CheckpointError(f"{where}: layer {layer} must give {num_experts} non-negative token counts (one per "
                              f"expert of the model), got {shown}")
    return [float(x) for x in row]


def rebalance_hf(src: str | Path, dst: str | Path, *, loads: str | Path, ep: int, force: bool = False) -> dict:
    """Write ``src`` (an HF MoE checkpoint) to ``dst`` with every MoE layer's experts renumbered for ``ep`` ranks by
    the loads in ``loads`` (a run's ``moe_imbalance.json``). Returns (and writes as ``dst/expert_placement.json``)
    the per-layer order and EP-rank imbalance before / after."""
    from loongforge.checkpoint import SafetensorsReader
    from loongforge.checkpoint.safetensors_io import ShardedSafetensorsWriter

    from loongforge_megatron.conversion.convert import copy_assets, read_hf_config

    src, dst = Path(src), Path(dst)
    config = read_hf_config(src)
    try:
        per_layer = json.loads(Path(loads).read_text())["tokens_per_expert"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{loads}: not a run's moe_imbalance.json ({type(e).__name__}: {e})") from None
    groups = int(config.get("n_group") or 1)
    reader = SafetensorsReader(src)
    names = reader.keys()
    moe_layers = sorted({int(m.group(2)) for k in names if (m := _EXPERT.match(k))})
    if not moe_layers:
        raise CheckpointError(f"{src}: no routed experts (model.layers.N.mlp.experts.E.*) to place")
    if not isinstance(per_layer, list) or len(per_layer) != config["num_hidden_layers"]:
        got = f"{len(per_layer)} layers" if isinstance(per_layer, list) else type(per_layer).__name__
        raise CheckpointError(f"{loads}: tokens_per_expert must list one row per layer ({config['num_hidden_layers']} "
                              f"in {src}), got {got}")
    num_experts = 1 + max(int(m.group(3)) for k in names if (m := _EXPERT.match(k)))
    orders, report = {}, {"ep": ep, "groups": groups, "layers": {}}
    for layer in moe_layers:
        row = _load_row(per_layer[layer], layer=layer, num_experts=num_experts, where=loads)
        order = plan_layer(row, ep=ep, groups=groups)
        orders[layer] = order
        report["layers"][str(layer)] = {
            "order": order, "imbalance_before": rank_imbalance(row, range(len(row)), ep=ep),
            "imbalance_after": rank_imbalance(row, order, ep=ep)}
    new_index = {layer: {old: new for new, old in enumerate(order)} for layer, order in orders.items()}

    def target(name: str) -> str:
        m = _EXPERT.match(name)
        if m and int(m.group(2)) in new_index:
            return f"{m.group(1)}{new_index[int(m.group(2))][int(m.group(3))]}{m.group(4)}"
        return name

    specs = {target(k): (reader.dtype(k), reader.shape(k)) for k in names}
    writer = ShardedSafetensorsWriter(dst, specs, force=force)
    try:
        for k in names:
            t = reader.get(k)
            m = _ROUTER.match(k)
            if m and int(m.group(1)) in orders:
                t = t[orders[int(m.group(1))]].contiguous()  # router row ``new`` scores expert ``order[new]``
            writer.add(target(k), t)
        copy_assets(src, writer.staging_dir)
        (writer.staging_dir / "expert_placement.json").write_text(json.dumps(report, indent=1))
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return report
