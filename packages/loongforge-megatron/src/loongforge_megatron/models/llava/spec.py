"""LLaVA's spec: presets, ``LlavaConfig`` both ways, name map, recipe checks, data and model.

The language model is a Llama (``models/gpt/llama.py`` reads and writes its text config); the CLIP tower and the
projector are ``Arch.vision`` (HF's LlavaConfig spelling: vision_config, projector_hidden_act,
vision_feature_layer, vision_feature_select_strategy, image_token_index, image_seq_length,
multimodal_projector_bias).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongforge.errors import RecipeError

from loongforge_megatron.layers.selection import check_provider
from loongforge_megatron.models.base import HFCheckpoint
from loongforge_megatron.models.gpt import llama
from loongforge_megatron.models.gpt.arch import Arch
from loongforge_megatron.models.llava import names
from loongforge_megatron.models.lm import check_lm, no_compile, padded_vocab, tokenizer_assets, tokenizer_for
from loongforge_megatron.models.spec import Data, HFConfig, Model, Supports
from loongforge_megatron.models.vision_component import check_own_ranks_recipe, check_vision_component

PRESETS: dict[str, dict[str, Any]] = {
    "llava-1.5-7b": dict(family="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32, vocab_size=32064, max_position_embeddings=4096,
                         vision=dict(vision_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, image_size=336, patch_size=14, hidden_act="quick_gelu", layer_norm_eps=1e-5),
                                     projector_hidden_act="gelu", vision_feature_layer=-2, vision_feature_select_strategy="default", image_token_index=32000, image_seq_length=576)),
    "llava-tiny": dict(family="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, vocab_size=256, max_position_embeddings=256,
                       vision=dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=32, patch_size=8, hidden_act="quick_gelu", layer_norm_eps=1e-5),
                                   projector_hidden_act="gelu", vision_feature_layer=-2, vision_feature_select_strategy="default", image_token_index=255, image_seq_length=16)),
}
LLAVA_FIELDS = ("projector_hidden_act", "vision_feature_layer", "vision_feature_select_strategy", "image_token_index",
                "image_seq_length", "multimodal_projector_bias")


class LlavaArch(Arch):
    """A Llama language model plus ``vision``: the CLIP tower and projector in LlavaConfig's spelling."""

    vision: dict

    @property
    def spec_name(self) -> str:
        return "llava"

    def language(self) -> Arch:
        return Arch(**self.model_dump(exclude={"vision"}))


