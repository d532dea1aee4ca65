"""The Qwen-VL specs: presets, ``Qwen2_5_VLConfig`` / ``Qwen3VLConfig`` / ``Qwen3VLMoeConfig`` both ways, name
maps, recipe checks, data and model.

Qwen2.5-VL's language model is a Qwen2 (``models/gpt/qwen2.py`` reads and writes its text config), Qwen3-VL's a
Qwen3 (q/k norms), Qwen3-VL-MoE's a Qwen3-MoE (``models/gpt/qwen3_moe.py``), all with multimodal RoPE (Qwen3-VL's
interleaved); the vision tower, the special token ids and the mrope sections are ``Arch.vision``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from loongforge.errors import RecipeError

from loongforge_megatron.layers.selection import check_provider
from loongforge_megatron.models.base import HFCheckpoint
from loongforge_megatron.models.gpt import qwen2, qwen3, qwen3_moe
from loongforge_megatron.models.gpt.arch import Arch
from loongforge_megatron.models.lm import check_lm, no_compile, padded_vocab, tokenizer_assets
from loongforge_megatron.models.qwen_vl import names
from loongforge_megatron.models.qwen_vl.config import QwenVLDataConfig
from loongforge_megatron.models.spec import Data, HFConfig, Model, Supports
from loongforge_megatron.models.vision_component import check_own_ranks_recipe, check_vision_component

_TOKENS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
_VIT = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2,
            in_channels=3)
VISION_KEYS = ("depth", "hidden_size", "hidden_act", "intermediate_size", "num_heads", "in_channels", "patch_size",
               "spatial_merge_size", "temporal_patch_size", "tokens_per_second", "window_size", "out_hidden_size",
               "fullatt_block_indexes", "rope_parameters", "num_position_embeddings", "deepstack_visual_indexes")
_LM = dict(family="qwen2", vocab_size=152064, rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True,
           max_position_embeddings=128000)


def _preset(*, out: int, mrope: tuple[int, int, int] = (16, 24, 24), vit: dict | None = None, tokens: dict | None = None,
            **lm: Any) -> dict[str, Any]:
    return dict(_LM, **lm, vision=dict(vision_config=dict(vit or _VIT, out_hidden_size=out), mrope_section=list(mrope),
                                       **(tokens or _TOKENS)))


PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-vl-3b": _preset(out=2048, vocab_size=151936, num_layers=36, hidden_size=2048, ffn_hidden_size=11008, num_attention_heads=16, num_query_groups=2, tie_embeddings=True),
    "qwen2.5-vl-7b": _preset(out=3584, num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28, num_query_groups=4),
    "qwen2.5-vl-32b": _preset(out=5120, num_layers=64, hidden_size=5120, ffn_hidden_size=27648, num_attention_heads=40, num_query_groups=8),
    "qwen2.5-vl-72b": _preset(out=8192, num_layers=80, hidden_size=8192, ffn_hidden_size=29568, num_attention_heads=64, num_query_groups=8),
    "qwen2.5-vl-tiny": _preset(out=64, mrope=(2, 3, 3), vocab_size=320, num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, max_position_embeddings=512,
                               vit=dict(_VIT, depth=3, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, window_size=16, fullatt_block_indexes=[2]),
                               tokens=dict(image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303)),
}


# train.freeze's module groups: the tower (its patch merger included), the merger alone, the language model
GROUPS = {"vision": ("vision.",), "projector": ("vision.merger.",),
          "language": ("embedding.", "decoder.", "output_layer.")}


class QwenVLArch(Arch):
    """A Qwen2 language model plus ``vision``: ``vision_config`` (Qwen2_5_VLVisionConfig's fields), the special
    token ids and ``mrope_section``."""

    vision: dict

    @property
    def spec_name(self) -> str:
        if "deepstack_visual_indexes" not in self.vision["vision_config"]:
            return "qwen2_5_vl"
        return "qwen3_vl_moe" if self.is_moe else "qwen3_vl"

    def language(self) -> Arch:
        return Arch(**self.model_dump(exclude={"vision"}))

    def num_params(self) -> int:
        v = self.vision["vision_config"]
        d, f, merged = v["hidden_size"], v["intermediate_size"], v["hidden_size"] * v.get("spatial_merge_size", 2) ** 2
        block = 4 * d * d + (2 if "deepstack_visual_indexes" in v else 3) * d * f + 2 * d
        patch = d * v.get("in_channels", 3) * v.get("temporal_patch_size", 2) * v.get("patch_size", 14) ** 2
        mergers = 1 + len(v.get("deepstack_visual_indexes", []))
        return (super().num_params() + v["depth"] * block + patch
                + mergers * (merged * merged + merged * v["out_hidden_size"]))


class QwenVL(HFCheckpoint):
    groups = GROUPS
    """``Qwen2_5_VLForConditionalGeneration`` <-> :class:`~.model.QwenVLModel`."""

    name = "qwen2_5_vl"
    model_types = ("qwen2_5_vl",)
    presets = PRESETS
    kind = "a vision-language model"
    arch_type = QwenVLArch
    data_section = QwenVLDataConfig
    supports = Supports(models="Qwen-VL models", data_formats=("synthetic", "conversations"),
                        sft_formats=("conversations",), parallel=("tp", "sp", "cp", "pp", "ep", "etp", "components"),
                        layers=("auto", "loongforge", "local"))
    hf_architecture = "Qwen2_5_VLForConditionalGeneration"
    lm = qwen2.SPEC
    lm_family = "qwen2"
    lora_targets: dict[str, tuple[str, ...]] | None = None  # train.lora.targets -> the language model's linears
    encoder_ranks = True  # the tower may run on ranks of its own (parallel.components.vision.num_ranks)
    text_model_type, vision_model_type = "qwen2_5_vl_text", "qwen2_5_vl_vision"
    vision_acts: tuple[str, ...] = ("silu",)

    # ---------------------------------------------------------------- architecture
    def arch(self, fields: Any) -> QwenVLArch:
        return QwenVLArch(**{"family": self.lm_family, **fields})

    def arch_from_hf(self, cfg: HFConfig, *, path: Path) -> QwenVLArch:
        text = names.text_config(cfg)
        vision = dict(cfg.get("vision_config") or {})
        if vision.get("hidden_act", self.vision_acts[0]) not in self.vision_acts:
            raise RecipeError(f"{path}: a vision tower with hidden_act '{vision.get('hidden_act')}' is not supported "
                              f"({', '.join(self.vision_acts)})", key="model.hf")
        language = self.lm.arch_from_hf(text, path=path)
        tokens = {k: cfg[k] for k in _TOKENS if cfg.get(k) is not None}
        vision = {k: v for k, v in vision.items() if k in VISION_KEYS}
        rope = text.get("rope_parameters") or {}
        extra = {"mrope_interleaved": True} if rope.get("mrope_interleaved") else {}
        return self.arch({**language.model_dump(), "vision": {"vision_config": vision, **extra,
                                                              "mrope_section": names.mrope_section(cfg), **tokens}})

    def hf_config(self, arch: QwenVLArch, *, torch_dtype: str = "float32") -> HFConfig:
        v = arch.vision
        text = self.lm.hf_config(arch.language(), torch_dtype=torch_dtype)
        text.pop("architectures", None)
        theta = text.pop("rope_theta")
        rope = {"rope_type": "default", "rope_theta": theta, "mrope_section": list(v["mrope_section"])}
        if v.get("mrope_interleaved"):
            rope["mrope_interleaved"] = True
        text.update(model_type=self.text_model_type, rope_parameters=rope)
        vision = {"model_type": self.vision_model_type, "hidden_act": "silu", **v["vision_config"]}
        return {"architectures": [self.hf_architecture], "model_type": self.model_types[0], "text_config": text,
                "vision_config": vision, **{k: v[k] for k in _TOKENS if k in v},
                "tie_word_embeddings": arch.tie_embeddings, "torch_dtype": torch_dtype}

    # ---------------------------------------------------------------- HF checkpoint
    def complete_hf_config(self, cfg: HFConfig) -> HFConfig:
        return names.complete_config(cfg)

    def name_map(self, cfg: HFConfig, *, divisible_by: int = 128):
        return names.name_map(cfg, divisible_by=divisible_by)

    def text_config(self, cfg: HFConfig) -> HFConfig:
        return names.text_config(cfg)

    def hf_alias(self, name: str) -> str:
        return names.hf_alias(name)

    def config_checks(self, sizes: Any) -> None:
        """config.json's values no tensor shape shows (rotary sections, special token ids)."""
        names.config_checks(sizes)

    # NOTE: the tower has linears of the language model's names (Qwen2.5-VL's gate / up / down_proj)
    peft_module_paths = True

    def peft_name(self, name: str) -> str:
        return names.module_path(name)

    # ---------------------------------------------------------------- recipe checks
    def check(self, recipe: Any, plan: Any, arch: QwenVLArch) -> None:
        """Tensor (and sequence) / pipeline / context / data parallelism and the distributed optimizer; the vision
        component's own tp (a divisor of the language model's) and recompute."""
        from loongforge_megatron.engine.encoder_ranks import rank_sets
        from loongforge_megatron.freeze import check_names

        no_compile(recipe)
        check_names(recipe.train.freeze, groups=self.groups)
        check_vision_component(plan, heads=arch.vision["vision_config"]["num_heads"],
                               ffn=arch.vision["vision_config"]["intermediate_size"], own_ranks=self.encoder_ranks,
                               family=self.name)
        sets = rank_sets(plan)
        if sets is not None:  # NOTE: the rest is the language model's, on its own ranks
            check_own_ranks_recipe(recipe, plan)
            plan = sets.language
        # NOTE: expert parallelism splits a MoE language model's experts (Qwen3-VL-MoE); the tower is replicated over ep
        if plan.ep != 1 and not arch.is_moe:
            raise RecipeError(f"Qwen-VL models train with tensor, sequence, context, pipeline, data and (MoE "
                              f"language models) expert parallelism (got {plan.ep})", key="parallel.ep")
        if recipe.train.eval_interval:
            raise RecipeError("Qwen-VL models have no validation pass yet; remove train.eval_interval",
                              key="train.eval_interval")
        check_provider(recipe)  # NOTE: an explicit provider serves every op of the loongforge spec, fused CE too
        if arch.rope_scaling_factor is not None or arch.rope_yarn:
            raise RecipeError("Qwen-VL with rope scaling is not supported", key="model")
        deep = len(arch.vision["vision_config"].get("deepstack_visual_indexes", []))
        if plan.pp > 1 and deep:
            first = plan.first_stage_layers or arch.num_layers // plan.pp
            if first < deep:
                raise RecipeError(f"the {deep} deepstack layers must be on the first pipeline stage (it holds "
                                  f"{first}); set parallel.first_stage_layers >= {deep}", key="parallel.pp")
        self.lm.check_family(recipe, plan, arch)
        check_lm(recipe, plan, arch)

    # ---------------------------------------------------------------- training
    def data(self, *, recipe: Any, arch: QwenVLArch, runtime: Any, device: Any) -> Data:
        from loongforge_megatron.engine.encoder_ranks import language_plan
        from loongforge_megatron.models.qwen_vl.data import Conversations, SyntheticImageText, load_processor
        from loongforge_megatron.models.qwen_vl.records import MAX_IMAGE_PIXELS

        seq, seed = recipe.data.seq_length, recipe.train.seed
        if recipe.data.format == "conversations":
            processor = load_processor(recipe.data.tokenizer or recipe.model.tokenizer or recipe.model.hf
                                       or recipe.checkpoint.load)
            if len(processor.tokenizer) > arch.vocab_size:
                raise RecipeError(f"tokenizer has {len(processor.tokenizer)} tokens but the model's vocab_size is "
                                  f"{arch.vocab_size}", key="model.vocab_size")
            # NOTE: context parallelism cuts every packed record into 2 * cp chunks, sequence parallelism a row's
            # tokens into tp slices
            plan = language_plan(runtime.plan)
            train = Conversations(recipe.data.path, processor=processor, arch=arch, seq_length=seq, seed=seed,
                                  pack=recipe.data.pack is not False, fill=plan.pp > 1,
                                  multiple_of=(2 * plan.cp if plan.cp > 1 else 1) * (plan.tp if plan.sp else 1),
                                  max_image_pixels=recipe.data.max_image_pixels or MAX_IMAGE_PIXELS,
                                  skip_unsupervised=bool(recipe.data.skip_unsupervised))
            return Data(train=train, seq_length=seq, tokenizer=processor.tokenizer, assets=tokenizer_assets(recipe))
        return Data(train=SyntheticImageText(arch=arch, seq_length=seq, seed=seed, side=recipe.data.image_size),
                    seq_length=seq)

    def language_layers(self, *, recipe: Any, arch: QwenVLArch, plan: Any, accelerator: Any, config: Any,
                        precision: str) -> tuple[Any, str]:
        """(the language model's layer spec or per-chunk block spec builder, its layer set): the GPT layers of
        ``kernels.layers``; a family with layers of its own (a hybrid language model) overrides this."""
        from loongforge_megatron.layers.selection import decoder_layers, moe_kernels

        # NOTE: auto is the loongforge spec: its attention takes packed rows as cu_seqlens (varlen_attn on CUDA);
        # megatron's local one needs a [t, t] mask for them
        spec_name = "local" if recipe.kernels.layers == "local" else "loongforge"
        # NOTE: a MoE language model gets the GPT families' expert kernels (grouped experts, permute dispatch)
        moe = moe_kernels(recipe, arch, plan, accelerator=accelerator, config=config, spec_name=spec_name,
                          precision=precision) if arch.is_moe else None
        return decoder_layers(config, arch, spec_name=spec_name, provider=recipe.kernels.provider,
                              accelerator=accelerator, moe=moe), spec_name

    def model(self, *, recipe: Any, arch: QwenVLArch, plan: Any, accelerator: Any, device: Any, precision: str,
              data: Data) -> Model:
        import torch.distributed as dist

        from loongforge_megatron.engine.component_groups import component_groups
        from loongforge_megatron.engine.encoder_ranks import rank_sets
        from loongforge_megatron.engine.weights import seeded_init
        from loongforge_megatron.layers.output import mask_padded_vocab
        from loongforge_megatron.models.gpt.translate import transformer_config
        from loongforge_megatron.models.qwen_vl.model import VISION_PREFIXES, build_qwen_vl, forward_step

        sets = rank_sets(plan)
        if sets is not None:
            plan = sets.language
        config = transformer_config(arch.language(), plan=plan, precision=precision,
                                    cpu_init=accelerator.device_type == "cpu" or recipe.model.init_on_cpu,
                                    grad_accum_fusion=recipe.kernels.grad_accum_fusion)
        # NOTE: tells the attention that the rotary frequencies are per token (multimodal RoPE)
        config.mrope_section = list(arch.vision["mrope_section"])
        spec, spec_name = self.language_layers(recipe=recipe, arch=arch, plan=plan, accelerator=accelerator,
                                               config=config, precision=precision)
        if sets is not None and sets.on_encoder(dist.get_rank()):
            return self._encoder_model(recipe=recipe, arch=arch, sets=sets, config=config, device=device)
        # NOTE: a tower the plan does not lay out is whole, its copies in a TP group encoding different images
        groups = component_groups(plan, "vision", default_tp=1) if sets is None else None
        chunks = build_qwen_vl(config=config, arch=arch, layer_spec=spec, vocab_size=padded_vocab(arch.vocab_size, plan.tp),
                               max_sequence_length=max(arch.max_position_embeddings, recipe.data.seq_length),
                               device=device, vpp=plan.vpp, vision_groups=groups, remote_encoder=sets is not None)
        seeded_init(chunks, config=config, seed=recipe.train.seed)
        mask_padded_vocab(chunks, vocab_size=arch.vocab_size)
        if groups is None:  # NOTE: the tower is whole on the encoder ranks
            whole = VISION_PREFIXES if plan.tp > 1 else ()
        else:
            whole = groups.checkpoint_entries(VISION_PREFIXES, tp=plan.tp)
        step = forward_step
        if spec_name == "loongforge":  # NOTE: the LLM's output path: no [tokens, vocab] logits, grads in the forward
            from loongforge_megatron.layers.output import fused_output_processor

            step = functools.partial(forward_step, output_processor=functools.partial(
                fused_output_processor, provider=recipe.kernels.provider, accelerator=accelerator))
        return Model(chunks=chunks, config=config, kernels=spec_name, forward_step=step, groups=self.groups,
                     whole=whole, timed_encoder=True, lora_targets=self.lora_targets)


    def _encoder_model(self, *, recipe: Any, arch: QwenVLArch, sets: Any, config: Any, device: Any) -> Model:
        """An encoder rank's model: the tower alone (``engine/encoder_ranks.py``)."""
        from loongforge_megatron.engine.weights import seeded_init
        from loongforge_megatron.models.qwen_vl.model import VISION_PREFIXES, QwenVLEncoder

        chunk = QwenVLEncoder(vision_config=arch.vision["vision_config"], config=config,
                              recompute=sets.encoder.recompute)
        chunk.vision.to(dtype=config.params_dtype)
        chunk.to(device)
        seeded_init([chunk], config=config, seed=recipe.train.seed)
        return Model(chunks=[chunk], config=config, kernels="encoder", groups=self.groups,
                     whole=VISION_PREFIXES if sets.language.tp > 1 else (), timed_encoder=True)


_TOKENS3 = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
_VIT3 = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, spatial_merge_size=2,
             temporal_patch_size=2, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
             hidden_act="gelu_pytorch_tanh", in_channels=3)
