"""DiT's spec: presets, diffusers ``DiTTransformer2DModel`` config both ways, name map, recipe checks, latents
and the adaLN-Zero model with its DDPM objective."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from typing import Any

from loongforge.errors import RecipeError

from loongforge_megatron.models.base import HFCheckpoint
from loongforge_megatron.models.dit import names
from loongforge_megatron.models.dit.arch import (
    DIFFUSERS_CLASS,
    LEGACY_CLASS,
    DiTArch,
    arch_from_diffusers,
    diffusers_config,
)
from loongforge_megatron.models.dit.config import DiTDataConfig, DiTModelConfig
from loongforge_megatron.models.spec import Data, HFConfig, Model, Supports

PRESETS: dict[str, dict[str, Any]] = {
    # DiT-XL/2 as facebook/DiT-XL-2-256
    "dit-xl-2-256": dict(family="dit", num_layers=28, hidden_size=1152, num_attention_heads=16, patch_size=2, sample_size=32, in_channels=4, learn_sigma=True, num_classes=1000),
    "dit-tiny": dict(family="dit", num_layers=2, hidden_size=64, num_attention_heads=4, patch_size=2, sample_size=8, in_channels=4, learn_sigma=True, num_classes=10),
}


def class_labels_json(names: list[str]) -> str:
    """``{"id2label": {"0": name, ...}}``: the label ids a class-conditional model was trained with."""
    return json.dumps({"id2label": {str(i): n for i, n in enumerate(names)}}, indent=1)


class DiT(HFCheckpoint):
    """Class-conditional DiT <-> diffusers ``DiTTransformer2DModel`` (or the legacy ``Transformer2DModel``)."""

    name = "dit"
    model_types = (DIFFUSERS_CLASS, LEGACY_CLASS)
    presets = PRESETS
    hf_weights = "diffusion_pytorch_model"
    kind = "a DiT"
    arch_type = DiTArch
    model_section = DiTModelConfig
    data_section = DiTDataConfig
    supports = Supports(models="DiT models", stages=("pretrain", "cpt"), data_formats=("latents",), sft_formats=(),
                        parallel=("tp",), layers=("auto", "loongforge", "local"))

    # ---------------------------------------------------------------- architecture
    def arch(self, fields: Any) -> DiTArch:
        return DiTArch(**fields)

    def arch_from_hf(self, cfg: HFConfig, *, path: Path) -> DiTArch:
        try:
            return arch_from_diffusers(cfg)
        except ValueError as exc:
            raise RecipeError(f"{path}: {exc}".splitlines()[0], key="model.hf") from None

    def hf_config(self, arch: DiTArch, *, torch_dtype: str = "float32") -> HFConfig:
        return diffusers_config(arch)

    # ---------------------------------------------------------------- HF checkpoint
    def name_map(self, cfg: HFConfig, *, divisible_by: int = 128):
        return names.name_map(cfg, divisible_by=divisible_by)

    def text_config(self, cfg: HFConfig) -> HFConfig:
        return names.text_config(cfg)

    def export_config(self, cfg: HFConfig) -> HFConfig:
        return names.export_config(cfg)

    # ---------------------------------------------------------------- recipe checks
    def check(self, recipe: Any, plan: Any, arch: DiTArch) -> None:
        """What the DiT path supports: TP / DP / distributed optimizer (+ recompute), pretrain or CPT on latents
        (synthetic, or an image folder encoded by model.vae), resumable checkpoints and diffusers export."""
        if recipe.kernels.provider != "auto":
            raise RecipeError("DiT models use no fused kernels (SDPA attention only); leave kernels.provider auto",
                              key="kernels.provider")
        if importlib.util.find_spec("diffusers") is None:
            raise RecipeError("DiT models need diffusers: pip install 'loongforge-megatron[diffusion]'", key="model")
        for what, n in (("attention heads", arch.num_attention_heads), ("MLP size", arch.ffn_hidden_size)):
            if n % plan.tp:
                raise RecipeError(f"DiT {what} {n} do not split over tp = {plan.tp}", key="parallel.tp")
        t, data, model = recipe.train, recipe.data, recipe.model
        if t.eval_interval:
            raise RecipeError("DiT models have no validation pass yet; remove train.eval_interval",
                              key="train.eval_interval")
        if "peft" in recipe.checkpoint.save_format:
            raise RecipeError("DiT models have no LoRA adapters to export", key="checkpoint.save_format")
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
            from loongforge_megatron.models.dit.data import VAE_DOWNSAMPLING as f

            if data.image_size % (f * arch.patch_size):
                raise RecipeError(f"{data.image_size} is not divisible by {f} (VAE) x {arch.patch_size} (patch) = "
                                  f"{f * arch.patch_size}", key="data.image_size")
            if data.image_size != f * arch.sample_size:
                raise RecipeError(f"{data.image_size} px images give {data.image_size // f} x {data.image_size // f} "
                                  f"latents but the model's sample_size is {arch.sample_size}; set model.sample_size: "
                                  f"{data.image_size // f}", key="data.image_size")

    # ---------------------------------------------------------------- training
    def data(self, *, recipe: Any, arch: DiTArch, runtime: Any, device: Any) -> Data:
        """Latents first, so a bad image folder or VAE fails before the model is built. An image folder's class
        names (sorted sub-folders = labels 0..n-1) go to OUTPUT/classes.json and into every export, so samples can
        be asked for by name (DiTPipeline's id2label). Every export is also a ``DiTPipeline`` folder
        (``pipeline.py``), with the run's VAE when it had one."""
        from loongforge_megatron.models.dit.data import build_latents
        from loongforge_megatron.models.dit.pipeline import write_pipeline

        latents, encoder = build_latents(recipe, arch=arch, device=device)
        classes = getattr(latents, "classes", None)
        labels = class_labels_json(classes) if classes else None
        if labels and runtime.is_main:
            from loongforge.checkpoint.atomic import write_atomic

            write_atomic(runtime.output_dir / "classes.json", labels)

        def assets(staging: Path) -> None:
            if labels:
                (staging / "classes.json").write_text(labels)
            write_pipeline(staging, vae=recipe.model.vae, id2label=json.loads(labels)["id2label"] if labels else None)

        return Data(train=latents, seq_length=arch.num_patches, sample_unit="images", assets=assets, encoder=encoder)

    def model(self, *, recipe: Any, arch: DiTArch, plan: Any, accelerator: Any, device: Any, precision: str,
              data: Data) -> Model:
        from loongforge_megatron.models.dit import model as dit

        config = dit.transformer_config(arch, plan=plan, precision=precision,
                                        grad_accum_fusion=recipe.kernels.grad_accum_fusion)
        spec_name = "local" if recipe.kernels.layers == "local" else "loongforge"
        chunks = dit.build_dit(config=config, arch=arch, device=device,
                               attention="local" if spec_name == "local" else "sdpa",
                               compile_mode=recipe.train.compile_mode if recipe.train.compile else None)
        forward_step = functools.partial(dit.forward_step, scheduler=dit.noise_scheduler(), encoder=data.encoder)
        return Model(chunks=chunks, config=config, kernels=spec_name, forward_step=forward_step, loss_key=dit.LOSS_KEY)


SPEC = DiT()
