"""The recipe schema: typed, validated sections of a LoongForge recipe (pydantic v2).

NOTE: pydantic rather than dataclasses + OmegaConf: we need strict validation with the *key path* of every
error (``loc``), unknown-key rejection (``extra="forbid"``), literal choices, numeric ranges and defaults that
can be printed — all first-class in pydantic, and one system for core and backends alike. YAML merging
(``extends:``) and ``a.b.c=value`` overrides are done on plain dicts before validation (see ``loader.py``).

The ``model`` and ``data`` sections belong to the backend: each Backend declares a pydantic class for them and
the loader validates them once the backend is known.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationInfo,
    field_validator,
    model_validator,
)

SECTIONS = ("backend", "model", "data", "parallel", "train", "checkpoint", "accelerator", "kernels", "logging")


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, assignments are validated."""

    # NOTE: allow_inf_nan=False: ``lr: inf`` (or ``1e400``, which YAML reads as a string that parses to inf) is an
    # error naming the key, not a run that goes NaN at its first step.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        """``steps: true`` is an error, not one step.

        NOTE: pydantic's lax mode reads a bool as 1 / 0 for an int or float field; YAML's ``true`` / ``yes`` then
        silently becomes a count."""
        if isinstance(value, bool) and info.field_name is not None:
            kinds = _scalar_types(cls.model_fields[info.field_name].annotation)
            if bool not in kinds and kinds & {int, float}:
                raise ValueError(f"expected a number, got the boolean {str(value).lower()}")
        return value


def _scalar_types(annotation: Any) -> set[Any]:
    """The plain types a field's annotation admits at its top level (through ``X | None`` unions)."""
    import types
    import typing

    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return {t for arg in typing.get_args(annotation) for t in _scalar_types(arg)}
    return {annotation}


class ComponentParallel(Section):
    """Per-component override of the global layout (e.g. ``parallel.components.vision``)."""

    tp: int | None = Field(None, ge=1, description="this component's tensor parallel size (default: the global one)")
    pp: int | None = Field(None, ge=1, description="this component's pipeline parallel size")
    vpp: int | None = Field(None, ge=1, description="this component's virtual pipeline chunks")
    cp: int | None = Field(None, ge=1, description="this component's context parallel size")
    ep: int | None = Field(None, ge=1, description="this component's expert parallel size")
    etp: int | None = Field(None, ge=1, description="this component's expert tensor parallel size")
    sp: bool | None = Field(None, description="this component's sequence parallelism")
    recompute: Literal["none", "selective", "full"] | None = Field(None, description="this component's recompute")
    num_ranks: int | None = Field(None, ge=1, description="disjoint ranks for this component (decoupled grid)")
    decoupled: bool | None = Field(
        None, description="run this component (an encoder) outside the pipeline schedule: every micro-batch of a step "
        "encoded before it, the gradients taken after it (needs pp > 1)")


class ParallelConfig(Section):
    """Parallel layout. ``dp`` is derived from the world size; set it only to assert it. A backend adds its own
    keys by subclassing (``Backend.parallel_schema``; e.g. the embodied backend's ``strategy``)."""

    tp: int = Field(1, ge=1, description="tensor parallel size")
    pp: int = Field(1, ge=1, description="pipeline parallel size")
    vpp: int | None = Field(None, ge=1, description="virtual pipeline chunks per pipeline rank (interleaved 1F1B)")
    first_stage_layers: int | None = Field(
        None, ge=1, description="uneven pipeline split: decoder layers on the first stage (the rest split evenly)"
    )
    last_stage_layers: int | None = Field(None, ge=1, description="uneven pipeline split: decoder layers on the last stage")
    cp: int = Field(1, ge=1, description="context parallel size")
    ep: int = Field(1, ge=1, description="expert parallel size")
    etp: int | None = Field(None, ge=1, description="expert tensor parallel size (default: tp)")
    dp: int | None = Field(None, ge=1, description="data parallel size (derived: world / (tp*pp*cp))")
    sp: bool = Field(False, description="sequence parallel (needs tp > 1)")
    distributed_optimizer: bool = Field(False, description="shard optimizer state across dp (ZeRO-1)")
    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="activation recomputation: none, selective (attention core) or full (whole layers)")
    recompute_layers: int | None = Field(None, ge=1, description="layers per recompute unit (full recompute)")
    components: dict[str, ComponentParallel] = Field(
        default_factory=dict, description="per-component layouts by component name (e.g. vision, projector, language)")

    def plan(self, world_size: int):
        """Resolve against ``world_size`` into a validated ``ParallelPlan``."""
        from loongforge.parallel import resolve_plan

        comps = {k: v.model_dump(exclude_none=True) for k, v in self.components.items()}
        fields = self.model_dump(exclude={"components"})
        return resolve_plan(world_size=world_size, components=comps or None, **fields)

    def min_world_size(self) -> int:
        """The smallest world size this layout is valid for (dp as given, else the smallest that works)."""
        from loongforge.errors import ParallelPlanError

        base = self.tp * self.pp * self.cp
        if self.dp is not None:
            return base * self.dp
        for dp in range(1, 4097):
            try:
                self.plan(base * dp)
                return base * dp
            except ParallelPlanError:
                continue
        return base