_VIT3_SMALL = dict(_VIT3, depth=24, hidden_size=1024, intermediate_size=4096, deepstack_visual_indexes=[5, 11, 17])
_LM3 = dict(family="qwen3", vocab_size=151936, rope_theta=5000000.0, norm_eps=1e-6, qk_norm=True, head_dim=128,
            max_position_embeddings=262144)


def _preset3(*, out: int, vit: dict = _VIT3, **lm: Any) -> dict[str, Any]:
    return dict(_LM3, **lm, vision=dict(vision_config=dict(vit, out_hidden_size=out), mrope_section=[24, 20, 20],
                                        mrope_interleaved=True, **_TOKENS3))


PRESETS3: dict[str, dict[str, Any]] = {
    "qwen3-vl-2b": _preset3(out=2048, vit=_VIT3_SMALL, num_layers=28, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16, num_query_groups=8, tie_embeddings=True),
    "qwen3-vl-4b": _preset3(out=2560, vit=_VIT3_SMALL, num_layers=36, hidden_size=2560, ffn_hidden_size=9728, num_attention_heads=32, num_query_groups=8, tie_embeddings=True),
    "qwen3-vl-8b": _preset3(out=4096, num_layers=36, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=32, num_query_groups=8),
    "qwen3-vl-32b": _preset3(out=5120, num_layers=64, hidden_size=5120, ffn_hidden_size=25600, num_attention_heads=64, num_query_groups=8),
    "qwen3-vl-tiny": dict(_LM3, vocab_size=320, num_layers=4, hidden_size=64, head_dim=16, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, max_position_embeddings=512,
                          vision=dict(vision_config=dict(_VIT3, depth=3, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, num_position_embeddings=16, deepstack_visual_indexes=[0, 1], out_hidden_size=64),
                                      mrope_section=[2, 3, 3], mrope_interleaved=True, image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303)),
}


