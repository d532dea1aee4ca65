"""The ``megatron`` backend: language models on megatron-core (registered in ``loongforge.backends``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loongforge.backend import Backend, Job
from loongforge.errors import CheckpointError, RecipeError
from pydantic import ValidationError

from loongforge_megatron.config import DataConfig, MegatronKernelsConfig, ModelConfig, data_formats, spec_for
from loongforge_megatron.models import registry
from loongforge_megatron.models.spec import PARALLEL_DIMS

if TYPE_CHECKING:
    from loongforge.recipe.schema import Recipe
    from loongforge.runtime import Runtime


def _not_no_cuda_notice(record: logging.LogRecord) -> bool:
    return "No CUDA runtime is found" not in record.getMessage()


def _check_format(fmt: Any) -> None:
    formats = data_formats()
    if isinstance(fmt, str) and fmt not in formats:  # NOTE: not a string: the section's validation names the type
        import difflib

        close = difflib.get_close_matches(str(fmt), formats, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise RecipeError(f"unknown format '{fmt}'; {hint}the installed model kinds train on {', '.join(formats)}",
                          key="data.format")


def check_format(spec: Any, fmt: str) -> None:
    """``data.format`` must be one the model kind trains on (the kinds that do are named)."""
    can = spec.supports
    if fmt not in can.data_formats:
        others = sorted({s.supports.models for s in registry.all_specs().values() if fmt in s.supports.data_formats})
        which = f": that one is for {' and '.join(others)}" if others else ""
        raise RecipeError(f"{can.models} train on data.format {' or '.join(can.data_formats)} (got '{fmt}'{which})",
                          key="data.format")


def check_supports(recipe: Recipe, plan: Any, spec: Any) -> None:
    """What the model kind's :class:`~loongforge_megatron.models.spec.Supports` declares, checked the same way for
    every kind: the stage, the data format, the parallel dimensions and the layer set."""
    can, models = spec.supports, spec.supports.models
    if recipe.train.stage not in can.stages:
        raise RecipeError(f"{models} support train.stage {' / '.join(can.stages)} (got '{recipe.train.stage}')",
                          key="train.stage")
    check_format(spec, recipe.data.format)
    used = {"tp": plan.tp > 1, "sp": plan.sp, "cp": plan.cp > 1, "pp": plan.pp > 1, "vpp": plan.vpp > 1,
            "ep": plan.ep > 1, "etp": recipe.parallel.etp not in (None, 1, plan.tp),
            "components": bool(recipe.parallel.components)}
    for dim, on in used.items():
        if on and dim not in can.parallel:
            allowed = ", ".join(PARALLEL_DIMS[d] for d in can.parallel if d in PARALLEL_DIMS)
            got = "" if dim in ("sp", "components") else f" {getattr(plan, dim)}"
            raise RecipeError(f"{models} train with {allowed + ' and ' if allowed else ''}data parallelism only "
                              f"(got {PARALLEL_DIMS[dim]} parallelism{got})", key=f"parallel.{dim}")
    if recipe.kernels.layers not in can.layers:
        raise RecipeError(f"{models} build on kernels.layers {', '.join(can.layers)}, not {recipe.kernels.layers}",
                          key="kernels.layers")


class MegatronBackend(Backend):
    """Pretrain / CPT / SFT / LoRA with megatron-core's models / layers, schedules, DDP and optimizer, of every model
    family registered under ``loongforge.megatron.models`` (the backend ships its own through the same group)."""

    name = "megatron"
    model_schema = ModelConfig
    data_schema = DataConfig
    kernels_schema = MegatronKernelsConfig

    @classmethod
    def section_schema(cls, section: str, *, raw: dict[str, Any], recipe: Recipe) -> type | None:
        """``model`` / ``data``: the section of the recipe's model kind (its spec's ``model_section`` /
        ``data_section``: the shared keys plus its own). A key only another kind declares is refused naming it."""
        if section not in ("model", "data"):
            return getattr(cls, f"{section}_schema", None)
        raw_model = raw if section == "model" else recipe.model.model_dump(exclude_none=True)
        spec = spec_for(raw_model, explain=section == "model")
        if spec is None:
            return getattr(cls, f"{section}_schema")
        schema = getattr(spec, f"{section}_section")
        if section == "data":
            fmt = raw.get("format", schema.model_fields["format"].default)
            _check_format(fmt)
            if isinstance(fmt, str):
                check_format(spec, fmt)
        for key in raw:
            if key in schema.model_fields:
                continue
            owners = sorted(s.name for s in registry.all_specs().values()
                            if key in getattr(s, f"{section}_section").model_fields)
            if owners:
                raise RecipeError(f"a key of the {', '.join(owners)} model famil{'ies' if len(owners) > 1 else 'y'}, "
                                  f"not of {spec.name}: remove it", key=f"{section}.{key}")
        return schema

    @classmethod
    def recipe_schemas(cls) -> dict[str, type]:
        """The shared sections, then each model kind's own ``model`` / ``data`` section where it adds keys (titled
        by the kind, e.g. ``"data (a vision-language model)"``: the keys it adds over the shared ones are listed under it)."""
        out = super().recipe_schemas()
        for _name, spec in sorted(registry.all_specs().items()):
            for section in ("model", "data"):
                schema = getattr(spec, f"{section}_section")
                if schema is not out[section] and f"{section} ({spec.kind})" not in out:
                    out[f"{section} ({spec.kind})"] = schema
        return out

    @classmethod
    def check_recipe(cls, recipe: Recipe) -> None:
        stage, data = recipe.train.stage, recipe.data
        sft = spec_for(recipe.model.model_dump(exclude_none=True))
        sft = sft.supports.sft_formats if sft is not None else ("sft",)
        if stage == "sft" and data.format not in sft:
            want = " or ".join(f"'{f}'" for f in sft) or "none: this model has no SFT stage"
            raise RecipeError(f"train.stage 'sft' needs data.format {want} (got '{data.format}')", key="data.format")
        if stage == "cpt" and not recipe.checkpoint.load:
            raise RecipeError("train.stage 'cpt' continues from a checkpoint: set checkpoint.load (HF dir)", key="checkpoint.load")
        if "peft" in recipe.checkpoint.save_format and stage != "lora":
            raise RecipeError(f"save_format 'peft' exports LoRA adapters; train.stage is '{stage}'", key="checkpoint.save_format")
        if recipe.train.eval_interval and data.format == "sft":
            raise RecipeError("SFT data has no validation split yet; remove train.eval_interval", key="train.eval_interval")
        if recipe.parallel.cp > 1 and recipe.kernels.layers == "local":
            raise RecipeError("context parallelism needs the loongforge or te layers (megatron's local attention "
                              "refuses cp > 1)", key="kernels.layers")

    def validate(self, recipe: Recipe, *, world_size: int) -> None:
        from loongforge_megatron.engine.encoder_ranks import language_plan

        full = recipe.parallel.plan(world_size)
        plan = language_plan(full)  # NOTE: an encoder on ranks of its own: the spec checks its ranks (full)
        try:
            spec, arch = recipe.model.resolve()
        except (ValueError, TypeError) as exc:
            errors = exc.errors() if isinstance(exc, ValidationError) else None  # NOTE: its first line only counts
            detail = f"{errors[0]['msg'].removeprefix('Value error, ')}" if errors else str(exc)
            raise RecipeError(f"invalid architecture: {detail}".splitlines()[0], key="model") from None
        plan.check_model(num_layers=arch.num_layers, num_attention_heads=arch.num_attention_heads,
                         num_query_groups=arch.kv_heads, num_experts=arch.num_experts,
                         seq_length=getattr(arch, "num_patches", None) or recipe.data.seq_length)
        plan.grad_accumulation(global_batch_size=recipe.train.global_batch_size, micro_batch_size=recipe.train.micro_batch_size)
        if plan.vpp > 1 and plan.grad_accumulation(global_batch_size=recipe.train.global_batch_size,
                                                   micro_batch_size=recipe.train.micro_batch_size) % plan.pp:
            raise RecipeError(
                f"interleaved pipeline (vpp = {plan.vpp}) needs micro-batches per step divisible by pp = {plan.pp}",
                key="train.global_batch_size",
            )
        self._check_compile(recipe)
        self._check_fp8(recipe)
        from loongforge_megatron.freeze import check_freeze, parameter_names

        if recipe.train.freeze:
            check_freeze(recipe.train.freeze, groups=getattr(spec, "groups", {}), stage=recipe.train.stage,
                         names=parameter_names(spec, arch))
        check_supports(recipe, plan, spec)
        from loongforge_megatron.layers.selection import check_moe_runtime

        check_moe_runtime(recipe, arch, plan)
        spec.check(recipe, full, arch)
        load = recipe.checkpoint.load
        if load and (Path(load) / "config.json").is_file():
            from loongforge_megatron.conversion.config_check import check_hf_checkpoint

            try:
                check_hf_checkpoint(load)
            except CheckpointError as exc:
                raise RecipeError(str(exc), key="checkpoint.load") from None

    def resolved(self, recipe: Recipe) -> dict[str, Any]:
        """The recipe with ``model``'s architecture keys set to what the preset / HF config (and the recipe's own
        overrides) give; keys that do not apply to this model (MoE keys of a dense one) are left out, not shown
        null. The result validates back into the same architecture."""
        from loongforge_megatron.config import arch_keys

        data = recipe.to_dict()
        arch, model = recipe.model.arch(), data["model"]
        fields = type(arch).model_fields
        derived = arch.derived() if hasattr(arch, "derived") else {}
        for key in arch_keys(type(recipe.model)):
            value = getattr(arch, key) if key in fields else None
            value = derived.get(key) if value is None else value
            if value is None or ((key == "num_experts" or key.startswith("moe_")) and not arch.is_moe):
                model.pop(key)
            else:
                model[key] = value
        model["family"] = arch.family
        return data

    @staticmethod
    def _check_compile(recipe: Recipe) -> None:
        """``train.compile`` settings no model can use here (whether the model compiles at all is its spec's)."""
        t = recipe.train
        if t.compile_mode in ("reduce-overhead", "max-autotune"):
            raise RecipeError(f"compile_mode {t.compile_mode} replays CUDA graphs, which megatron's DDP buffers and "
                              "schedules are not set up for here; use default or max-autotune-no-cudagraphs",
                              key="train.compile_mode")
        if t.compile and recipe.kernels.grad_accum_fusion:
            # NOTE: megatron's linear backward adds into weight.main_grad, a tensor outside the compiled graph: dynamo
            # breaks the graph at every linear (a 28-layer diffusion transformer on an H200 ran 0.60x of train.compile alone)
            raise RecipeError("kernels.grad_accum_fusion cannot be used with train.compile: megatron's linear backward "
                              "writes the fp32 main_grad outside the compiled graph, which breaks it at every linear "
                              "(0.60x measured); use one of them", key="kernels.grad_accum_fusion")

    @staticmethod
    def _check_fp8(recipe: Recipe) -> None:
        """``train.fp8`` settings no model can run here; whether this machine has FP8 GEMMs is the build's check."""
        t = recipe.train
        if t.fp8 is None:
            return
        if recipe.kernels.layers == "te":
            raise RecipeError("train.fp8 runs on kernels.layers loongforge or local (kernels.layers te has "
                              "TransformerEngine's own FP8, not wired here); use one of them", key="train.fp8")
        if t.compile:
            raise RecipeError("train.fp8 cannot be used with train.compile yet (the FP8 linears launch Triton kernels "
                              "from an autograd function); use one of them", key="train.fp8")
        if t.fp8.policy:
            from loongforge_megatron.fp8_policy import load_policy

            load_policy(t.fp8.policy)

    def build(self, recipe: Recipe, runtime: Runtime) -> Job:
        import warnings

        if recipe.checkpoint.load and not Path(recipe.checkpoint.load).exists():
            raise RecipeError(f"'{recipe.checkpoint.load}' does not exist", key="checkpoint.load")

        # NOTE: megatron-core warns at import about missing TransformerEngine / Apex; we run without them on
        # purpose (the loongforge / local specs), so keep the console readable.
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron(\.|$)")
        warnings.filterwarnings("ignore", category=SyntaxWarning)
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"megatron(\.|$)")
        # NOTE: megatron imports torch.utils.cpp_extension, which warns on CPU-only hosts that it found no CUDA.
        logging.getLogger("torch.utils.cpp_extension").addFilter(_not_no_cuda_notice)
        from loongforge_megatron.job import MegatronJob

        return MegatronJob(recipe, runtime)

    def prepare_data(self, recipe: Recipe, *, force: bool = False) -> Path:
        from loongforge_megatron.data.prepare import prepare

        if recipe.data.format not in ("pretrain", "sft"):
            # NOTE: a model kind with a data format of its own prepares it (its spec); the rest need no preparation
            own = getattr(recipe.model.spec(), "prepare_data", None)
            path = own(recipe, force=force) if own is not None else None
            if path is not None:
                return path
        return prepare(recipe, force=force)

    def convert(self, src: str, dst: str, *, to: str, **layout: Any) -> None:
        from loongforge.errors import CheckpointError

        from loongforge_megatron.conversion import hf_to_megatron, megatron_to_hf, reshard
        from loongforge_megatron.conversion.layout import LAYOUT_FILE

        force = layout.pop("force", False)
        fp8 = layout.pop("fp8", False)
        dequantize_dtype = layout.pop("dequantize_dtype", None)
        etp = layout.pop("etp", None) or layout["tp"]
        if fp8 and to != "hf":
            raise CheckpointError("--fp8 applies to --to hf (an FP8 source is dequantized by --to megatron as it is "
                                  "read)")
        if dequantize_dtype is not None and (to != "megatron" or not (Path(src) / "config.json").exists()):
            raise CheckpointError("--dequantize-dtype applies to --to megatron from an HF directory")
        if to == "hf":
            split = [k for k in ("first_stage_layers", "last_stage_layers") if layout.get(k) is not None]
            if split:
                raise CheckpointError(f"--{split[0].replace('_', '-')} applies to --to megatron; with --to hf the "
                                      f"source's {LAYOUT_FILE} says how it was split")
            megatron_to_hf(src, dst, force=force, fp8=fp8)
        elif (Path(src) / "config.json").exists():  # NOTE: a FIFO or folder there is refused naming it
            import torch

            dtype = getattr(torch, dequantize_dtype) if dequantize_dtype is not None else None
            hf_to_megatron(src, dst, etp=etp, force=force, dequantize_dtype=dtype, **layout)
        else:
            reshard(src, dst, etp=etp, force=force, **layout)

    def place_experts(self, src: str, dst: str, *, loads: str, ep: int, force: bool = False) -> dict:
        from loongforge_megatron.moe_placement import rebalance_hf

        return rebalance_hf(src, dst, loads=loads, ep=ep, force=force)