class LoraConfig(Section):
    """Low-rank adapters on the named linear layers; the base model is frozen."""

    rank: int = Field(8, ge=1, description="rank of the adapters")
    alpha: float = Field(16.0, gt=0, description="scale numerator: the update is (alpha / rank) * B @ A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    targets: list[Literal["qkv", "proj", "fc1", "fc2"]] = Field(
        default_factory=lambda: ["qkv", "proj", "fc1", "fc2"], description="the linear layers that get adapters")


class Fp8Config(Section):
    """FP8 GEMMs with current scaling (no TransformerEngine): the decoder's linears; CUDA, compute capability >= 8.9."""

    recipe: Literal["tensorwise", "rowwise", "blockwise"] = Field(
        "tensorwise", description="scales per tensor, per row, or DeepSeek-V3 blocks (1x128 activations / 128x128 weights)")
    grad_dtype: Literal["e4m3", "e5m2"] = Field("e4m3", description="FP8 format of the gradients (forward is E4M3)")
    policy: str | None = Field(None, description="policy file of 'loongforge fp8 profile': FP8 only for the GEMMs it "
                               "measured faster; default every GEMM in FP8")
    output_layer: bool = Field(False, description="the output layer's GEMMs in FP8 too (default bf16; megatron's "
                               "loongforge spec refuses it: its fused linear cross-entropy runs them in bf16)")
    experts: bool = Field(False, description="MoE grouped experts' GEMMs in FP8 too (rowwise scaled_grouped_mm, "
                          "Hopper; default bf16: slower than bf16 grouped_mm at Qwen3-30B-A3B's shape on H200)")

    @model_validator(mode="after")
    def _check(self) -> Fp8Config:
        if self.recipe == "blockwise" and self.grad_dtype != "e4m3":
            raise ValueError("blockwise takes grad_dtype e4m3 (the blockwise GEMMs are E4M3 only)")
        return self


class TrainConfig(Section):
    """Optimisation. The global batch is fixed by the recipe; more processes split it."""

    stage: Literal["pretrain", "cpt", "sft", "lora"] = Field(
        "pretrain", description="pretrain (random init), cpt (continue from checkpoint.load), sft (instruction data), "
        "lora (adapters only)")
    steps: int = Field(100, ge=1, description="optimizer steps of the run")
    global_batch_size: int = Field(8, ge=1, description="samples per optimizer step, over all data-parallel ranks")
    micro_batch_size: int = Field(1, ge=1, description="samples per forward / backward on one rank")
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="the optimizer")
    lr: float = Field(3e-4, gt=0, description="peak learning rate")
    min_lr: float = Field(0.0, ge=0, description="learning rate at the end of the decay")
    lr_schedule: Literal["constant", "linear", "cosine", "wsd"] = Field(
        "cosine", description="decay after warm-up: constant, linear, cosine, or warmup-stable-decay")
    warmup_steps: int = Field(0, ge=0, description="steps of linear warm-up from 0 to lr")
    decay_steps: int | None = Field(None, ge=1, description="default: train.steps")
    wsd_decay_steps: int | None = Field(None, ge=1, description="wsd: length of the final decay phase")
    weight_decay: float = Field(0.01, ge=0, description="decoupled weight decay (AdamW)")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="Adam's first-moment decay")
    adam_beta2: float = Field(0.95, ge=0, lt=1, description="Adam's second-moment decay")
    adam_eps: float = Field(1e-8, gt=0, description="Adam's epsilon")
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 disables")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto: bf16 where the accelerator supports it (not on CPU), else fp32"
    )
    seed: int = Field(1234, ge=0, description="seed of the initialisation, data order and dropout")
    eval_interval: int | None = Field(None, ge=1, description="steps between evaluations (default: none)")
    eval_steps: int = Field(1, ge=1, le=10_000, description="batches (episodes for a policy) per evaluation; at "
                            "most 10000")
    lora: LoraConfig | None = Field(None, description="LoRA adapters (train.stage lora; defaults filled in then)")
    freeze: list[str] = Field(default_factory=list, description="parameters kept as they are (no gradient, no "
                              "optimizer state): module groups of the model (a VLM's vision, projector, language) or "
                              "parameter-name globs such as 'decoder.layers.0.*'")
    fp8: Fp8Config | None = Field(None, description="FP8 GEMMs (CUDA, compute capability >= 8.9); default bf16")
    compile: bool = Field(False, description="torch.compile the model: per wrap unit (embodied), per transformer layer (megatron DiT)")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile's mode with train.compile; reduce-overhead replays CUDA graphs"
    )
    skip_nonfinite: bool = Field(
        False, description="a step whose loss or grad norm is NaN / inf: false stops the run naming the step; true "
        "skips that step's update (weights and optimizer state unchanged) and counts it in the skipped_nonfinite metric")
    ema_decay: float | None = Field(
        None, gt=0, lt=1, description="keep an EMA of the weights (saved with checkpoints; the HF export writes it)"
    )

    @field_validator("lora")
    @classmethod
    def _lora_needs_its_stage(cls, v: LoraConfig | None, info: ValidationInfo) -> LoraConfig | None:
        # NOTE: adapters are trained only by stage lora (which takes any data format, sft included); under
        # another stage the section would be silently ignored and the whole model trained
        stage = info.data.get("stage")
        if v is not None and stage is not None and stage != "lora":
            raise ValueError(f"LoRA adapters are trained by train.stage lora only (got stage '{stage}'); set "
                             "train.stage lora (LoRA SFT: stage lora with SFT data) or remove train.lora")
        return v

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of micro_batch_size ({self.micro_batch_size})"
            )
        if self.compile_mode != "default" and not self.compile:
            raise ValueError(f"compile_mode {self.compile_mode!r} needs compile: true")
        decay = self.decay_steps or self.steps
        if self.warmup_steps and self.warmup_steps >= decay:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be less than decay_steps/steps ({decay})")
        if self.stage == "lora" and self.lora is None:
            self.lora = LoraConfig()
        return self


