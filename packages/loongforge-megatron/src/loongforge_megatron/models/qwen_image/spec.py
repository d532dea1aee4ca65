"""Qwen-Image's spec: presets, diffusers ``QwenImageTransformer2DModel`` config both ways, name map, recipe
checks, synthetic samples and the tensor-parallel model with its flow-matching objective."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from loongforge.errors import RecipeError

from loongforge_megatron.models.base import HFCheckpoint
from loongforge_megatron.models.qwen_image import names
from loongforge_megatron.models.qwen_image.arch import (
    DIFFUSERS_CLASS,
    PRESETS,
    QwenImageArch,
    arch_from_diffusers,
    diffusers_config,
)
from loongforge_megatron.models.qwen_image.config import QwenImageDataConfig, QwenImageModelConfig
from loongforge_megatron.models.spec import Data, HFConfig, Model, Supports

#: the RoPE tables' reach: positions past it are outside what diffusers' model tabulates
ROPE_POSITIONS = 4096


class QwenImage(HFCheckpoint):
    """Qwen-Image(-Edit) text-to-image diffusion transformers <-> diffusers ``QwenImageTransformer2DModel``."""

    name = "qwen_image"
    model_types = (DIFFUSERS_CLASS,)
    presets = PRESETS
    hf_weights = "diffusion_pytorch_model"
    kind = "a Qwen-Image model"
    arch_type = QwenImageArch
    model_section = QwenImageModelConfig
    data_section = QwenImageDataConfig
    supports = Supports(models="Qwen-Image models", stages=("pretrain", "cpt", "lora"),
                        data_formats=("synthetic", "latent_cache"),
                        sft_formats=(), parallel=("tp", "sp", "cp"), layers=("auto", "loongforge", "local"))
    # NOTE: LoRA exports in diffusers' format, which a pipeline's load_lora_weights reads: the transformer's module
    # paths under "transformer.", rank / alpha / modules in the file's lora_adapter_metadata
    peft_prefix = "transformer."
    peft_weights = "pytorch_lora_weights.safetensors"
    peft_module_paths = True
    #: train.lora.targets -> our linears (diffusers' names)
    LORA_TARGETS = {"qkv": ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"),
                    "proj": ("to_out", "to_add_out"), "fc1": ("linear_fc1",), "fc2": ("linear_fc2",)}

    def peft_metadata(self, config: dict[str, Any]) -> dict[str, str]:
        import json

        keys = ("r", "lora_alpha", "lora_dropout", "target_modules", "bias", "use_rslora", "use_dora")
        return {"lora_adapter_metadata": json.dumps({f"transformer.{k}": config[k] for k in keys}, sort_keys=True)}

    # ---------------------------------------------------------------- architecture
    def arch(self, fields: Any) -> QwenImageArch:
        return QwenImageArch(**fields)

    def arch_from_hf(self, cfg: HFConfig, *, path: Path) -> QwenImageArch:
        try:
            return arch_from_diffusers(cfg)
        except ValueError as exc:
            raise RecipeError(f"{path}: {exc}".splitlines()[0], key="model.hf") from None

    def hf_config(self, arch: QwenImageArch, *, torch_dtype: str = "float32") -> HFConfig:
        return diffusers_config(arch)

    # ---------------------------------------------------------------- HF checkpoint
    def name_map(self, cfg: HFConfig, *, divisible_by: int = 128):
        return names.name_map(cfg, divisible_by=divisible_by)

    def text_config(self, cfg: HFConfig) -> HFConfig:
        return names.text_config(cfg)

    def export_config(self, cfg: HFConfig) -> HFConfig:
        return names.export_config(cfg)

    def ignore_hf(self, cfg: HFConfig, name: str) -> bool:
        return False

    # ---------------------------------------------------------------- recipe checks
    def check(self, recipe: Any, plan: Any, arch: QwenImageArch) -> None:
        """What the Qwen-Image path supports: TP (+ SP) / CP (ring or Ulysses) / DP / distributed optimizer (+ full
        recompute), pretrain, CPT or LoRA on synthetic samples (Edit: reference images; packed variable sizes),
        diffusers export and diffusers-format LoRA export."""
        if recipe.kernels.provider != "auto":
            raise RecipeError("Qwen-Image models use no fused kernels (SDPA attention only); leave kernels.provider "
                              "auto", key="kernels.provider")
        for what, n in (("attention heads", arch.num_attention_heads), ("MLP size", arch.ffn_hidden_size)):
            if n % plan.tp:
                raise RecipeError(f"Qwen-Image {what} {n} do not split over tp = {plan.tp}", key="parallel.tp")
        if plan.cp > 1 and recipe.model.cp_comm_type == "a2a" and arch.num_attention_heads % (plan.tp * plan.cp):
            raise RecipeError(f"Qwen-Image's {arch.num_attention_heads} attention heads do not split over tp x cp = "
                              f"{plan.tp * plan.cp} (context parallelism a2a exchanges tokens for heads; "
                              "model.cp_comm_type p2p passes keys / values around a ring instead)", key="parallel.cp")
        if plan.recompute == "selective":
            raise RecipeError("Qwen-Image models recompute whole blocks: use parallel.recompute full",
                              key="parallel.recompute")
        t, data, model = recipe.train, recipe.data, recipe.model
        if t.eval_interval:
            raise RecipeError("Qwen-Image models have no validation pass yet; remove train.eval_interval",
                              key="train.eval_interval")
        if model.tokenizer:
            raise RecipeError("Qwen-Image models take text-encoder hidden states, not tokens: remove model.tokenizer",
                              key="model.tokenizer")
        defaults = type(data).model_fields
        cache = data.format == "latent_cache"
        for key in ("seq_length", "tokenizer", "source", "train_tokenizer", "blend", "split", *(
                ("packed_sizes",) if cache else ("path", "images", "autoencoder", "text_encoder"))):
            if getattr(data, key) != defaults[key].get_default(call_default_factory=True):
                raise RecipeError(f"not used by Qwen-Image models' data.format {data.format}" + (
                    " (the images' sizes are in the cache)" if cache else ""), key=f"data.{key}")
        if cache and data.reference_images:
            raise RecipeError("a latent cache holds text-to-image samples; Edit samples (reference images) train "
                              "on data.format synthetic", key="data.reference_images")
        for axis, size in (("height", data.height), ("width", data.width)):
            if size % arch.patch_size:
                raise RecipeError(f"{size} latent {axis} does not split into patches of {arch.patch_size}",
                                  key=f"data.{axis}")
            if size // arch.patch_size // 2 + data.text_length > ROPE_POSITIONS:
                raise RecipeError(f"{size // arch.patch_size} patches along {axis} and {data.text_length} text tokens "
                                  f"exceed the model's {ROPE_POSITIONS} RoPE positions", key=f"data.{axis}")
        # NOTE: the image tokens split over cp, then (sequence parallelism) over tp
        parts, what = (plan.cp * plan.tp, "cp x tp (sequence parallel)") if plan.sp else (plan.cp, "cp")
        if data.packed_sizes:
            for h, w in data.packed_sizes:
                if h % arch.patch_size or w % arch.patch_size:
                    raise RecipeError(f"{h} x {w} latent pixels do not split into patches of {arch.patch_size}",
                                      key="data.packed_sizes")
                if max(h, w) // arch.patch_size // 2 + data.text_length > ROPE_POSITIONS:
                    raise RecipeError(f"{h} x {w} latent pixels and {data.text_length} text tokens exceed the "
                                      f"model's {ROPE_POSITIONS} RoPE positions", key="data.packed_sizes")
                # NOTE: every image's tokens split (its reference images are its size), so any packing of them does
                if arch.tokens(h, w) % parts:
                    raise RecipeError(f"{arch.tokens(h, w)} image tokens of {h} x {w} do not split over {what} = "
                                      f"{parts}", key="data.packed_sizes")
        tokens = arch.tokens(data.height, data.width) * (1 + data.reference_images)
        if tokens % plan.cp and not (data.packed_sizes or cache):
            raise RecipeError(f"{tokens} image tokens per sample do not split over cp = {plan.cp}", key="parallel.cp")
        if plan.sp and (tokens // plan.cp) % plan.tp and not (data.packed_sizes or cache):
            raise RecipeError(f"{tokens // plan.cp} image tokens per CP rank do not split over tp = {plan.tp} "
                              "(sequence parallelism)", key="parallel.sp")
        if arch.in_channels != arch.out_channels * arch.patch_size**2:
            raise RecipeError(f"the model's in_channels ({arch.in_channels}) are not out_channels x patch^2 "
                              f"({arch.out_channels * arch.patch_size**2}): synthetic samples pack the latent "
                              "image into the input", key="model.in_channels")

    # ---------------------------------------------------------------- training
    def prepare_data(self, recipe: Any, *, force: bool = False) -> Path:
        """``loongforge data prepare``: encode ``data.images`` into the latent cache at ``data.path``."""
        from loongforge_megatron.models.qwen_image.cache import prepare

        if recipe.data.format != "latent_cache":
            raise RecipeError(f"data.format {recipe.data.format} needs no preparation (prepare writes a "
                              "latent_cache)", key="data.format")
        return prepare(recipe, force=force)

    def data(self, *, recipe: Any, arch: QwenImageArch, runtime: Any, device: Any) -> Data:
        from loongforge_megatron.models.flow_matching import FlowMatching
        from loongforge_megatron.models.qwen_image.data import SyntheticImages

        d = recipe.data
        if d.format == "latent_cache":
            from loongforge_megatron.models.qwen_image.cache import LatentImages

            p = recipe.parallel
            cache = LatentImages(path=d.path, arch=arch, data=d, objective=FlowMatching.from_data(d),
                                 seed=recipe.train.seed, parts=p.cp * (p.tp if p.sp else 1),
                                 rope_positions=ROPE_POSITIONS)
            return Data(train=cache, seq_length=cache.max_tokens + d.text_length, sample_unit="images")
        dataset = SyntheticImages(arch=arch, data=d, objective=FlowMatching.from_data(d), seed=recipe.train.seed)
        tokens = max(arch.tokens(h, w) for h, w in d.packed_sizes or [(d.height, d.width)])
        tokens = tokens * (1 + d.reference_images) + d.text_length
        return Data(train=dataset, seq_length=tokens, sample_unit="images")

    def model(self, *, recipe: Any, arch: QwenImageArch, plan: Any, accelerator: Any, device: Any, precision: str,
              data: Data) -> Model:
        from loongforge_megatron.models.flow_matching import LOSS_KEY
        from loongforge_megatron.models.qwen_image import model as qi

        config = qi.transformer_config(arch, plan=plan, precision=precision,
                                       grad_accum_fusion=recipe.kernels.grad_accum_fusion)
        chunks = qi.build_qwen_image(config=config, arch=arch, device=device, recompute=plan.recompute == "full",
                                     compile_mode=recipe.train.compile_mode if recipe.train.compile else None,
                                     cp_comm_type=recipe.model.cp_comm_type)
        step = functools.partial(qi.forward_step, patch=arch.patch_size)
        return Model(chunks=chunks, config=config, kernels="loongforge", forward_step=step, loss_key=LOSS_KEY,
                     lora_targets=self.LORA_TARGETS)


SPEC = QwenImage()
