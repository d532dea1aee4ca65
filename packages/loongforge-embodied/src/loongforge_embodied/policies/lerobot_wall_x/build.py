"""LeRobot's Wall-X network (``Qwen2_5_VLMoEForAction``) of an arch, its processor, and the ``WallXConfig`` an export
is loaded with.

LeRobot builds the network from a Wall-X model directory (``Qwen2_5_VLMoEForAction.from_pretrained``: its Qwen2.5-VL
config with the experts' and the action head's widths, its processor, its ``model.safetensors``): we hand it the
local folder (or cached snapshot) of ``arch.base``, so nothing is downloaded, and build the same network the same
way (the vocabulary resized to the tokenizer's, the pad id set) without requiring its weights.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from loongforge_embodied.policies.lerobot_wall_x.configuration_lerobot_wall_x import (
    PUBLISHED,
    LeRobotWallXArch,
    hub_cache,
    local_base,
)


def base_dir(arch: LeRobotWallXArch) -> str:
    """The Wall-X directory, local (never the network), or a one-line error naming ``model.arch.base``."""
    from loongforge.errors import RecipeError

    from loongforge_embodied.policies.lerobot_wall_x.configuration_lerobot_wall_x import BASE_FILES

    folder = local_base(arch.base)
    if folder is None:
        raise RecipeError(f"'{arch.base}': no local folder with {' and '.join(BASE_FILES)}, and no such hub id in the "
                          f"local Hugging Face cache ({hub_cache()}); download it first (e.g. `hf download "
                          f"{PUBLISHED}`) or name a local Wall-X directory", key="model.arch.base")
    return folder


@functools.cache
def _load(folder: str) -> tuple[Any, Any]:
    from lerobot.policies.wall_x.qwen_model import Qwen2_5_VLConfig
    from transformers import AutoProcessor

    # NOTE: every DataLoader worker tokenizes its own batches: no tokenizer thread pool per worker
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config = Qwen2_5_VLConfig.from_pretrained(folder, local_files_only=True)
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True, use_fast=True)
    # NOTE: as Qwen2_5_VLMoEForAction.from_pretrained: the pad id is the tokenizer's
    config.pad_token_id = config.text_config.pad_token_id = processor.tokenizer.pad_token_id
    return config, processor


def load_base(arch: LeRobotWallXArch) -> tuple[Any, Any]:
    """The directory's Wall-X config and Qwen2.5-VL processor (one per process and directory), checked against the
    arch's padded widths; any problem is one line naming ``model.arch``'s key."""
    from loongforge.errors import RecipeError

    folder = base_dir(arch)
    try:
        config, processor = _load(folder)
        widths = {"max_action_dim": sum(config.dof_config.values()),
                  "max_state_dim": sum(config.agent_pos_config.values())}
        token = processor.tokenizer.convert_tokens_to_ids("<|action|>")
    except RecipeError:
        raise
    except Exception as e:  # NOTE: a broken config or processor file fails in many ways (OSError, ValueError, ...)
        raise RecipeError(f"'{arch.base}' is no Wall-X directory that loads from a local folder: "
                          f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}", key="model.arch.base") from e
    if token is None or token == processor.tokenizer.unk_token_id:
        raise RecipeError(f"'{arch.base}': its tokenizer has no <|action|> token (not a Wall-X processor)",
                          key="model.arch.base")
    for key, width in widths.items():
        if getattr(arch, key) != width:
            raise RecipeError(f"{getattr(arch, key)} is not the width of '{arch.base}' ({width}: its "
                              f"{'dof_config' if key == 'max_action_dim' else 'agent_pos_config'})",
                              key=f"model.arch.{key}")
    return config, processor


def build_wall_x(arch: LeRobotWallXArch):
    """LeRobot's ``Qwen2_5_VLMoEForAction`` (random init unless ``load_weights``) and its processor."""
    import copy

    from lerobot.policies.wall_x.modeling_wall_x import Qwen2_5_VLMoEForAction

    config, processor = load_base(arch)
    config = copy.deepcopy(config)  # NOTE: the model sets its attention implementation on the config it gets
    model = Qwen2_5_VLMoEForAction(config, processor=processor)
    model.resize_token_embeddings(len(processor.tokenizer))
    if arch.load_weights:
        from pathlib import Path

        from safetensors.torch import load_file

        # NOTE: as LeRobot's loader: the normaliser's statistics dropped, the rest loaded non-strictly
        sd = load_file(str(Path(base_dir(arch)) / "model.safetensors"))
        model.load_state_dict({k: v for k, v in sd.items() if "action_preprocessor.normalizer" not in k}, strict=False)
    return model, processor


def policy_config(arch: LeRobotWallXArch, *, base: str, cameras: list[str] | None = None,
                  state_key: str = "observation.state") -> Any:
    """LeRobot's ``WallXConfig`` (type ``wall_x``, diffusion prediction) of ``arch``: ``base`` is the Wall-X model
    directory ``WallXPolicy`` builds its network from (``pretrained_name_or_path``)."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.wall_x.configuration_wall_x import WallXConfig

    cams = cameras or arch.cameras()
    inputs = {k: PolicyFeature(type=FeatureType.VISUAL, shape=(3, arch.image_size, arch.image_size)) for k in cams}
    inputs[state_key] = PolicyFeature(type=FeatureType.STATE, shape=(arch.state_dim,))
    return WallXConfig(pretrained_name_or_path=base, chunk_size=arch.chunk_size, n_action_steps=arch.chunk_size,
                       max_state_dim=arch.max_state_dim, max_action_dim=arch.max_action_dim, device="cpu",
                       prediction_mode="diffusion", input_features=inputs,
                       output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(arch.action_dim,))})
