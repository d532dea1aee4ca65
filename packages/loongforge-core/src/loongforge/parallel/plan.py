"""ParallelPlan: the resolved parallel layout of a run, validated before any process group exists.

The recipe's ``parallel`` section (``loongforge.recipe.schema.ParallelConfig``) is resolved against a world
size into a frozen :class:`ParallelPlan`; every impossible combination is rejected with the arithmetic in the
message. Model-dependent checks (heads, layers, experts, sequence length) live in :meth:`ParallelPlan.check_model`.

Layout follows megatron-core's rank order ``tp-cp-ep-dp-pp``: the dense grid is tp × cp × dp × pp and the expert
grid is etp × ep × edp × pp over the same ranks. Per-component plans (``parallel.components.<name>``) describe
grids over the same ranks (colocated) or over disjoint rank ranges (``num_ranks``), which maps directly onto
megatron-core's ``HyperCommGrid`` / MIMO ``module_to_grid_map``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from loongforge.errors import ParallelPlanError
from loongforge.parallel.layers import chunk_layer_counts

RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class ParallelPlan:
    """Resolved sizes. ``dp`` is derived: world_size / (tp * pp * cp)."""

    world_size: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    sp: bool = False
    distributed_optimizer: bool = False
    recompute: str = "none"
    recompute_layers: int | None = None
    strategy: str = "auto"
    shard_size: int | None = None
    first_rank: int = 0
    decoupled: bool = False  # a component run outside the pipeline schedule (``components.<name>.decoupled``)
    components: dict[str, ParallelPlan] = field(default_factory=dict)

    @property
    def edp(self) -> int:
        """Expert data-parallel size: ranks that hold the same experts."""
        return self.world_size // (self.pp * self.ep * self.etp)

    def component(self, name: str) -> ParallelPlan:
        """The plan of one model component (falls back to the global plan)."""
        return self.components.get(name, self)

    def grad_accumulation(self, *, global_batch_size: int, micro_batch_size: int) -> int:
        """Micro-batches per step per data-parallel rank; the global batch is fixed by the recipe."""
        per_step = micro_batch_size * self.dp
        if global_batch_size % per_step:
            raise ParallelPlanError(
                f"train.global_batch_size = {global_batch_size} is not divisible by "
                f"train.micro_batch_size * dp = {micro_batch_size} * {self.dp} = {per_step}"
            )
        return global_batch_size // per_step

    def check_model(
        self,
        *,
        num_layers: int,
        num_attention_heads: int,
        num_query_groups: int | None = None,
        num_experts: int | None = None,
        seq_length: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """Reject layouts the model's shape cannot be split into."""
        groups = num_query_groups or num_attention_heads
        if num_attention_heads % self.tp:
            raise ParallelPlanError(f"model has {num_attention_heads} attention heads, not divisible by tp = {self.tp}")
        if groups % self.tp:
            raise ParallelPlanError(f"model has {groups} query groups (KV heads), not divisible by tp = {self.tp}")
        chunk_layer_counts(num_layers, pp=self.pp, vpp=self.vpp, first=self.first_stage_layers,
                           last=self.last_stage_layers)
        if self.ep > 1 or self.etp != self.tp:
            if not num_experts:
                raise ParallelPlanError(f"ep = {self.ep}, etp = {self.etp} need a MoE model (model has no experts)")
            if num_experts % self.ep:
                raise ParallelPlanError(f"model has {num_experts} experts, not divisible by ep = {self.ep}")
        if seq_length is not None:
            if self.cp > 1 and seq_length % (2 * self.cp):
                raise ParallelPlanError(
                    f"seq_length = {seq_length} is not divisible by 2 * cp = {2 * self.cp} (load-balanced context parallel)"
                )
            if self.sp and (seq_length // self.cp) % self.tp:
                raise ParallelPlanError(
                    f"sequence parallel: seq_length / cp = {seq_length // self.cp} is not divisible by tp = {self.tp}"
                )


def _positive(name: str, value: int | None, *, prefix: str = "parallel") -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ParallelPlanError(f"{prefix}.{name} must be a positive integer (got {value!r})", key=f"{prefix}.{name}")


def resolve_plan(
    *,
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    dp: int | None = None,
    sp: bool = False,
    distributed_optimizer: bool = False,
    recompute: str = "none",
    recompute_layers: int | None = None,
    strategy: str = "auto",
    shard_size: int | None = None,
    components: dict[str, dict] | None = None,
    prefix: str = "parallel",
) -> ParallelPlan:
    """Validate sizes against ``world_size`` and derive dp. Raises :class:`ParallelPlanError`."""
    for name, value in (("tp", tp), ("pp", pp), ("vpp", vpp), ("cp", cp), ("ep", ep), ("etp", etp), ("dp", dp),
                        ("first_stage_layers", first_stage_layers), ("last_stage_layers", last_stage_layers)):
        _positive(name, value, prefix=prefix)
    if not isinstance(world_size, int) or world_size < 1:
        raise ParallelPlanError(f"world size must be a positive integer (got {world_size!r})")
    if recompute not in RECOMPUTE_MODES:
        raise ParallelPlanError(f"{prefix}.recompute = {recompute!r}; allowed: {', '.join(RECOMPUTE_MODES)}")
    etp = tp if etp is None else etp
    vpp = vpp or 1
    mp = tp * pp * cp
    if world_size % mp:
        raise ParallelPlanError(
            f"{prefix}: tp*pp*cp = {tp}*{pp}*{cp} = {mp} does not divide world size {world_size}"
        )
    derived_dp = world_size // mp
    if dp is not None and dp != derived_dp:
        raise ParallelPlanError(
            f"{prefix}.dp = {dp} but world size {world_size} / (tp*pp*cp = {mp}) = {derived_dp}; "
            f"set dp to {derived_dp}, remove it, or run on {dp * mp} processes"
        )
    if vpp > 1 and pp == 1:
        raise ParallelPlanError(f"{prefix}.vpp = {vpp} needs pipeline parallelism (pp > 1, got pp = 1)")
    for name, value in (("first_stage_layers", first_stage_layers), ("last_stage_layers", last_stage_layers)):
        if value is not None and pp == 1:
            raise ParallelPlanError(f"{prefix}.{name} = {value} needs pipeline parallelism (pp > 1, got pp = 1)")
    if sp and tp == 1:
        raise ParallelPlanError(f"{prefix}.sp = true needs tensor parallelism (tp > 1, got tp = 1)")
    expert_grid = etp * ep * pp
    if world_size % expert_grid:
        raise ParallelPlanError(
            f"{prefix}: expert grid etp*ep*pp = {etp}*{ep}*{pp} = {expert_grid} does not divide world size {world_size}"
        )
    if (tp * cp * derived_dp) % (etp * ep):
        raise ParallelPlanError(
            f"{prefix}: etp*ep = {etp}*{ep} = {etp * ep} does not divide tp*cp*dp = {tp}*{cp}*{derived_dp} = "
            f"{tp * cp * derived_dp} (ranks of one pipeline stage)"
        )
    if recompute_layers is not None and recompute != "full":
        raise ParallelPlanError(f"{prefix}.recompute_layers is only used with recompute = full (got {recompute!r})")
    if shard_size is not None:
        _positive("shard_size", shard_size, prefix=prefix)
        if derived_dp % shard_size:
            raise ParallelPlanError(
                f"{prefix}.shard_size = {shard_size} does not divide dp = {derived_dp} (HSDP replicas × shards)"
            )
    plan = ParallelPlan(
        world_size=world_size,
        tp=tp,
        pp=pp,
        vpp=vpp,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
        cp=cp,
        ep=ep,
        etp=etp,
        dp=derived_dp,
        sp=sp,
        distributed_optimizer=distributed_optimizer,
        recompute=recompute,
        recompute_layers=recompute_layers,
        strategy=strategy,
        shard_size=shard_size,
    )
    if components:
        plan = replace(plan, components=_resolve_components(plan, components, prefix=prefix))
    return plan


COMPONENT_KEYS = ("tp", "pp", "vpp", "cp", "ep", "etp", "sp", "recompute", "num_ranks", "decoupled")


def _check_component(base: ParallelPlan, name: str, cfg: dict, *, prefix: str) -> None:
    """What a component's layout must satisfy against the global one, before its own grid is resolved.

    Colocated grids (no ``num_ranks``) nest in the language model's: a component's tp / cp divides the global one
    or is a multiple of it (then a component group spans whole global groups: its embeddings are exchanged within
    a group). A disjoint grid is split on its own ``num_ranks``; what a backend runs beyond that, it refuses itself."""
    key = f"{prefix}.components.{name}"
    unknown = sorted(set(cfg) - set(COMPONENT_KEYS))
    if unknown:
        raise ParallelPlanError(f"{key}.{unknown[0]} is not a per-component key; allowed: {', '.join(COMPONENT_KEYS)}",
                                key=f"{key}.{unknown[0]}")
    for k in ("tp", "pp", "vpp", "cp", "ep", "etp", "num_ranks"):
        _positive(k, cfg.get(k), prefix=key)
    num_ranks = cfg.get("num_ranks")
    if num_ranks is not None:
        tp, pp, cp = (cfg.get(k) or 1 for k in ("tp", "pp", "cp"))
        if num_ranks % (tp * pp * cp):
            raise ParallelPlanError(f"{key}: tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp} does not divide "
                                    f"{key}.num_ranks = {num_ranks}", key=f"{key}.num_ranks")
        return
    for k in ("tp", "cp"):
        mine, glob = cfg.get(k), getattr(base, k)
        if mine is not None and glob % mine and mine % glob:
            raise ParallelPlanError(f"{key}.{k} = {mine} must divide {prefix}.{k} = {glob} or be a multiple of it "
                                    f"({glob} % {mine} = {glob % mine}, {mine} % {glob} = {mine % glob}): the "
                                    f"component's groups nest in the global layout's", key=f"{key}.{k}")


def _resolve_components(base: ParallelPlan, components: dict[str, dict], *, prefix: str) -> dict[str, ParallelPlan]:
    """Components either share all ranks with their own tp/pp/cp (colocated grids) or take disjoint rank
    ranges (``num_ranks``), in declaration order; disjoint ranges must cover the world exactly."""
    out: dict[str, ParallelPlan] = {}
    for name, cfg in components.items():
        _check_component(base, name, dict(cfg), prefix=prefix)
    disjoint = {n: c.get("num_ranks") for n, c in components.items() if c.get("num_ranks") is not None}
    if disjoint and len(disjoint) != len(components):
        missing = sorted(set(components) - set(disjoint))
        raise ParallelPlanError(
            f"{prefix}.components: either every component sets num_ranks or none does (missing on {missing})"
        )
    if disjoint:
        total = sum(disjoint.values())
        if total != base.world_size:
            parts = " + ".join(f"{n}={r}" for n, r in disjoint.items())
            raise ParallelPlanError(f"{prefix}.components num_ranks {parts} = {total} != world size {base.world_size}")
    first = 0
    for name, cfg in components.items():
        cfg = dict(cfg)
        num_ranks = cfg.pop("num_ranks", None)
        decoupled = bool(cfg.pop("decoupled", None))
        merged = {
            "tp": base.tp,
            "pp": base.pp,
            "cp": base.cp,
            "ep": base.ep,
            "vpp": base.vpp if cfg.get("pp", base.pp) > 1 else None,
            "sp": base.sp if cfg.get("tp", base.tp) > 1 else False,
            "recompute": base.recompute,
            "distributed_optimizer": base.distributed_optimizer,
        }
        merged.update({k: v for k, v in cfg.items() if v is not None})
        sub = resolve_plan(world_size=num_ranks or base.world_size, prefix=f"{prefix}.components.{name}", **merged)
        out[name] = replace(sub, first_rank=first, decoupled=decoupled)
        if num_ranks:
            first += num_ranks
    return out