class CheckpointConfig(Section):
    """Where weights come from and how the run saves. ``load`` is an HF model directory (a run's own checkpoints
    resume through ``resume``; the embodied backend starts from ``model.load`` instead)."""

    load: str | None = Field(None, description="HF model dir to start from (e.g. a run's OUTPUT/hf export)")
    resume: Literal["auto", "never"] = Field("auto", description="auto: resume from OUTPUT/checkpoints/latest if present")
    save_interval: int | None = Field(None, ge=1, description="steps between checkpoints (default: only at the end)")
    save_format: list[Literal["dist", "hf", "peft"]] = Field(
        default_factory=lambda: ["dist"],
        description="dist: resumable checkpoint; hf: HF export (LoRA merged); peft: LoRA adapters in PEFT format")
    keep_last: int = Field(2, ge=1, description="resumable checkpoints kept (older ones are deleted)")
    save_at_end: bool = Field(True, description="save (and export the formats of save_format) after the last step")


class AcceleratorConfig(Section):
    """``name``: auto | cpu | cuda | a plugin's name. ``env`` is exported before the device is touched."""

    name: str = Field("auto", description="auto (cuda if present, else cpu), cpu, cuda, or a plugin's name")
    env: dict[str, str] = Field(default_factory=dict, description="environment variables set before the device is "
                                "touched")
    options: dict[str, Any] = Field(default_factory=dict, description="the accelerator plugin's own options")

    @field_validator("env", mode="before")
    @classmethod
    def _stringify(cls, v: Any) -> Any:
        if isinstance(v, dict):
            blank = [k for k, x in v.items() if x is None]
            if blank:
                # NOTE: str(None) would export the literal "None" into the environment
                raise ValueError(f"{blank[0]} has no value: give one (quote an empty string as '')")
            return {k: (str(x).lower() if isinstance(x, bool) else str(x)) for k, x in v.items()}
        return v


class KernelsConfig(Section):
    """Kernel selection through the core's provider registry. A backend adds its own keys by subclassing
    (``Backend.kernels_schema``; e.g. the megatron backend's layer ``spec``)."""

    provider: str = Field("auto", description="auto | torch | triton | tilelang | a plugin's provider")


class LoggingConfig(Section):
    interval: int = Field(1, ge=1, description="steps between logged metrics")
    console: bool = Field(True, description="progress lines on the console (rank 0)")
    tensorboard: bool = Field(True, description="TensorBoard events in OUTPUT/tensorboard")
    jsonl: bool = Field(True, description="metrics as JSON lines in OUTPUT/metrics.jsonl")
    moe_trace: bool = Field(False, description="MoE models: record every step's per-layer expert loads to "
                                               "moe_trace.jsonl in the run directory (for `loongforge moe simulate`)")


class Recipe(Section):
    """A whole recipe. ``model``/``data`` hold the backend's validated section objects."""

    description: str = Field("", description="what the recipe trains (shown by `loongforge recipes`)")
    backend: str = Field(description="the backend that runs it: megatron, embodied, or a plugin's")
    model: Any = None
    data: Any = None
    # NOTE: SerializeAsAny: a backend's subclass (its own keys) is dumped whole into the run's recipe.yaml
    parallel: SerializeAsAny[ParallelConfig] = Field(default_factory=ParallelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    accelerator: AcceleratorConfig = Field(default_factory=AcceleratorConfig)
    kernels: SerializeAsAny[KernelsConfig] = Field(default_factory=KernelsConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @field_validator("accelerator", mode="before")
    @classmethod
    def _accelerator_shorthand(cls, v: Any) -> Any:
        return {"name": v} if isinstance(v, str) else v

    def to_dict(self) -> dict[str, Any]:
        """The fully resolved recipe as plain data (what ``recipe.yaml`` in a run directory holds)."""
        return self.model_dump(mode="json")
