"""``train.freeze``: parameters kept as they are. Each entry is a module group of the model (the spec's
``Model.groups``, e.g. ``vision``, ``projector``, ``language``) or a glob over parameter names
(``decoder.layers.0.*``). Frozen parameters stop requiring gradients before DDP and the optimizer are built, so
they get no gradient buffer, no optimizer state and stay bit-identical (megatron skips them in both)."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from typing import Any

import torch
from loongforge.errors import RecipeError

from loongforge_megatron.engine.model import unwrap


def check_names(entries: list[str], *, groups: Mapping[str, tuple[str, ...]]) -> None:
    """Refuse a name that is neither a group nor a pattern (``*``, ``?``, ``[``), naming the groups."""
    for entry in entries:
        if entry not in groups and not any(c in entry for c in "*?["):
            known = ", ".join(groups) or "none"
            raise RecipeError(f"'{entry}' is not a module group of this model (groups: {known}) nor a parameter "
                              "name pattern such as 'decoder.layers.0.*'", key="train.freeze")


def check_freeze(entries: list[str], *, groups: Mapping[str, tuple[str, ...]], stage: str,
                 names: list[str] | None = None) -> None:
    """What ``freeze`` would refuse, known before the model exists (``validate``): a name that is not a group of
    this model (``[vision]`` on a language model), a pattern outside every module the model has (``names``: its
    parameter names as its HF name map lists them, when known), and a freeze that leaves nothing to train (every
    group of the model, or a pattern of only ``*``)."""
    check_names(entries, groups=groups)
    if not entries or stage == "lora":  # NOTE: LoRA trains its adapters whatever the base keeps
        return
    for e in entries:
        if e in groups or names is None:
            continue
        # NOTE: only the pattern's module path before its first wildcard is checked (``decoder.layers.9.`` of a
        # 4-layer model): the name map's leaf names may differ from the layers' own (grouped experts, te's fused
        # norms); the build checks the whole pattern against the model's parameters
        head = re.split(r"[*?\[]", e, maxsplit=1)[0].rpartition(".")[0]
        if head and not any(n.startswith(head + ".") for n in names):
            raise RecipeError(f"'{e}' matches no parameter of this model (no module '{head}'; its modules: "
                              f"{', '.join(sorted({n.split('.')[0] for n in names}))})", key="train.freeze")
    frozen = [p for e in entries if e in groups for p in groups[e]]
    every = set(groups) and all(p.startswith(tuple(frozen)) for g in groups.values() for p in g)
    if every or any(e and set(e) == {"*"} for e in entries):
        some = f"some of its groups ({', '.join(groups)}) or " if groups else ""
        raise RecipeError(f"train.freeze {entries} freezes the whole model: nothing would train (freeze {some}"
                          "parameter-name patterns such as 'decoder.layers.0.*')", key="train.freeze")


def freeze(chunks: list[torch.nn.Module], entries: list[str], *, groups: Mapping[str, tuple[str, ...]],
           may_freeze_all: bool = False) -> int:
    """Freeze what ``entries`` name in this rank's ``chunks``; returns how many parameters were frozen here.
    ``may_freeze_all``: this rank holds one component only (an encoder on ranks of its own), which may be frozen
    whole."""
    check_names(entries, groups=groups)
    frozen, total = 0, 0
    hits = [0] * len(entries)
    for chunk in chunks:
        for name, p in unwrap(chunk).named_parameters():
            total += 1
            found = [name.startswith(groups[e]) if e in groups else fnmatch.fnmatchcase(name, e) for e in entries]
            hits = [h + f for h, f in zip(hits, found, strict=True)]
            if any(found) and p.requires_grad:
                p.requires_grad_(False)
                frozen += 1
    unmatched = [e for e, h in zip(entries, _on_all_ranks(hits, chunks), strict=True) if not h]
    if unmatched:
        raise RecipeError(f"train.freeze {unmatched} match(es) no parameter of the model (groups: "
                          f"{', '.join(groups) or 'none'}; patterns match names such as 'decoder.layers.0.*')",
                          key="train.freeze")
    if entries and not may_freeze_all and not any(p.requires_grad for c in chunks for p in c.parameters()):
        raise RecipeError(f"train.freeze {entries} leaves nothing to train on this rank's {total} parameters",
                          key="train.freeze")
    return frozen


def _on_all_ranks(hits: list[int], chunks: list[torch.nn.Module]) -> list[int]:
    """Each entry's matches summed over every rank (a pattern may match only another pipeline stage's layers).

    NOTE: every rank freezes the same entries at the same point of the build, so every rank takes part and all
    reach the same verdict."""
    import torch.distributed as dist

    if not hits or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return hits
    device = next((p.device for c in chunks for p in c.parameters()), torch.device("cpu"))
    t = torch.tensor(hits, dtype=torch.long, device=device)
    dist.all_reduce(t)
    return t.tolist()


def parameter_names(spec: Any, arch: Any) -> list[str] | None:
    """The model's parameter names as its HF name map lists them (one pipeline stage), or None where the family
    has no such map."""
    try:
        cfg = spec.hf_config(arch, torch_dtype="float32")
        layers = spec.name_map(cfg, divisible_by=128).expand(
            num_layers=arch.num_layers, num_experts=getattr(arch, "num_experts", None) or 0,
            mtp_layers=getattr(arch, "mtp_num_layers", None) or 0)
        return [p.megatron for p in layers]
    except Exception:  # noqa: BLE001 - NOTE: a best-effort check at validate; the build checks exactly
        return None
