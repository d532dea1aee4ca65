"""The ``megatron`` backend: language models on megatron-core (registered in ``loongforge.backends``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loongforge.backend import Backend, Job
from loongforge.errors import RecipeError
from pydantic import ValidationError

from loongforge_megatron.config import DataConfig, MegatronKernelsConfig, ModelConfig

if TYPE_CHECKING:
    from loongforge.recipe.schema import Recipe
    from loongforge.runtime import Runtime


def _not_no_cuda_notice(record: logging.LogRecord) -> bool:
    return "No CUDA runtime is found" not in record.getMessage()


def te_incompatible(recipe: Recipe) -> str:
    """What in ``recipe`` needs the local / loongforge layer names or masks ("" when TransformerEngine's spec fits)."""
    c = recipe.checkpoint
    needs = [what for what, on in (("checkpoint.load (HF weights)", bool(c.load)),
                                   ("an HF / PEFT export", bool({"hf", "peft"} & set(c.save_format))),
                                   ("data.format sft (packed sequences)", recipe.data.format == "sft")) if on]
    return ", ".join(needs)


class MegatronBackend(Backend):
    """Pretrain / CPT / SFT / LoRA of decoder-only LMs, LLaVA VLMs and class-conditional DiTs with megatron-core's
    models / layers, schedules, DDP and optimizer."""

    name = "megatron"
    model_schema = ModelConfig
    data_schema = DataConfig
    kernels_schema = MegatronKernelsConfig

    @classmethod
    def check_recipe(cls, recipe: Recipe) -> None:
        stage, data = recipe.train.stage, recipe.data
        if stage == "sft" and data.format != "sft":
            raise RecipeError(f"train.stage 'sft' needs data.format 'sft' (got '{data.format}')", key="data.format")
        if stage == "cpt" and not recipe.checkpoint.load:
            raise RecipeError("train.stage 'cpt' continues from a checkpoint: set checkpoint.load (HF dir)", key="checkpoint.load")
        if "peft" in recipe.checkpoint.save_format and stage != "lora":
            raise RecipeError(f"save_format 'peft' exports LoRA adapters; train.stage is '{stage}'", key="checkpoint.save_format")
        if recipe.train.eval_interval and data.format == "sft":
            raise RecipeError("SFT data has no validation split yet; remove train.eval_interval", key="train.eval_interval")
        if recipe.parallel.cp > 1 and recipe.kernels.spec == "local":
            raise RecipeError("context parallelism needs the loongforge or te spec (megatron's local attention "
                              "refuses cp > 1)", key="kernels.spec")
        if recipe.parallel.cp > 1 and recipe.data.format == "sft":
            raise RecipeError("packed SFT uses block-diagonal attention masks, which context parallelism does not "
                              "support yet; use cp: 1 for sft", key="parallel.cp")

    def validate(self, recipe: Recipe, *, world_size: int) -> None:
        plan = recipe.parallel.plan(world_size)
        try:
            arch = recipe.model.arch()
        except (ValueError, TypeError) as exc:
            errors = exc.errors() if isinstance(exc, ValidationError) else None  # NOTE: its first line only counts
            detail = f"{errors[0]['msg'].removeprefix('Value error, ')}" if errors else str(exc)
            raise RecipeError(f"invalid architecture: {detail}".splitlines()[0], key="model") from None
        plan.check_model(num_layers=arch.num_layers, num_attention_heads=arch.num_attention_heads,
                         num_query_groups=arch.kv_heads, num_experts=arch.num_experts,
                         seq_length=arch.num_patches if arch.is_dit else recipe.data.seq_length)
        plan.grad_accumulation(global_batch_size=recipe.train.global_batch_size, micro_batch_size=recipe.train.micro_batch_size)
        if plan.vpp > 1 and plan.grad_accumulation(global_batch_size=recipe.train.global_batch_size,
                                                   micro_batch_size=recipe.train.micro_batch_size) % plan.pp:
            raise RecipeError(
                f"interleaved pipeline (vpp = {plan.vpp}) needs micro-batches per step divisible by pp = {plan.pp}",
                key="train.global_batch_size",
            )
        self._check_provider(recipe, arch)
        self._check_compile(recipe, arch)
        self._check_components(recipe, plan, arch)
        if arch.is_dit:
            self._check_dit(recipe, plan, arch)
            return
        dit_only = "model.vae" if recipe.model.vae else "data.format" if recipe.data.format == "latents" else None
        if dit_only:
            raise RecipeError(f"{dit_only} is for DiT models (e.g. model.preset dit-tiny or model.hf of a diffusers "
                              "DiTTransformer2DModel)", key=dit_only)
        if arch.is_vlm:
            self._check_vlm(recipe, plan, arch)
        elif recipe.data.format == "llava":
            raise RecipeError("data.format llava (image-text conversations) needs a LLaVA model (e.g. model.preset "
                              "llava-tiny or model.hf of a LLaVA checkpoint)", key="data.format")
        self._check_llm(recipe, plan, arch)
        if recipe.data.seq_length > arch.max_position_embeddings:
            raise RecipeError(f"seq_length {recipe.data.seq_length} exceeds the model's max_position_embeddings "
                              f"{arch.max_position_embeddings}", key="data.seq_length")
        if arch.sliding_window and recipe.data.seq_length > arch.sliding_window:
            # NOTE: the HF model attends only to the last sliding_window tokens; megatron here to all of them
            raise RecipeError(f"the HF config's sliding-window attention (sliding_window {arch.sliding_window}) is "
                              f"not applied by this backend (megatron attends over the whole sequence): seq_length "
                              f"{recipe.data.seq_length} would train attention the model does not have; set "
                              f"data.seq_length <= {arch.sliding_window}", key="data.seq_length")

    def resolved(self, recipe: Recipe) -> dict[str, Any]:
        """The recipe with ``model``'s architecture keys set to what the preset / HF config (and the recipe's own
        overrides) give; keys that do not apply to this model (MoE keys of a dense one, DiT keys of an LM) are left
        out, not shown null. The result validates back into the same architecture."""
        from loongforge_megatron.config import arch_keys

        data = recipe.to_dict()
        arch, model = recipe.model.arch(), data["model"]
        derived = {} if arch.is_dit else {"num_query_groups": arch.kv_heads,
                                          "head_dim": None if arch.is_mla else arch.kv_channels}
        for key in arch_keys():
            value = getattr(arch, key) if key in type(arch).model_fields else None
            value = derived.get(key) if value is None else value
            if value is None or ((key == "num_experts" or key.startswith("moe_")) and not arch.is_moe):
                model.pop(key)
            else:
                model[key] = value
        model["family"] = arch.family
        return data

    @staticmethod
    def _check_llm(recipe: Recipe, plan: Any, arch: Any) -> None:
        """Settings megatron or the HF mapping would only refuse mid-run (or get silently wrong)."""
        if arch.qkv_bias and arch.family in ("llama", "qwen3", "qwen3_moe"):
            # NOTE: megatron's add_qkv_bias biases q/k/v only; HF's attention_bias for these families also biases
            # o_proj, so the export would drop (qwen3) or refuse (llama) the trained biases
            raise RecipeError(f"q/k/v-only biases have no HF layout for {arch.family} (its attention_bias also biases "
                              "o_proj); leave qkv_bias unset, or use a qwen2 model", key="model.qkv_bias")
        if arch.is_moe and plan.tp > 1 and not plan.sp:
            raise RecipeError(f"MoE layers under tensor parallelism (tp {plan.tp}) need sequence parallelism (megatron "
                              "refuses at the first forward): set parallel.sp true", key="parallel.sp")
        lora = recipe.train.lora if recipe.train.stage == "lora" else None
        if lora is not None and arch.is_moe and plan.ep > 1 and {"fc1", "fc2"} & set(lora.targets):
            # NOTE: the adapters' gradients would be averaged over the dense data-parallel group, which spans expert
            # ranks holding different experts: one adapter shared by different experts
            raise RecipeError(f"LoRA on MoE expert MLPs (fc1 / fc2) under expert parallelism (ep {plan.ep}) is not "
                              "supported; use train.lora.targets [qkv, proj], or ep 1", key="train.lora.targets")
        if recipe.kernels.moe_grouped_gemm and arch.is_moe:
            if lora is not None and {"fc1", "fc2"} & set(lora.targets):
                raise RecipeError("kernels.moe_grouped_gemm true cannot take LoRA adapters on the expert MLPs "
                                  "(fc1 / fc2 are wrapped per expert); leave it unset or false for LoRA",
                                  key="kernels.moe_grouped_gemm")
            if recipe.kernels.spec == "te":
                raise RecipeError("kernels.moe_grouped_gemm selects our grouped_mm experts of the loongforge / local "
                                  "spec; kernels.spec te uses TransformerEngine's own experts", key="kernels.moe_grouped_gemm")
        if arch.is_moe and arch.moe_token_dispatcher == "permute":
            why = ("ep > 1" if plan.ep > 1 else f"expert tp {plan.etp}" if plan.etp > 1 else
                   "moe_pad_to_capacity" if arch.moe_pad_to_capacity else
                   "kernels.moe_grouped_gemm false" if recipe.kernels.moe_grouped_gemm is False else
                   f"kernels.spec {recipe.kernels.spec}" if recipe.kernels.spec in ("te", "local") else None)
            if why:
                raise RecipeError(f"model.moe_token_dispatcher permute runs every expert on one rank, unpadded, with "
                                  f"grouped experts of the loongforge spec; this recipe has {why}: use alltoall",
                                  key="model.moe_token_dispatcher")
        hf_weights = [what for what, on in (("an HF export (checkpoint.save_format hf)", "hf" in recipe.checkpoint.save_format),
                                       ("HF weights (checkpoint.load)", bool(recipe.checkpoint.load))) if on]
        if arch.is_moe and plan.etp not in (1, plan.tp) and hf_weights:
            # NOTE: the HF mappings shard a routed expert over all TP ranks or none (etp = tp or 1)
            raise RecipeError(f"parallel.etp {plan.etp} with tp {plan.tp} has no HF layout for {' or '.join(hf_weights)}: "
                              "use etp 1 or etp = tp", key="parallel.etp")
        if recipe.train.fp8 is not None and recipe.train.fp8.policy:
            from loongforge_megatron.spec.fp8 import load_policy

            load_policy(recipe.train.fp8.policy)  # a missing or foreign file names train.fp8.policy
        te_needs = te_incompatible(recipe)
        if recipe.kernels.spec == "te" and te_needs:
            raise RecipeError(f"kernels.spec te cannot be used with {te_needs}: TransformerEngine's layers fold the norms "
                              "into the linears (other parameter names than the HF mappings know) and its causal "
                              "attention ignores packed-sequence masks; use kernels.spec loongforge", key="kernels.spec")

    @staticmethod
    def _check_components(recipe: Recipe, plan: Any, arch: Any) -> None:
        """``parallel.components``: LLaVA's ``vision`` (CLIP tower + projector) may be kept whole on every TP rank
        (``tp: 1``) under a language-model TP > 1; nothing else is per-component on this backend yet."""
        comps = recipe.parallel.components
        if not comps:
            return
        if not arch.is_vlm:
            raise RecipeError("parallel.components sets per-component layouts of VLMs; this model has one layout",
                              key="parallel.components")
        for name, comp in comps.items():
            if name != "vision":
                raise RecipeError(f"LLaVA has one separately laid-out component, 'vision' (got '{name}')",
                                  key=f"parallel.components.{name}")
            for key, value in comp.model_dump(exclude_none=True).items():
                if key != "tp":
                    raise RecipeError(f"only tp can be set per component (the vision tower lives on the first "
                                      f"pipeline stage with the language model's data parallelism; got {key})",
                                      key=f"parallel.components.vision.{key}")
                if value not in (1, plan.tp):
                    raise RecipeError(f"the vision tower runs at tp 1 (whole on every rank) or at the language "
                                      f"model's tp {plan.tp} (got {value})", key="parallel.components.vision.tp")

    @staticmethod
    def _check_compile(recipe: Recipe, arch: Any) -> None:
        """``train.compile`` compiles each DiT transformer layer; LLMs and VLMs get their fused kernels from
        ``kernels.spec`` instead (Triton kernels that torch.compile would have to trace)."""
        t = recipe.train
        if t.compile and not arch.is_dit:
            raise RecipeError("train.compile (torch.compile of each transformer layer) is for DiT models on this "
                              "backend; LLMs and VLMs get fused kernels from kernels.spec loongforge",
                              key="train.compile")
        if t.compile_mode in ("reduce-overhead", "max-autotune"):
            raise RecipeError(f"compile_mode {t.compile_mode} replays CUDA graphs, which megatron's DDP buffers and "
                              "schedules are not set up for here; use default or max-autotune-no-cudagraphs",
                              key="train.compile_mode")
        if t.compile and recipe.kernels.grad_accum_fusion:
            # NOTE: megatron's linear backward adds into weight.main_grad, a tensor outside the compiled graph: dynamo
            # breaks the graph at every linear (DiT-XL/2 on an H200 ran 0.60x of train.compile alone)
            raise RecipeError("kernels.grad_accum_fusion cannot be used with train.compile: megatron's linear backward "
                              "writes the fp32 main_grad outside the compiled graph, which breaks it at every linear "
                              "(0.60x measured); use one of them", key="kernels.grad_accum_fusion")

    @staticmethod
    def _check_provider(recipe: Recipe, arch: Any) -> None:
        """An explicit ``kernels.provider`` must be one this model uses and must serve every op of our spec
        (select_op never swaps an explicitly chosen provider for another)."""
        name, spec = recipe.kernels.provider, recipe.kernels.spec
        if name == "auto":
            return
        if arch.is_dit:
            raise RecipeError("DiT models use no fused kernels (SDPA attention only); leave kernels.provider auto",
                              key="kernels.provider")
        if spec in ("local", "te"):
            raise RecipeError(f"kernels.provider is used by the loongforge spec; kernels.spec '{spec}' uses none",
                              key="kernels.provider")
        from loongforge import registry
        from loongforge.errors import PluginError

        try:
            ops = registry.kernels.get(name)().ops()
        except PluginError as exc:
            raise RecipeError(str(exc).splitlines()[0], key="kernels.provider") from None
        needed = ("rms_norm", "swiglu", "rope", "fused_linear_cross_entropy")
        missing = [op for op in needed if op not in ops]
        if missing:
            raise RecipeError(f"kernel provider '{name}' has no {', '.join(missing)}; the loongforge spec needs "
                              f"{', '.join(needed)}", key="kernels.provider")

    @staticmethod
    def _check_vlm(recipe: Recipe, plan: Any, arch: Any) -> None:
        """What the first VLM (LLaVA) path supports: TP / DP / distributed optimizer, pretrain or CPT on
        synthetic image-text data, resumable checkpoints and HF export."""
        from loongforge_megatron.engine.llava import image_seq_length

        for key, value, allowed in (("parallel.vpp", plan.vpp, 1), ("parallel.cp", plan.cp, 1), ("parallel.ep", plan.ep, 1)):
            if value != allowed:
                raise RecipeError(f"LLaVA models train with tensor, pipeline and data parallelism only (got {value})",
                                  key=key)
        if plan.sp:
            raise RecipeError("LLaVA without TransformerEngine cannot use sequence parallelism", key="parallel.sp")
        if recipe.train.stage not in ("pretrain", "cpt"):
            raise RecipeError(f"LLaVA models support train.stage pretrain / cpt (got '{recipe.train.stage}'; "
                              "data.format llava already trains on the assistant turns only)", key="train.stage")
        if recipe.train.eval_interval:
            raise RecipeError("LLaVA models have no validation pass yet; remove train.eval_interval",
                              key="train.eval_interval")
        if recipe.data.format not in ("synthetic", "llava"):
            raise RecipeError(f"LLaVA models train on data.format llava (image-text conversations) or synthetic "
                              f"(got '{recipe.data.format}')", key="data.format")
        if recipe.kernels.spec not in ("auto", "loongforge", "local"):
            raise RecipeError(f"LLaVA models use the loongforge (SDPA + fused kernels) or megatron's local layer specs "
                              f"(got '{recipe.kernels.spec}')", key="kernels.spec")
        if arch.rope_scaling_factor is not None or arch.rope_yarn:
            raise RecipeError("LLaVA with rope scaling is not supported", key="model")
        heads = arch.vision["vision_config"]["num_attention_heads"]
        for what, n in (("CLIP attention heads", heads), ("CLIP ffn size", arch.vision["vision_config"]["intermediate_size"])):
            if n % plan.tp:
                raise RecipeError(f"{what} {n} do not split over tp = {plan.tp}", key="parallel.tp")
        if recipe.data.seq_length <= image_seq_length(arch) + 2:
            raise RecipeError(f"data.seq_length must exceed the {image_seq_length(arch)} image embeddings plus text",
                              key="data.seq_length")

    @staticmethod
    def _check_dit(recipe: Recipe, plan: Any, arch: Any) -> None:
        """What the DiT path supports: TP / DP / distributed optimizer (+ recompute), pretrain or CPT on latents
        (synthetic, or an image folder encoded by model.vae), resumable checkpoints and diffusers export."""
        import importlib.util

        if importlib.util.find_spec("diffusers") is None:
            raise RecipeError("DiT models need diffusers: pip install 'loongforge-megatron[diffusion]'", key="model")
        for key, value in (("parallel.pp", plan.pp), ("parallel.cp", plan.cp), ("parallel.ep", plan.ep)):
            if value != 1:
                raise RecipeError(f"DiT models train with tensor and data parallelism only (got {value})", key=key)
        if plan.sp:
            raise RecipeError("DiT models do not support sequence parallelism yet", key="parallel.sp")
        for what, n in (("attention heads", arch.num_attention_heads), ("MLP size", arch.ffn_hidden_size)):
            if n % plan.tp:
                raise RecipeError(f"DiT {what} {n} do not split over tp = {plan.tp}", key="parallel.tp")
        t, data, model = recipe.train, recipe.data, recipe.model
        if t.stage not in ("pretrain", "cpt"):
            raise RecipeError(f"DiT models support train.stage pretrain / cpt (got '{t.stage}')", key="train.stage")
        if t.eval_interval:
            raise RecipeError("DiT models have no validation pass yet; remove train.eval_interval",
                              key="train.eval_interval")
        if "peft" in recipe.checkpoint.save_format:
            raise RecipeError("DiT models have no LoRA adapters to export", key="checkpoint.save_format")
        if recipe.kernels.spec == "te":
            raise RecipeError("DiT models use the loongforge (SDPA) or local attention spec, not te",
                              key="kernels.spec")
        if data.format != "latents":
            raise RecipeError(f"DiT models train on data.format latents (synthetic without data.path, an image "
                              f"folder with it; got '{data.format}')", key="data.format")
        if model.tokenizer:
            raise RecipeError("DiT models have no tokenizer", key="model.tokenizer")
        defaults = type(data).model_fields
        for key in ("seq_length", "tokenizer", "source", "train_tokenizer", "blend", "split"):
            if getattr(data, key) != defaults[key].get_default(call_default_factory=True):
                raise RecipeError(f"not used by DiT models (a sample is {arch.num_patches} latent patches)",
                                  key=f"data.{key}")
        if data.path and not model.vae:
            raise RecipeError("an image folder (data.path) needs model.vae, the diffusers AutoencoderKL folder that "
                              "encodes it", key="model.vae")
        if model.vae and not data.path:
            raise RecipeError("model.vae encodes the images of data.path; synthetic latents (no data.path) need none",
                              key="model.vae")
        if data.image_size is not None:
            from loongforge_megatron.data.latents import VAE_DOWNSAMPLING as f

            if data.image_size % (f * arch.patch_size):
                raise RecipeError(f"{data.image_size} is not divisible by {f} (VAE) x {arch.patch_size} (patch) = "
                                  f"{f * arch.patch_size}", key="data.image_size")
            if data.image_size != f * arch.sample_size:
                raise RecipeError(f"{data.image_size} px images give {data.image_size // f} x {data.image_size // f} "
                                  f"latents but the model's sample_size is {arch.sample_size}; set model.sample_size: "
                                  f"{data.image_size // f}", key="data.image_size")

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

        return prepare(recipe, force=force)

    def convert(self, src: str, dst: str, *, to: str, **layout: Any) -> None:
        from loongforge.errors import CheckpointError

        from loongforge_megatron.conversion import hf_to_megatron, megatron_to_hf, reshard
        from loongforge_megatron.conversion.layout import LAYOUT_FILE

        force = layout.pop("force", False)
        etp = layout.pop("etp", None) or layout["tp"]
        if to == "hf":
            split = [k for k in ("first_stage_layers", "last_stage_layers") if layout.get(k) is not None]
            if split:
                raise CheckpointError(f"--{split[0].replace('_', '-')} applies to --to megatron; with --to hf the "
                                      f"source's {LAYOUT_FILE} says how it was split")
            megatron_to_hf(src, dst, force=force)
        elif (Path(src) / "config.json").is_file():
            hf_to_megatron(src, dst, etp=etp, force=force, **layout)
        else:
            reshard(src, dst, etp=etp, force=force, **layout)

    def place_experts(self, src: str, dst: str, *, loads: str, ep: int, force: bool = False) -> dict:
        from loongforge_megatron.moe_placement import rebalance_hf

        return rebalance_hf(src, dst, loads=loads, ep=ep, force=force)