class Qwen3VL(QwenVL):
    """``Qwen3VLForConditionalGeneration`` <-> :class:`~.model.QwenVLModel` (deepstack, interleaved MRoPE)."""

    name = "qwen3_vl"
    model_types = ("qwen3_vl",)
    presets = PRESETS3
    hf_architecture = "Qwen3VLForConditionalGeneration"
    lm = qwen3.SPEC
    lm_family = "qwen3"
    encoder_ranks = False  # NOTE: the deepstack features would travel with the embeddings: not done
    text_model_type, vision_model_type = "qwen3_vl_text", "qwen3_vl_vision"
    vision_acts = ("gelu_pytorch_tanh", "gelu", "silu")
    groups = {**GROUPS, "projector": ("vision.merger.", "vision.deepstack_merger_list.")}

    def name_map(self, cfg: HFConfig, *, divisible_by: int = 128):
        return names.name_map_3(cfg, divisible_by=divisible_by)

    def hf_alias(self, name: str) -> str:
        return name

    def peft_name(self, name: str) -> str:
        return name

    def hf_config(self, arch: QwenVLArch, *, torch_dtype: str = "float32") -> HFConfig:
        cfg = super().hf_config(arch, torch_dtype=torch_dtype)
        cfg["vision_config"]["hidden_act"] = arch.vision["vision_config"].get("hidden_act", "gelu_pytorch_tanh")
        return cfg


