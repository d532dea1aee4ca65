"""Build LeRobot's ``PI05Pytorch`` from our arch: the ``PI05Config`` and, for shrunken test models, the
construction-time adaptations that redirect LeRobot's size lookups.

Why the shrinking needs two adaptations (LeRobot 0.6.1): ``PI05Pytorch`` takes its Gemma sizes from
``get_gemma_config(variant)`` (only ``gemma_2b`` / ``gemma_300m``), and ``PaliGemmaWithExpertModel`` always builds
the SigLIP So400m/14 tower with ``projection_dim`` 2048 — the image tokens are 2048 wide whatever the language
model's width (which is why ``paligemma_variant=gemma_300m`` fails in forward: 2048-wide image embeddings are
concatenated with 1024-wide token embeddings). A shrunken model therefore redirects ``get_gemma_config`` and
wraps ``PaliGemmaForConditionalGenerationWithPiGemma`` to rewrite the vision sizes and the projection width
before the module is created. Both are named, checked, reversible adaptations (``loongforge.accelerator.
adaptation``) applied only while the model is constructed.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from loongforge.accelerator.adaptation import Adaptation, AdaptationSet, replace_attr

from loongforge_embodied.policies.lerobot_pi05.configuration_lerobot_pi05 import LeRobotPI05Arch

MODELING = "lerobot.policies.pi05.modeling_pi05"


def source_has(*needles: str) -> Callable[[Any], bool]:
    """An ``expect`` for :func:`replace_attr`: the replaced object's source still contains every needle
    (checked once per object: the answer cannot change while the process runs)."""

    @functools.cache
    def _check(obj: Any) -> bool:
        try:
            source = inspect.getsource(obj)
        except (OSError, TypeError):
            return False
        return all(n in source for n in needles)

    return lambda original: _check(getattr(original, "__func__", original))


def pi05_config(arch: LeRobotPI05Arch, *, cameras: list[str] | None = None):
    """LeRobot's ``PI05Config`` for ``arch`` (features: ``cameras``, the state and the action, unpadded)."""
    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.policies.pi05.configuration_pi05 import PI05Config

    cams = cameras or [f"observation.images.cam{i}" for i in range(arch.num_cameras)]
    inputs = {k: PolicyFeature(type=FeatureType.VISUAL, shape=(3, arch.resolution, arch.resolution)) for k in cams}
    inputs["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(arch.state_dim,))
    mode = NormalizationMode.QUANTILES if arch.quantile_norm else NormalizationMode.MEAN_STD
    return PI05Config(
        paligemma_variant=arch.paligemma_variant, action_expert_variant=arch.action_expert_variant,
        dtype="bfloat16" if arch.bf16_params else "float32",
        chunk_size=arch.chunk_size, n_action_steps=arch.chunk_size, max_state_dim=arch.max_state_dim,
        max_action_dim=arch.max_action_dim, num_inference_steps=arch.num_inference_steps,
        image_resolution=(arch.resolution, arch.resolution), tokenizer_max_length=arch.tokenizer_max_length,
        normalization_mapping={"VISUAL": NormalizationMode.IDENTITY, "STATE": mode, "ACTION": mode},
        device="cpu", input_features=inputs,
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(arch.action_dim,))},
    )


def _gemma_sizes(arch: LeRobotPI05Arch, original: Callable, variant: str):
    """``get_gemma_config`` of a shrunken model: the prefix variant gets ``lm_*``, the expert ``expert_*``."""
    from lerobot.policies.pi05.modeling_pi05 import GemmaConfig

    from loongforge_embodied.policies.lerobot_pi05.configuration_lerobot_pi05 import NUM_HEADS, NUM_KV_HEADS

    original(variant)  # unknown variants still fail the way LeRobot fails
    if variant == arch.paligemma_variant:
        return GemmaConfig(arch.lm_width, arch.lm_depth, arch.lm_mlp, NUM_HEADS, NUM_KV_HEADS, arch.head_dim)
    return GemmaConfig(arch.expert_width, arch.expert_depth, arch.expert_mlp, NUM_HEADS, NUM_KV_HEADS, arch.head_dim)


def _shrunk_paligemma(arch: LeRobotPI05Arch, original: type, config):
    """Create PaliGemma with ``arch``'s vision sizes and image tokens as wide as the language model."""
    v = config.vision_config
    v.hidden_size, v.num_hidden_layers, v.num_attention_heads = arch.vision_width, arch.vision_depth, arch.vision_heads
    v.intermediate_size, v.patch_size = arch.vision_mlp, arch.patch_size
    config.projection_dim = v.projection_dim = config.text_config.hidden_size
    config.text_config.num_image_tokens = (v.image_size // v.patch_size) ** 2
    return original(config=config)


def size_adaptations(arch: LeRobotPI05Arch) -> list[Adaptation]:
    """The construction-time adaptations of a shrunken ``arch`` (none for LeRobot's real sizes)."""
    if not arch.shrunk:
        return []
    return [
        replace_attr(
            "pi05-gemma-sizes", f"{MODELING}.get_gemma_config",
            lambda original: functools.partial(_gemma_sizes, arch, original),
            description="Gemma widths/depths of a shrunken pi05 (LeRobot knows only gemma_2b and gemma_300m)",
            expect=source_has('variant == "gemma_300m"', 'variant == "gemma_2b"', "num_kv_heads="),
        ),
        replace_attr(
            "pi05-vision-sizes", f"{MODELING}.PaliGemmaForConditionalGenerationWithPiGemma",
            lambda original: functools.partial(_shrunk_paligemma, arch, original),
            description="SigLIP sizes and the image-projection width of a shrunken pi05 (LeRobot fixes So400m, 2048)",
            expect=lambda _original: source_has("projection_dim = 2048", "PaliGemmaForConditionalGenerationWithPiGemma(")(
                _paligemma_with_expert_init()),
        ),
    ]


def _paligemma_with_expert_init():
    from lerobot.policies.pi05.modeling_pi05 import PaliGemmaWithExpertModel

    return PaliGemmaWithExpertModel.__init__


def build_pi05(arch: LeRobotPI05Arch, *, cameras: list[str] | None = None):
    """LeRobot's ``PI05Pytorch`` (random init, LeRobot's dtype split) and its ``PI05Config``."""
    from lerobot.policies.pi05.modeling_pi05 import PI05Pytorch

    config = pi05_config(arch, cameras=cameras)
    with AdaptationSet(size_adaptations(arch)):
        return PI05Pytorch(config), config


def shrunk_sizes(arch: LeRobotPI05Arch) -> AdaptationSet:
    """For loading an export of a shrunken model with LeRobot's own ``PI05Policy.from_pretrained``:
    ``with shrunk_sizes(arch): PI05Policy.from_pretrained(dir)``."""
    return AdaptationSet(size_adaptations(arch))
