"""Wan's spec: presets, diffusers ``WanTransformer3DModel`` config both ways, name map, recipe checks, synthetic
samples and the tensor-parallel model with its flow-matching objective."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from loongforge.errors import RecipeError

from loongforge_megatron.models.base import HFCheckpoint
from loongforge_megatron.models.spec import Data, HFConfig, Model, Supports
from loongforge_megatron.models.wan import names
from loongforge_megatron.models.wan.arch import (
    DIFFUSERS_CLASS,
    PRESETS,
    WanArch,
    arch_from_diffusers,
    diffusers_config,
)
from loongforge_megatron.models.wan.config import WanDataConfig, WanModelConfig


def objective_of(data: Any):
    """The flow-matching values of a recipe's ``data``; one expert of a two-expert model trains on its side of
    ``boundary_ratio`` only."""
    from loongforge_megatron.models.flow_matching import FlowMatching

    ranges = {None: (0.0, 1.0), "high_noise": (data.boundary_ratio, 1.0), "low_noise": (0.0, data.boundary_ratio)}
    return FlowMatching.from_data(data, sigma_range=ranges[data.expert])


class Wan(HFCheckpoint):
    """Wan2.1 / Wan2.2 video diffusion transformers <-> diffusers ``WanTransformer3DModel``."""

    name = "wan"
    model_types = (DIFFUSERS_CLASS,)
    presets = PRESETS
    hf_weights = "diffusion_pytorch_model"
    kind = "a Wan model"
    arch_type = WanArch
    model_section = WanModelConfig
    data_section = WanDataConfig
    supports = Supports(models="Wan models", stages=("pretrain", "cpt", "lora"), data_formats=("synthetic", "latent_cache"),
                        sft_formats=(), parallel=("tp", "sp", "cp"), layers=("auto", "loongforge", "local"))
    # NOTE: LoRA exports in diffusers' format, which a pipeline's load_lora_weights reads: the transformer's module
    # paths under "transformer.", rank / alpha / modules in the file's lora_adapter_metadata (module paths: the
    # attention output is "to_out.0", and a bare "0" would match every block)
    peft_prefix = "transformer."
    peft_weights = "pytorch_lora_weights.safetensors"
    peft_module_paths = True
    #: train.lora.targets -> our linears (diffusers' names)
    LORA_TARGETS = {"qkv": ("to_q", "to_k", "to_v", "add_k_proj", "add_v_proj"), "proj": ("to_out",),
                    "fc1": ("linear_fc1",), "fc2": ("linear_fc2",)}

    def peft_metadata(self, config: dict[str, Any]) -> dict[str, str]:
        import json

        keys = ("r", "lora_alpha", "lora_dropout", "target_modules", "bias", "use_rslora", "use_dora")
        return {"lora_adapter_metadata": json.dumps({f"transformer.{k}": config[k] for k in keys}, sort_keys=True)}

    # ---------------------------------------------------------------- architecture
    def arch(self, fields: Any) -> WanArch:
        return WanArch(**fields)

    def arch_from_hf(self, cfg: HFConfig, *, path: Path) -> WanArch:
        try:
            return arch_from_diffusers(cfg)
        except ValueError as exc:
            raise RecipeError(f"{path}: {exc}".splitlines()[0], key="model.hf") from None

    def hf_config(self, arch: WanArch, *, torch_dtype: str = "float32") -> HFConfig:
        return diffusers_config(arch)

    # ---------------------------------------------------------------- HF checkpoint
    def name_map(self, cfg: HFConfig, *, divisible_by: int = 128):
        return names.name_map(cfg, divisible_by=divisible_by)

    def text_config(self, cfg: HFConfig) -> HFConfig:
        return names.text_config(cfg)

    def export_config(self, cfg: HFConfig) -> HFConfig:
        return names.export_config(cfg)

    def ignore_hf(self, cfg: HFConfig, name: str) -> bool:
        """Tensors no Wan computes with: some I2V checkpoints carry a ``norm_added_q`` diffusers also skips."""
        return "norm_added_q" in name

    # ---------------------------------------------------------------- recipe checks
    def check(self, recipe: Any, plan: Any, arch: WanArch) -> None:
        """What the Wan path supports: TP (+ SP) / CP (Ulysses or ring) / DP / distributed optimizer (+ full recompute), pretrain, CPT or LoRA on
        synthetic samples, resumable checkpoints, diffusers export and diffusers-format LoRA export."""
        if recipe.kernels.provider != "auto":
            raise RecipeError("Wan models use no fused kernels (SDPA attention only); leave kernels.provider auto",
                              key="kernels.provider")
        for what, n in (("attention heads", arch.num_attention_heads), ("MLP size", arch.ffn_hidden_size)):
            if n % plan.tp:
                raise RecipeError(f"Wan {what} {n} do not split over tp = {plan.tp}", key="parallel.tp")
        if plan.cp > 1 and recipe.model.cp_comm_type == "a2a" and arch.num_attention_heads % (plan.tp * plan.cp):
            raise RecipeError(f"Wan's {arch.num_attention_heads} attention heads do not split over tp x cp = "
                              f"{plan.tp * plan.cp} (context parallelism a2a exchanges tokens for heads; "
                              "model.cp_comm_type p2p passes keys / values around a ring instead)", key="parallel.cp")
        if plan.recompute == "selective":
            raise RecipeError("Wan models recompute whole blocks: use parallel.recompute full", key="parallel.recompute")
        t, data, model = recipe.train, recipe.data, recipe.model
        if t.eval_interval:
            raise RecipeError("Wan models have no validation pass yet; remove train.eval_interval",
                              key="train.eval_interval")
        if model.tokenizer:
            raise RecipeError("Wan models take text embeddings, not tokens: remove model.tokenizer",
                              key="model.tokenizer")
        defaults = type(data).model_fields
        cache = data.format == "latent_cache"
        for key in ("seq_length", "tokenizer", "source", "train_tokenizer", "blend", "split", *(() if cache else (
                "path", "frames", "autoencoder", "text_encoder", "image_encoder"))):
            if getattr(data, key) != defaults[key].get_default(call_default_factory=True):
                raise RecipeError(f"not used by Wan models' data.format {data.format}", key=f"data.{key}")
        if data.first_frame_clean and (arch.in_channels != arch.out_channels or arch.image_dim is not None):
            raise RecipeError("this model takes its image condition through condition channels / image tokens (I2V); "
                              "data.first_frame_clean is the TI2V way (no condition channels): remove it",
                              key="data.first_frame_clean")
        if data.first_frame_clean and arch.patch_size[0] != 1:
            raise RecipeError(f"a clean first latent frame needs patches of one frame (patch_size "
                              f"{list(arch.patch_size)})", key="data.first_frame_clean")
        if data.image_encoder and arch.image_dim is None:
            raise RecipeError("this model has no image-encoder tokens (model.image_dim); remove data.image_encoder",
                              key="data.image_encoder")
        if cache:  # NOTE: the clips' sizes are in the cache, checked when it is opened
            return
        sizes = [("frames", f, arch.patch_size[0], "data.packed_frames") for f in data.packed_frames] or [
            ("frames", data.latent_frames, arch.patch_size[0], "data.latent_frames")]
        sizes += [("height", data.latent_height, arch.patch_size[1], "data.latent_height"),
                  ("width", data.latent_width, arch.patch_size[2], "data.latent_width")]
        for axis, size, p, key in sizes:
            if size % p:
                raise RecipeError(f"{size} latent {axis} do not split into patches of {p}", key=key)
            if size // p > arch.rope_max_seq_len:
                raise RecipeError(f"{size // p} patches along {axis} exceed the model's RoPE table "
                                  f"(rope_max_seq_len {arch.rope_max_seq_len})", key=key)
        # NOTE: the tokens split over cp, then (sequence parallelism) over tp
        parts, what = (plan.cp * plan.tp, "cp x tp (sequence parallel)") if plan.sp else (plan.cp, "cp")
        key = "parallel.sp" if plan.sp else "parallel.cp"
        if data.packed_frames:
            # NOTE: every sample's tokens are whole frames: frames of tokens that split split any packing
            per_frame = arch.tokens(arch.patch_size[0], data.latent_height, data.latent_width)
            if per_frame % parts:
                raise RecipeError(f"{per_frame} video tokens per latent frame do not split over {what} = {parts} "
                                  "(packed samples)", key=key)
            return
        tokens = arch.tokens(data.latent_frames, data.latent_height, data.latent_width)
        if tokens % parts:
            raise RecipeError(f"{tokens} video tokens per sample do not split over {what} = {parts}", key=key)

    def prepare_data(self, recipe: Any, *, force: bool = False) -> Path:
        """``loongforge data prepare``: encode ``data.frames``' clips into the latent cache at ``data.path``."""
        from loongforge_megatron.models.wan.cache import prepare

        if recipe.data.format != "latent_cache":
            raise RecipeError(f"data.format {recipe.data.format} needs no preparation (prepare writes a "
                              "latent_cache)", key="data.format")
        return prepare(recipe, force=force)

    # ---------------------------------------------------------------- training
    def data(self, *, recipe: Any, arch: WanArch, runtime: Any, device: Any) -> Data:
        from loongforge_megatron.models.wan.data import SyntheticVideo

        d = recipe.data
        if d.format == "latent_cache":
            from loongforge_megatron.models.wan.cache import LatentCache

            p = recipe.parallel
            cache = LatentCache(path=d.path, arch=arch, data=d, objective=objective_of(d), seed=recipe.train.seed,
                                parts=p.cp * (p.tp if p.sp else 1))
            return Data(train=cache, seq_length=arch.tokens(d.latent_frames, d.latent_height, d.latent_width),
                        sample_unit="videos")
        dataset = SyntheticVideo(arch=arch, data=d, objective=objective_of(d), seed=recipe.train.seed)
        frames = max(d.packed_frames, default=d.latent_frames)
        return Data(train=dataset, seq_length=arch.tokens(frames, d.latent_height, d.latent_width),
                    sample_unit="videos")

    def model(self, *, recipe: Any, arch: WanArch, plan: Any, accelerator: Any, device: Any, precision: str,
              data: Data) -> Model:
        from loongforge_megatron.models.flow_matching import LOSS_KEY
        from loongforge_megatron.models.wan import model as wan

        config = wan.transformer_config(arch, plan=plan, precision=precision,
                                        grad_accum_fusion=recipe.kernels.grad_accum_fusion)
        chunks = wan.build_wan(config=config, arch=arch, device=device, recompute=plan.recompute == "full",
                               compile_mode=recipe.train.compile_mode if recipe.train.compile else None,
                               cp_comm_type=recipe.model.cp_comm_type)
        step = functools.partial(wan.forward_step, objective=objective_of(recipe.data))
        return Model(chunks=chunks, config=config, kernels="loongforge", forward_step=step, loss_key=LOSS_KEY,
                     lora_targets=self.LORA_TARGETS)


SPEC = Wan()