_MOE_30B = dict(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32, num_query_groups=4,
                num_experts=128, moe_topk=8, moe_ffn_hidden_size=768)
PRESETS3_MOE: dict[str, dict[str, Any]] = {
    "qwen3-vl-30b-a3b": _preset3(out=2048, family="qwen3_moe", **_MOE_30B),
    "qwen3-vl-235b-a22b": _preset3(out=4096, family="qwen3_moe", num_layers=94, hidden_size=4096, ffn_hidden_size=12288, num_attention_heads=64, num_query_groups=4, num_experts=128, moe_topk=8, moe_ffn_hidden_size=1536),
    "qwen3-vl-moe-tiny": dict(PRESETS3["qwen3-vl-tiny"], family="qwen3_moe", num_experts=4, moe_topk=2, moe_ffn_hidden_size=32),
}


class Qwen3VLMoe(Qwen3VL):
    """``Qwen3VLMoeForConditionalGeneration`` <-> :class:`~.model.QwenVLModel` with a Qwen3-MoE language model
    (megatron's MoE layers: router, experts over ``parallel.ep``; every layer sparse). The checkpoint's experts are
    3-D ``gate_up_proj`` / ``down_proj`` tensors (:class:`~loongforge.checkpoint.FusedExperts`); its router
    always renormalises the top-k probabilities (no ``norm_topk_prob``)."""

    name = "qwen3_vl_moe"
    model_types = ("qwen3_vl_moe",)
    presets = PRESETS3_MOE
    hf_architecture = "Qwen3VLMoeForConditionalGeneration"
    lm = qwen3_moe.SPEC
    lm_family = "qwen3_moe"
    text_model_type, vision_model_type = "qwen3_vl_moe_text", "qwen3_vl_moe_vision"

    def arch_from_hf(self, cfg: HFConfig, *, path: Path) -> QwenVLArch:
        cfg = {**cfg, "text_config": {**names.text_config(cfg), "norm_topk_prob": True}}
        return super().arch_from_hf(cfg, path=path)

    def hf_config(self, arch: QwenVLArch, *, torch_dtype: str = "float32") -> HFConfig:
        cfg = super().hf_config(arch, torch_dtype=torch_dtype)
        cfg["text_config"].pop("norm_topk_prob", None)
        return cfg

    def name_map(self, cfg: HFConfig, *, divisible_by: int = 128):
        return names.name_map_3(cfg, divisible_by=divisible_by, moe=True)

    def num_experts(self, cfg: HFConfig) -> int:
        return qwen3_moe.num_experts(names.text_config(cfg))

    def check(self, recipe: Any, plan: Any, arch: QwenVLArch) -> None:
        super().check(recipe, plan, arch)
        lora = recipe.train.lora if recipe.train.stage == "lora" else None
        if lora is not None and "peft" in recipe.checkpoint.save_format and {"fc1", "fc2"} & set(lora.targets):
            raise RecipeError("a PEFT export has no adapter names for Qwen3-VL-MoE's fused experts: "
                              "train.lora.targets [qkv, proj], or checkpoint.save_format hf (adapters merged)",
                              key="train.lora.targets")


SPEC = QwenVL()
SPEC3 = Qwen3VL()
SPEC3_MOE = Qwen3VLMoe()