class Llava(HFCheckpoint):
    """``LlavaForConditionalGeneration`` <-> megatron's ``LLaVAModel``."""

    name = "llava"
    # train.freeze's module groups
    groups = {"vision": ("vision_model.",), "projector": ("vision_projection.",), "language": ("language_model.",)}
    model_types = ("llava",)
    presets = PRESETS
    kind = "a language model"
    arch_type = LlavaArch
    supports = Supports(models="LLaVA models", stages=("pretrain", "cpt"), data_formats=("synthetic", "llava"),
                        sft_formats=(), parallel=("tp", "pp", "components"), layers=("auto", "loongforge", "local"))

    # ---------------------------------------------------------------- architecture
    def arch(self, fields: Any) -> LlavaArch:
        return LlavaArch(**{"family": "llama", **fields})

    def arch_from_hf(self, cfg: HFConfig, *, path: Path) -> LlavaArch:
        """The text config as the language model, the vision config and projector fields as ``vision``."""
        text, vision = dict(cfg.get("text_config") or {}), dict(cfg.get("vision_config") or {})
        if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise RecipeError(f"{path}: LLaVA with a '{vision.get('model_type')}' vision tower is not supported (CLIP "
                              "only)", key="model.hf")
        if text.get("model_type", "llama") not in llama.SPEC.model_types:
            raise RecipeError(f"{path}: LLaVA with a '{text['model_type']}' language model is not supported (llama)",
                              key="model.hf")
        language = llama.SPEC.arch_from_hf(text, path=path)
        extra = {k: cfg[k] for k in LLAVA_FIELDS if k in cfg}  # NOTE: complete_config spells the image token one way
        return self.arch({**language.model_dump(), "vision": {"vision_config": vision, **extra}})

    def hf_config(self, arch: LlavaArch, *, torch_dtype: str = "float32") -> HFConfig:
        """LlavaConfig of ``arch``. The CLIP tower is written with the layers the model runs and
        ``vision_feature_layer = -1`` (the same features as a deeper tower read at -2: megatron's tower holds no
        more)."""
        v = arch.vision
        text = llama.SPEC.hf_config(arch.language(), torch_dtype=torch_dtype)
        text.pop("architectures", None)
        vision = {"model_type": "clip_vision_model", **v["vision_config"],
                  "num_hidden_layers": names.vision_layers_used({"vision_config": v["vision_config"], **v})}
        return {
            "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "text_config": text,
            "vision_config": vision, "image_token_index": v["image_token_index"],
            **({"image_seq_length": v["image_seq_length"]} if v.get("image_seq_length") else {}),
            "projector_hidden_act": v.get("projector_hidden_act", "gelu"),
            "vision_feature_layer": -1, "vision_feature_select_strategy": "default", "multimodal_projector_bias": True,
            "tie_word_embeddings": arch.tie_embeddings, "torch_dtype": torch_dtype,
        }

    # ---------------------------------------------------------------- HF checkpoint
    def complete_hf_config(self, cfg: HFConfig) -> HFConfig:
        return names.complete_config(cfg)

    def name_map(self, cfg: HFConfig, *, divisible_by: int = 128):
        return names.name_map(cfg, divisible_by=divisible_by)

    def text_config(self, cfg: HFConfig) -> HFConfig:
        return names.text_config(cfg)

    def ignore_hf(self, cfg: HFConfig, name: str) -> bool:
        return names.ignore_hf(cfg, name)

    def hf_alias(self, name: str) -> str:
        return names.hf_alias(name)

    def hf_extra(self, cfg: HFConfig) -> dict:
        return names.hf_extra(cfg)

    def config_checks(self, sizes: Any) -> None:
        """config.json's values no tensor shape shows (the image token id)."""
        names.config_checks(sizes)

    def export_config(self, cfg: HFConfig) -> HFConfig:
        return names.export_config(cfg)

    # ---------------------------------------------------------------- recipe checks
    def adaptations(self, *, arch: LlavaArch, accelerator: Any) -> list:
        """LLaVAModel's CLIP tower built with WrappedTorchNorm (and CPU position ids on the CPU): ``models/llava/clip.py``."""
        from loongforge_megatron.models.llava.clip import clip_adaptations

        return clip_adaptations(cpu=accelerator.device_type == "cpu")

    def check(self, recipe: Any, plan: Any, arch: LlavaArch) -> None:
        """What the first VLM path supports: TP / PP / DP / distributed optimizer, pretrain or CPT on image-text
        data, resumable checkpoints and HF export; the vision tower may be kept whole (``components.vision``)."""
        from loongforge_megatron.models.llava.model import image_seq_length

        check_provider(recipe)
        no_compile(recipe)
        from loongforge_megatron.engine.encoder_ranks import rank_sets

        v = arch.vision["vision_config"]
        check_vision_component(plan, heads=v["num_attention_heads"], ffn=v["intermediate_size"], own_ranks=True)
        sets = rank_sets(plan)
        if sets is not None:  # NOTE: the rest is the language model's, on its own ranks
            check_own_ranks_recipe(recipe, plan)
            plan = sets.language
        if plan.sp:
            raise RecipeError("LLaVA without TransformerEngine cannot use sequence parallelism", key="parallel.sp")
        if recipe.train.eval_interval:
            raise RecipeError("LLaVA models have no validation pass yet; remove train.eval_interval",
                              key="train.eval_interval")
        if arch.rope_scaling_factor is not None or arch.rope_yarn:
            raise RecipeError("LLaVA with rope scaling is not supported", key="model")
        # NOTE: LLaVAModel first builds the tower over the language model's groups (then over its own, if set)
        for what, n in (("CLIP attention heads", v["num_attention_heads"]), ("CLIP ffn size", v["intermediate_size"])):
            if n % plan.tp and sets is None:
                raise RecipeError(f"{what} {n} do not split over tp = {plan.tp}", key="parallel.tp")
        if recipe.data.seq_length <= image_seq_length(arch) + 2:
            raise RecipeError(f"data.seq_length must exceed the {image_seq_length(arch)} image embeddings plus text",
                              key="data.seq_length")
        llama.SPEC.check_family(recipe, plan, arch)
        check_lm(recipe, plan, arch)

    # ---------------------------------------------------------------- training
    def data(self, *, recipe: Any, arch: LlavaArch, runtime: Any, device: Any) -> Data:
        from loongforge_megatron.models.llava.model import ImageTextConversations, SyntheticImageText

        tokenizer = tokenizer_for(recipe, runtime, prepare=recipe.data.format != "llava")  # NOTE: records as is
        if tokenizer is not None and len(tokenizer) > arch.vocab_size:
            raise RecipeError(f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {arch.vocab_size}",
                              key="model.vocab_size")
        seq, seed = recipe.data.seq_length, recipe.train.seed
        if recipe.data.format == "llava":
            train = ImageTextConversations(recipe.data.path, tokenizer=tokenizer, arch=arch, seq_length=seq,
                                           processor_dir=recipe.model.hf or recipe.checkpoint.load
                                           or recipe.data.tokenizer, seed=seed)
        else:
            train = SyntheticImageText(arch=arch, seq_length=seq, seed=seed)
        return Data(train=train, seq_length=seq, tokenizer=tokenizer, assets=tokenizer_assets(recipe))

    def model(self, *, recipe: Any, arch: LlavaArch, plan: Any, accelerator: Any, device: Any, precision: str,
              data: Data) -> Model:
        import torch.distributed as dist

        from loongforge_megatron.engine.component_groups import component_groups
        from loongforge_megatron.engine.encoder_ranks import rank_sets
        from loongforge_megatron.layers.output import mask_padded_vocab
        from loongforge_megatron.models.gpt.translate import transformer_config
        from loongforge_megatron.models.llava.model import (
            VISION_PREFIXES,
            LlavaEncoder,
            build_llava,
            forward_step,
        )

        sets = rank_sets(plan)
        if sets is not None:
            plan = sets.language
        config = transformer_config(arch.language(), plan=plan, precision=precision,
                                    cpu_init=accelerator.device_type == "cpu" or recipe.model.init_on_cpu,
                                    grad_accum_fusion=recipe.kernels.grad_accum_fusion)
        # NOTE: LLaVA has no TransformerEngine path here: auto (and te, refused at validate) mean ours.
        spec_name = "local" if recipe.kernels.layers == "local" else "loongforge"
        if sets is not None and sets.on_encoder(dist.get_rank()):  # NOTE: CLIP and the projector alone
            encoder = LlavaEncoder(language=config, arch=arch, spec=spec_name, provider=recipe.kernels.provider,
                                   accelerator=accelerator, recompute=sets.encoder.recompute)
            encoder.to(device=device, dtype=config.params_dtype)
            return Model(chunks=[encoder], config=config, kernels=spec_name, groups=self.groups,
                         whole=VISION_PREFIXES if plan.tp > 1 else (), timed_encoder=True)
        groups = component_groups(plan, "vision") if sets is None else None
        whole = groups.checkpoint_entries(VISION_PREFIXES, tp=plan.tp) if groups is not None else (
            VISION_PREFIXES if plan.tp > 1 else ())
        chunks = build_llava(
            language=config, arch=arch, vocab_size=padded_vocab(arch.vocab_size, plan.tp),
            # NOTE: under pipeline parallelism LLaVAModel pads every combined sequence to this length (fixed p2p
            # shapes); data.seq_length is already the length after the image tokens expand
            max_sequence_length=recipe.data.seq_length if plan.pp > 1 else max(
                arch.max_position_embeddings, recipe.data.seq_length),
            device=device, spec=spec_name, provider=recipe.kernels.provider, accelerator=accelerator,
            vision_groups=groups, remote_encoder=sets is not None)
        mask_padded_vocab(chunks, vocab_size=arch.vocab_size)
        return Model(chunks=chunks, config=config, kernels=spec_name, forward_step=forward_step, whole=whole,
                     groups=self.groups, timed_encoder=groups is None or groups.hdp > 1)


SPEC = Llava()
