"""Declarative wildcard name maps between a backend's parameter names and HF names, plus pipeline placement.

An entry reads ``decoder.layers.*.mlp.linear_fc2.weight <-> model.layers.*.mlp.down_proj.weight`` with a rule.
The first ``*`` is a layer index (backend side: local to its pipeline chunk; HF side: global), the second an
expert index (backend side: local to its EP rank; HF side: global, or none where HF fuses every expert into one
3-D tensor: rule :class:`~loongforge.checkpoint.mapping.FusedExperts`). Entries without ``*`` live on the first
(embedding) or last (head) pipeline stage. Entries of stage ``mtp`` are multi-token-prediction layers: the
``*`` is the depth (backend: ``mtp.layers.<depth>``; HF: layer ``num_layers + depth``, or the depth itself for an
entry with ``hf_depth``; an HF name without ``*`` is depth 0's), all on the last stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from loongforge.checkpoint.mapping import SINGLE, Expert, Rule
from loongforge.errors import CheckpointError, ParallelPlanError
from loongforge.parallel.layers import chunk_layer_counts, layer_ranges


@dataclass(frozen=True)
class Entry:
    """One mapping: backend pattern, HF pattern (or role -> pattern for multi-tensor rules), and its rule.

    ``stage`` places wildcard-free entries ("first", "last", or "last_tied": only when pp > 1; "mtp_copy": on the
    last stage when it is not the first and there are MTP layers); "mtp" entries are per MTP depth; ``layers`` restricts a layer entry to some
    global layer indices (e.g. DeepSeek's dense-then-MoE layers); ``export`` False skips the entry on HF export
    (tied output weights that duplicate the embedding). ``shape``: the HF tensor's shape as a function of the
    (size-tracking) HF config, one shape or role -> shape; a backend compares it with the files' headers so that a
    config.json that disagrees with its weights is refused before anything is built. ``hf_depth``: an "mtp"
    entry whose HF names count MTP depths from 0 (``mtp.layers.<depth>``) instead of following the decoder's layers.
    """

    megatron: str
    hf: str | dict[str, str]
    rule: Rule
    stage: str = "layer"
    layers: Callable[[int], bool] | None = None
    export: bool = True
    shape: Callable[[Any], Any] | None = None
    hf_depth: bool = False

    def hf_patterns(self) -> dict[str, str]:
        return {SINGLE: self.hf} if isinstance(self.hf, str) else dict(self.hf)

    @property
    def is_expert(self) -> bool:
        return isinstance(self.rule, Expert)


@dataclass(frozen=True)
class Placement:
    """Where one concrete parameter lives: pipeline stage + virtual chunk, and (experts) its EP rank."""

    pp_rank: int
    vpp_rank: int
    ep_rank: int | None  # None: not an expert tensor, present on every EP rank


@dataclass(frozen=True)
class Param:
    """One concrete parameter: backend name (local indices), HF names by role (global indices), rule."""

    megatron: str
    hf: dict[str, str]
    rule: Rule
    where: Placement
    export: bool = True
    shape: Callable[[Any], Any] | None = None  # the entry's HF shape (see Entry)


def _fill(pattern: str, values: list[int]) -> str:
    parts = pattern.split("*")
    if len(parts) - 1 != len(values):
        raise CheckpointError(f"pattern '{pattern}' has {len(parts) - 1} wildcards, got {len(values)} indices")
    out = parts[0]
    for value, tail in zip(values, parts[1:], strict=True):
        out += str(value) + tail
    return out


@dataclass(frozen=True)
class PipelineLayout:
    """Megatron's layer assignment: ``num_layers`` split into ``pp * vpp`` model chunks, evenly or with set
    first/last-stage sizes (:mod:`loongforge.parallel.layers`).

    Chunk ``c = vpp_rank * pp + pp_rank`` holds the next consecutive global layers, so with vpp > 1 the stages
    take chunks in interleaved order. Local indices restart at 0 in every chunk.
    """

    num_layers: int
    pp: int = 1
    vpp: int = 1
    first: int | None = None  # layers on the first stage (uneven split); None: even
    last: int | None = None  # layers on the last stage

    def __post_init__(self) -> None:
        try:
            counts = chunk_layer_counts(self.num_layers, pp=self.pp, vpp=self.vpp, first=self.first, last=self.last,
                                        prefix="layout")
        except ParallelPlanError as e:
            raise CheckpointError(str(e)) from None
        object.__setattr__(self, "_ranges", layer_ranges(counts))

    def locate(self, layer: int) -> tuple[int, int, int]:
        """Global layer -> (pp_rank, vpp_rank, local index)."""
        for (pp_rank, vpp_rank), r in self._ranges.items():  # type: ignore[attr-defined]
            if layer in r:
                return pp_rank, vpp_rank, layer - r.start
        raise CheckpointError(f"layer {layer} is outside the model's {self.num_layers} layers")

    def global_layer(self, local: int, *, pp_rank: int, vpp_rank: int = 0) -> int:
        return self.layers_of(pp_rank=pp_rank, vpp_rank=vpp_rank)[local]

    def layers_of(self, *, pp_rank: int, vpp_rank: int = 0) -> range:
        return self._ranges[(pp_rank, vpp_rank)]  # type: ignore[attr-defined]


@dataclass(frozen=True)
class NameMap:
    """A model family's full mapping; expands to concrete parameters for a given layout."""

    entries: list[Entry] = field(default_factory=list)

    def expand(
        self, *, num_layers: int, num_experts: int = 0, pp: int = 1, vpp: int = 1, ep: int = 1,
        first_stage_layers: int | None = None, last_stage_layers: int | None = None, mtp_layers: int = 0,
    ) -> Iterator[Param]:
        """Every concrete parameter in HF order (stage by stage), each with its placement; ``mtp_layers``:
        multi-token-prediction depths (megatron keeps them after the decoder, on the last stage)."""
        layout = PipelineLayout(num_layers, pp, vpp, first_stage_layers, last_stage_layers)
        first, last = Placement(0, 0, None), Placement(pp - 1, vpp - 1, None)
        for e in self.entries:
            if e.stage == "first":
                yield Param(e.megatron, e.hf_patterns(), e.rule, first, e.export, e.shape)
        slots = [("layer", layer, *layout.locate(layer)) for layer in range(num_layers)]
        slots += [("mtp", num_layers + d, last.pp_rank, last.vpp_rank, d) for d in range(mtp_layers)]
        for stage, layer, pp_rank, vpp_rank, local in slots:
            for e in self.entries:
                if e.stage != stage or (e.layers is not None and not e.layers(layer)):
                    continue
                index = local if e.hf_depth else layer
                if not e.is_expert:
                    hf = {r: _fill(p, [index]) if "*" in p or not e.hf_depth else p for r, p in e.hf_patterns().items()}
                    where = Placement(pp_rank, vpp_rank, None)
                    yield Param(_fill(e.megatron, [local]), hf, e.rule, where, e.export, e.shape)
                    continue
                rule: Expert = e.rule  # type: ignore[assignment]
                for expert in range(num_experts):
                    ep_rank, local_e = rule.locate(expert, ep_size=ep)
                    # NOTE: a fused HF tensor holds every expert (FusedExperts): its name has the layer only
                    hf_index = [index] if rule.fused else [index, expert]
                    hf = {r: _fill(p, hf_index) for r, p in e.hf_patterns().items()}
                    where = Placement(pp_rank, vpp_rank, ep_rank)
                    yield Param(_fill(e.megatron, [local, local_e]), hf, rule.for_expert(expert), where, e.export, e.shape)
        for e in self.entries:
            # NOTE: "mtp_copy": megatron's MTP block embeds the shifted tokens itself, with its own copy of the
            # embedding when the decoder's first stage is elsewhere
            if e.stage == "mtp_copy" and mtp_layers and last != first:
                yield Param(e.megatron, e.hf_patterns(), e.rule, last, e.export, e.shape)
            # NOTE: "last_tied" is a tied output layer: megatron keeps a copy only when the head is on
            # another stage than the embedding.
            if e.stage == "last" or (e.stage == "last_tied" and last != first):
                yield Param(e.megatron, e.hf_patterns(), e.rule, last, e.export, e.shape)

    def for_rank(
        self, *, num_layers: int, num_experts: int = 0, pp: int = 1, vpp: int = 1, ep: int = 1,
        pp_rank: int, vpp_rank: int = 0, ep_rank: int = 0,
        first_stage_layers: int | None = None, last_stage_layers: int | None = None, mtp_layers: int = 0,
    ) -> list[Param]:
        """The parameters one (pp, vpp, ep) rank holds."""
        out = []
        for p in self.expand(num_layers=num_layers, num_experts=num_experts, pp=pp, vpp=vpp, ep=ep,
                             first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
                             mtp_layers=mtp_layers):
            w = p.where
            if (w.pp_rank, w.vpp_rank) == (pp_rank, vpp_rank) and w.ep_rank in (None, ep_rank):
                out.append(p)
        return out
