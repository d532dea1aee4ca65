"""The Qwen3.5 VLMs (``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``): the Qwen-VL model
of ``models/qwen_vl`` (its Qwen3-VL vision tower, multimodal RoPE, image / video records) on a Qwen3.5 hybrid
language model (``qwen3_5.py``): gated DeltaNet and gated full attention layers, RoPE on a quarter of each head.

The tower is Qwen3-VL's without deepstack features (``deepstack_visual_indexes`` empty); the checkpoint files use
transformers' module paths (``model.visual.*``, ``model.language_model.*``, ``lm_head``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongforge.errors import RecipeError

from loongforge_megatron.models.hybrid import qwen3_5
from loongforge_megatron.models.hybrid.arch import HybridArch
from loongforge_megatron.models.hybrid.config import HybridModelConfig
from loongforge_megatron.models.hybrid.family import LORA_TARGETS
from loongforge_megatron.models.qwen_vl import names as vl_names
from loongforge_megatron.models.qwen_vl.spec import Qwen3VL, QwenVLArch
from loongforge_megatron.models.spec import HFConfig

_TOKENS = dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053, vision_end_token_id=248054)
# transformers' Qwen3_5VisionConfig defaults (its docs' checkpoint: Qwen/Qwen3.5-27B); out_hidden_size: the LM's width
_VIT = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, spatial_merge_size=2,
            temporal_patch_size=2, num_position_embeddings=2304, hidden_act="gelu_pytorch_tanh", in_channels=3,
            deepstack_visual_indexes=[])


def _vl(lm: dict[str, Any], *, vit: dict[str, Any] = _VIT, tokens: dict[str, int] = _TOKENS,
        mrope: tuple[int, int, int] = (11, 11, 10)) -> dict[str, Any]:
    return dict(lm, vision=dict(vision_config=dict(vit, out_hidden_size=lm["hidden_size"]), mrope_section=list(mrope),
                                mrope_interleaved=True, **tokens))


_TINY_VIT = dict(_VIT, depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4,
                 num_position_embeddings=16)
_TINY_TOKENS = dict(image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303)
_TINY = dict(vocab_size=320, head_dim=32, max_position_embeddings=512)

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.5-vl-27b": _vl(qwen3_5.DENSE_PRESETS["qwen3.5-27b"]),
    "qwen3.5-vl-tiny": _vl(dict(qwen3_5.DENSE_PRESETS["qwen3.5-tiny"], **_TINY), vit=_TINY_VIT, tokens=_TINY_TOKENS,
                           mrope=(2, 1, 1)),
}
MOE_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.5-vl-35b-a3b": _vl(qwen3_5.MOE_PRESETS["qwen3.5-35b-a3b"]),
    "qwen3.5-vl-397b-a17b": _vl(qwen3_5.MOE_PRESETS["qwen3.5-397b-a17b"]),
    "qwen3.5-vl-moe-tiny": _vl(dict(qwen3_5.MOE_PRESETS["qwen3.5-moe-tiny"], **_TINY), vit=_TINY_VIT,
                               tokens=_TINY_TOKENS, mrope=(2, 1, 1)),
}


class HybridVLArch(QwenVLArch, HybridArch):
    """A Qwen3.5 language model (:class:`HybridArch`) plus the Qwen-VL ``vision`` fields."""

    @property
    def spec_name(self) -> str:
        return f"{self.family}_vl"

    def language(self) -> HybridArch:
        return HybridArch(**self.model_dump(exclude={"vision"}))


class Qwen3_5VL(Qwen3VL):
    """``Qwen3_5ForConditionalGeneration`` <-> the Qwen-VL model with Qwen3.5's hybrid layers."""

    name = "qwen3_5_vl"
    kind = "a hybrid (gated DeltaNet + attention) vision-language model"
    model_types = ("qwen3_5",)
    presets = PRESETS
    arch_type = HybridVLArch
    model_section = HybridModelConfig
    hf_architecture = "Qwen3_5ForConditionalGeneration"
    lm = qwen3_5.SPEC
    lm_family = "qwen3_5"
    text_model_type, vision_model_type = "qwen3_5_text", "qwen3_5_vision"
    lora_targets = LORA_TARGETS

    def arch(self, fields: Any) -> HybridVLArch:
        return HybridVLArch(**{"family": self.lm_family, **fields})

    def arch_from_hf(self, cfg: HFConfig, *, path: Path) -> HybridVLArch:
        arch = super().arch_from_hf(cfg, path=path)
        # NOTE: Qwen3-VL's tower with no deepstack taps is Qwen3.5's (same names, same blocks and mergers)
        vision = {**arch.vision, "vision_config": {**arch.vision["vision_config"], "deepstack_visual_indexes": []}}
        return self.arch({**arch.model_dump(), "vision": vision})

    def hf_config(self, arch: HybridVLArch, *, torch_dtype: str = "float32") -> HFConfig:
        v = arch.vision
        text = self.lm.hf_config(arch.language(), torch_dtype=torch_dtype)
        text.pop("architectures", None)
        text["model_type"] = self.text_model_type
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(v["mrope_section"]),
                                   "mrope_interleaved": bool(v.get("mrope_interleaved", True))}
        vision = {k: x for k, x in v["vision_config"].items() if k != "deepstack_visual_indexes"}
        vision = {"model_type": self.vision_model_type, "hidden_act": "gelu_pytorch_tanh", **vision}
        tokens = {k: v[k] for k in _TOKENS if k in v}
        return {"architectures": [self.hf_architecture], "model_type": self.model_types[0], "text_config": text,
                "vision_config": vision, **tokens, "tie_word_embeddings": arch.tie_embeddings,
                "torch_dtype": torch_dtype}

    def name_map(self, cfg: HFConfig, *, divisible_by: int = 128):
        # NOTE: the multi-token-prediction layer a checkpoint holds (the layout's count) is the language model's
        text = {**vl_names.text_config(cfg), "num_nextn_predict_layers": cfg.get("num_nextn_predict_layers") or 0}
        return vl_names.with_tower(cfg, self.lm.name_map(text, divisible_by=divisible_by))

    def mtp_layers_in(self, cfg: HFConfig, names: list[str]) -> int:
        return self.lm.mtp_layers_in(vl_names.text_config(cfg), names)

    def check(self, recipe: Any, plan: Any, arch: HybridVLArch) -> None:
        if arch.mtp_num_layers:
            raise RecipeError(f"model.mtp_num_layers: the {self.name} model trains without its multi-token-prediction "
                              "layer (a conversion keeps it); set 0", key="model.mtp_num_layers")
        super().check(recipe, plan, arch)

    def num_experts(self, cfg: HFConfig) -> int:
        return self.lm.num_experts(vl_names.text_config(cfg))

    def ignore_hf(self, cfg: HFConfig, name: str) -> bool:
        return super().ignore_hf(cfg, name) or self.lm.ignore_hf(vl_names.text_config(cfg), name)

    def language_layers(self, *, recipe: Any, arch: HybridVLArch, plan: Any, accelerator: Any, config: Any,
                        precision: str) -> tuple[Any, str]:
        # NOTE: the hybrid layers are megatron's local layers with ours in them (packed rows through cu_seqlens)
        return self.lm.layer_spec(recipe=recipe, arch=arch.language(), plan=plan, accelerator=accelerator,
                                  config=config, precision=precision), "local"


class Qwen3_5MoeVL(Qwen3_5VL):
    """``Qwen3_5MoeForConditionalGeneration``: MoE layers with a gated shared expert (experts over
    ``parallel.ep``)."""

    name = "qwen3_5_moe_vl"
    model_types = ("qwen3_5_moe",)
    presets = MOE_PRESETS
    hf_architecture = "Qwen3_5MoeForConditionalGeneration"
    lm = qwen3_5.SPEC_MOE
    lm_family = "qwen3_5_moe"
    text_model_type, vision_model_type = "qwen3_5_moe_text", "qwen3_5_moe_vision"


SPEC = Qwen3_5VL()
SPEC_MOE = Qwen3_5MoeVL()
