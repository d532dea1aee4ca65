"""Sizes of LeRobot's own Wall-X as our trainer builds it: no torch, no LeRobot import (recipes resolve here).

The model is LeRobot 0.6.1's ``Qwen2_5_VLMoEForAction`` (``lerobot.policies.wall_x``): Qwen2.5-VL whose decoder MLPs
are hard-routed experts (one for the prompt's tokens, one for the action tokens, which attend to each other
bidirectionally) and a flow-matching action head (action / proprioception projections in, velocity out). As in
LeRobot, the network's sizes and its Qwen2.5-VL processor are those of the Wall-X model directory (``base``: the
published ``x-square-robot/wall-oss-flow`` or a local folder, read from disk, never the network); the fields here
are the dataset's shapes, the padded widths and the sampler's. A tiny model for tests is a tiny Wall-X directory
saved by transformers (``model.arch.base=DIR``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from loongforge_embodied.policies.arch import ArchMixin

PUBLISHED = "x-square-robot/wall-oss-flow"  # LeRobot's WallXConfig.pretrained_name_or_path
NUM_STEPS = 10  # Euler steps of sampling: LeRobot's WallXPolicy always takes its predict's default
BASE_FILES = ("config.json", "tokenizer_config.json")  # what LeRobot reads of the directory (config, processor)


@dataclass(frozen=True)
class LeRobotWallXArch(ArchMixin):
    """``image_size``/``num_cameras``/``state_dim``/``action_dim`` are the dataset's; state and actions are mean/std
    normalised and zero-padded to ``max_state_dim``/``max_action_dim`` (the widths of the directory's
    ``agent_pos_config`` / ``dof_config``); ``chunk_size`` action tokens follow the prompt. ``camera_keys``: the
    dataset's camera keys, comma-separated (their names are words of Wall-X's prompt); empty: ``cam0, cam1, ...``."""

    may_be_zero: ClassVar[tuple[str, ...]] = ("load_weights",)

    image_size: int = 256
    num_cameras: int = 1
    state_dim: int = 20
    action_dim: int = 20
    chunk_size: int = 32
    max_state_dim: int = 20
    max_action_dim: int = 20
    # A local Wall-X directory or a hub id already in the local Hugging Face cache (config + processor).
    base: str = PUBLISHED
    load_weights: int = 0  # 1: start from the weights in ``base`` (its model.safetensors)
    camera_keys: str = ""
    stats: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        problems = []
        if self.load_weights not in (0, 1):
            problems.append(f"load_weights {self.load_weights} (allowed: 0, 1)")
        if not self.base:
            problems.append(f"base is empty (a local Wall-X directory or a cached hub id, e.g. {PUBLISHED})")
        if self.state_dim > self.max_state_dim or self.action_dim > self.max_action_dim:
            problems.append(f"state/action dims {self.state_dim}/{self.action_dim} exceed max_state_dim/"
                            f"max_action_dim {self.max_state_dim}/{self.max_action_dim}")
        if self.camera_keys and len(self.camera_keys.split(",")) != self.num_cameras:
            problems.append(f"camera_keys '{self.camera_keys}' does not name num_cameras ({self.num_cameras}) cameras")
        if problems:
            raise ValueError("invalid lerobot_wall_x architecture: " + "; ".join(problems))

    def cameras(self) -> list[str]:
        """The cameras' LeRobot keys, in the order of the batch's ``images``."""
        if self.camera_keys:
            return self.camera_keys.split(",")
        return [f"observation.images.cam{i}" for i in range(self.num_cameras)]


PRESETS: dict[str, LeRobotWallXArch] = {
    # LeRobot's WallXConfig defaults (wall-oss-flow: Qwen2.5-VL with the action expert, 20-wide state and actions).
    "wall_oss": LeRobotWallXArch(),
    # Trains on CPU in seconds, with a tiny Wall-X directory (model.arch.base) whose widths are 8.
    "tiny": LeRobotWallXArch(image_size=32, num_cameras=1, state_dim=2, action_dim=2, chunk_size=4, max_state_dim=8,
                             max_action_dim=8),
}


def hub_cache() -> Path:
    """The local Hugging Face hub cache, as ``huggingface_hub`` resolves it."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def local_base(name: str) -> str | None:
    """``name`` as a local directory LeRobot can read offline: the folder itself, or the cached snapshot of a hub id
    (None when neither holds the model's config and processor)."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        return str(folder) if all((folder / f).is_file() for f in BASE_FILES) else None
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        found = [try_to_load_from_cache(name, f) for f in BASE_FILES]
    except HFValidationError:  # NOTE: not a hub id either (e.g. a folder that does not exist)
        return None
    if all(isinstance(f, str) for f in found):
        return str(Path(found[0]).parent)
    return None
