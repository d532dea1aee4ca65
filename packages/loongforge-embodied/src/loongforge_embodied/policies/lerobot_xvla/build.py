"""LeRobot's ``XVLAConfig`` / ``XVLAModel`` of an arch.

LeRobot builds Florence-2 from the ``florence_config`` dict its config carries (what a published X-VLA
``config.json`` holds); we read that dict from the ``config.json`` of ``arch.florence`` (a local folder or the cached
snapshot of a hub id: nothing is downloaded), and the tokenizer LeRobot's processor loads is ``arch.tokenizer``'s.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from loongforge_embodied.policies.lerobot_xvla.configuration_lerobot_xvla import LeRobotXVLAArch, local_dir

FLORENCE_FILES = ("config.json",)
TOKENIZER_FILES = ("tokenizer_config.json",)


@functools.cache
def florence_config(name: str) -> dict:
    """The Florence-2 config dict of ``name`` (native transformers or Microsoft's remote-code layout: LeRobot
    translates either)."""
    from loongforge.errors import RecipeError

    folder = local_dir(name, FLORENCE_FILES)
    if folder is None:
        raise RecipeError(f"'{name}': no local folder with config.json, and no such hub id in the local Hugging Face "
                          "cache; name a local Florence-2 directory", key="model.arch.florence")
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise RecipeError(f"'{name}': config.json does not read as JSON ({exc})", key="model.arch.florence") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("vision_config"), dict) \
            or not isinstance(cfg.get("text_config"), dict):
        raise RecipeError(f"'{name}': config.json has no vision_config and text_config (not a Florence-2 config)",
                          key="model.arch.florence")
    return cfg


def xvla_config(arch: LeRobotXVLAArch, *, cameras: list[str] | None = None, state_key: str = "observation.state",
                florence: dict | None = None):
    """LeRobot's ``XVLAConfig`` for ``arch`` (features: ``cameras``, the state and the action, unpadded).
    ``florence``: the Florence-2 config dict (default: read from ``arch.florence``)."""
    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.policies.xvla.configuration_xvla import XVLAConfig

    cams = cameras or [f"observation.images.cam{i}" for i in range(arch.num_cameras)]
    inputs = {k: PolicyFeature(type=FeatureType.VISUAL, shape=(3, arch.image_size, arch.image_size)) for k in cams}
    inputs[state_key] = PolicyFeature(type=FeatureType.STATE, shape=(arch.state_dim,))
    mode = NormalizationMode.MEAN_STD if arch.normalization == "mean_std" else NormalizationMode.IDENTITY
    return XVLAConfig(
        chunk_size=arch.chunk_size, n_action_steps=arch.chunk_size, dtype="float32",
        normalization_mapping={"VISUAL": NormalizationMode.IDENTITY, "STATE": mode, "ACTION": mode},
        florence_config=dict(florence if florence is not None else florence_config(arch.florence)),
        tokenizer_name=local_dir(arch.tokenizer, TOKENIZER_FILES) or arch.tokenizer,
        tokenizer_max_length=arch.tokenizer_max_length, pad_language_to=arch.pad_language_to,
        hidden_size=arch.hidden_size, depth=arch.depth, num_heads=arch.num_heads, mlp_ratio=float(arch.mlp_ratio),
        num_domains=arch.num_domains, len_soft_prompts=arch.len_soft_prompts, dim_time=arch.dim_time,
        max_len_seq=arch.max_len_seq, use_hetero_proj=bool(arch.use_hetero_proj), action_mode=arch.action_mode,
        num_denoising_steps=arch.num_steps, max_state_dim=arch.max_state_dim, max_action_dim=arch.max_action_dim,
        resize_imgs_with_padding=(arch.resolution, arch.resolution) if arch.resolution else None,
        num_image_views=arch.num_image_views or None,
        # NOTE: what trains is the recipe's model.freeze (LeRobot's freeze_* flags off: its defaults)
        freeze_vision_encoder=False, freeze_language_encoder=False, device="cpu", input_features=inputs,
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(arch.action_dim,))},
    )


def build_xvla(arch: LeRobotXVLAArch, *, cameras: list[str] | None = None, florence: dict | None = None):
    """LeRobot's ``XVLAModel`` (random init) and its ``XVLAConfig``, as ``XVLAPolicy.__init__`` builds them; the
    policy transformer's dropout set to ``arch.dropout_percent``. ``florence``: the Florence-2
    config dict (default: ``arch.florence``'s)."""
    from lerobot.policies.xvla.modeling_xvla import XVLAModel

    config = xvla_config(arch, cameras=cameras, florence=florence)
    config.validate_features()
    model = XVLAModel(config=config, florence_config=config.get_florence_config(), proprio_dim=config.max_state_dim)
    set_dropout(model, arch.dropout_percent / 100)
    return model, config


def set_dropout(model, p: float) -> None:
    """The dropout of the policy transformer (its attention and MLPs: LeRobot fixes them at 0.1)."""
    from torch import nn

    for module in model.transformer.modules():
        if isinstance(module, nn.Dropout):
            module.p = p
