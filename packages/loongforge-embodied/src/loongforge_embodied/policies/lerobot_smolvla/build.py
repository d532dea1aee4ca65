"""LeRobot's ``SmolVLAConfig`` / ``VLAFlowMatching`` of an arch, and the one library adaptation a run applies.

LeRobot builds the VLM from its Hugging Face directory (``AutoConfig`` / ``AutoProcessor.from_pretrained(vlm)``):
we hand it the local folder (or cached snapshot) of ``arch.vlm``, so nothing is downloaded.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from loongforge.accelerator.adaptation import Adaptation, AdaptationSet, replace_attr

from loongforge_embodied.policies.lerobot_smolvla.configuration_lerobot_smolvla import (
    LeRobotSmolVLAArch,
    local_vlm,
)

WITH_EXPERT = "lerobot.policies.smolvla.smolvlm_with_expert"
CACHE_NAME = "smolvla-cache-crop"


def smolvla_config(arch: LeRobotSmolVLAArch, *, cameras: list[str] | None = None, state_key: str = "observation.state",
                   vlm: str | None = None):
    """LeRobot's ``SmolVLAConfig`` for ``arch`` (features: ``cameras``, the state and the action, unpadded).
    ``vlm``: the VLM's name written into the config (default: the local folder LeRobot reads it from)."""
    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig

    cams = cameras or [f"observation.images.cam{i}" for i in range(arch.num_cameras)]
    inputs = {k: PolicyFeature(type=FeatureType.VISUAL, shape=(3, arch.image_size, arch.image_size)) for k in cams}
    inputs[state_key] = PolicyFeature(type=FeatureType.STATE, shape=(arch.state_dim,))
    return SmolVLAConfig(
        chunk_size=arch.chunk_size, n_action_steps=arch.chunk_size, max_state_dim=arch.max_state_dim,
        max_action_dim=arch.max_action_dim, resize_imgs_with_padding=(arch.resolution, arch.resolution),
        tokenizer_max_length=arch.tokenizer_max_length, pad_language_to=arch.pad_language_to, num_steps=arch.num_steps,
        vlm_model_name=vlm or local_vlm(arch.vlm) or arch.vlm, load_vlm_weights=bool(arch.load_vlm_weights),
        num_vlm_layers=arch.num_vlm_layers, num_expert_layers=arch.num_expert_layers or -1,
        self_attn_every_n_layers=arch.self_attn_every_n_layers or -1,
        expert_width_multiplier=arch.expert_width_percent / 100, attention_mode=arch.attention_mode,
        add_image_special_tokens=bool(arch.add_image_special_tokens),
        # NOTE: what trains is the recipe's model.freeze (the published recipe freezes vision + language, LeRobot's
        # train_expert_only); LeRobot still freezes what cannot reach the loss (lm_head, final norm, last layer)
        freeze_vision_encoder=False, train_expert_only=False,
        normalization_mapping={"VISUAL": NormalizationMode.IDENTITY, "STATE": NormalizationMode.MEAN_STD,
                               "ACTION": NormalizationMode.MEAN_STD},
        device="cpu", input_features=inputs,
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(arch.action_dim,))},
    )


def build_smolvla(arch: LeRobotSmolVLAArch, *, cameras: list[str] | None = None):
    """LeRobot's ``VLAFlowMatching`` (random init unless ``load_vlm_weights``) and its ``SmolVLAConfig``."""
    import contextlib
    import io

    from lerobot.policies.smolvla.modeling_smolvla import VLAFlowMatching

    config = smolvla_config(arch, cameras=cameras)
    config.validate_features()
    with contextlib.redirect_stdout(io.StringIO()):  # NOTE: LeRobot prints "Reducing the number of VLM layers"
        return VLAFlowMatching(config), config


def source_has(*needles: str):
    """An ``expect`` for :func:`replace_attr`: the replaced object's source still contains every needle."""

    @functools.cache
    def _check(obj: Any) -> bool:
        try:
            source = inspect.getsource(obj)
        except (OSError, TypeError):
            return False
        return all(n in source for n in needles)

    return lambda original: _check(getattr(original, "__func__", original))


def _cache_class(original: type) -> type:
    class PrefixCroppedCache(original):
        """``crop(n)`` with n > 0 keeps each layer's first n tokens (transformers < 5's meaning, which LeRobot's
        ``denoise_step`` relies on); layers shorter than n are left alone."""

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove <= 0:
                return super().crop(tokens_to_remove)
            for layer in self.layers:
                if getattr(layer, "is_initialized", False):
                    extra = layer.keys.shape[-2] - tokens_to_remove
                    if extra > 0:
                        layer.crop(-extra)
            return None

    PrefixCroppedCache.__wrapped__ = original
    return PrefixCroppedCache


def cache_crop_adaptation() -> Adaptation | None:
    """LeRobot 0.6.1's SmolVLA sampler restores its prefix cache with ``DynamicCache.crop(prefix_len)``, which
    transformers >= 5.6 refuses (a positive ``crop`` means "keep n" no more); none needed below that."""
    from transformers import DynamicCache

    if "tokens_to_remove" not in inspect.signature(DynamicCache.crop).parameters:
        return None
    return replace_attr(
        CACHE_NAME, f"{WITH_EXPERT}.DynamicCache", _cache_class,
        description="SmolVLA's prefix KV cache: crop(prefix_len) keeps the prefix under transformers >= 5.6",
        expect=lambda original: isinstance(original, type)
        and source_has("past_key_values.crop(prefix_len)")(_denoise_step())
        and source_has("past_key_values = DynamicCache()")(_with_expert_forward()),
    )


def _denoise_step():
    from lerobot.policies.smolvla.modeling_smolvla import VLAFlowMatching

    return VLAFlowMatching.denoise_step


def _with_expert_forward():
    from lerobot.policies.smolvla.smolvlm_with_expert import SmolVLMWithExpertModel

    return SmolVLMWithExpertModel.forward


def adaptations() -> list[Adaptation]:
    """What a run of this policy (and LeRobot's own ``SmolVLAPolicy`` sampling next to it) needs of the installed
    libraries."""
    return [a for a in (cache_crop_adaptation(),) if a is not None]


def adapted() -> AdaptationSet:
    """``with adapted(): SmolVLAPolicy.from_pretrained(DIR).select_action(...)`` under transformers >= 5.6."""
    return AdaptationSet(adaptations())
