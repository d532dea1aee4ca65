"""Sizes of LeRobot's own SmolVLA as our trainer builds it: no torch, no LeRobot import (recipes resolve here).

The model is LeRobot 0.6.1's ``VLAFlowMatching`` built from a ``SmolVLAConfig``. As in LeRobot, the VLM's sizes are
those of its Hugging Face directory (``vlm``: SmolVLM2-500M-Video-Instruct for the published SmolVLA, whose config
and processor LeRobot reads even when it trains from scratch); the fields here are LeRobot's own knobs (layers kept,
expert width, attention interleave, prompt and image sizes). A tiny model for tests is a tiny SmolVLM directory
saved by transformers (``model.arch.vlm=DIR``). The directory is looked up at job setup (``processor``'s
``check_arch``), not when a recipe validates: a recipe names it for the machine that trains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from loongforge_embodied.policies.arch import ArchMixin

PUBLISHED_VLM = "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"  # LeRobot's SmolVLAConfig.vlm_model_name
PAD_LANGUAGE = ("longest", "max_length")
ATTENTION_MODES = ("cross_attn", "self_attn")
VLM_FILES = ("config.json", "tokenizer_config.json")  # what LeRobot reads of the VLM (AutoConfig, AutoProcessor)


@dataclass(frozen=True)
class LeRobotSmolVLAArch(ArchMixin):
    """``image_size``/``num_cameras``/``state_dim``/``action_dim`` are the dataset's (images are resized with padding
    to ``resolution``; state and actions are zero-padded to ``max_state_dim``/``max_action_dim``)."""

    may_be_zero: ClassVar[tuple[str, ...]] = ("load_vlm_weights", "num_expert_layers", "self_attn_every_n_layers",
                                              "add_image_special_tokens")

    image_size: int = 512
    num_cameras: int = 2
    state_dim: int = 32
    action_dim: int = 32
    chunk_size: int = 50
    resolution: int = 512  # SmolVLAConfig.resize_imgs_with_padding (square)
    max_state_dim: int = 32
    max_action_dim: int = 32
    tokenizer_max_length: int = 48
    pad_language_to: str = "longest"
    # A local SmolVLM directory or a hub id already in the local Hugging Face cache (config + processor; never the
    # network). Its sizes are the VLM's, as in LeRobot.
    vlm: str = PUBLISHED_VLM
    load_vlm_weights: int = 0  # 1: start the VLM from the weights in ``vlm`` (LeRobot's load_vlm_weights)
    num_vlm_layers: int = 16  # the VLM's first layers kept
    num_expert_layers: int = 0  # 0: as many as the VLM keeps (LeRobot's -1)
    self_attn_every_n_layers: int = 2  # 0: every layer cross-attends (in cross_attn mode)
    expert_width_percent: int = 75  # the expert's width, % of the VLM's (LeRobot's expert_width_multiplier 0.75)
    attention_mode: str = "cross_attn"
    add_image_special_tokens: int = 0
    num_steps: int = 10  # Euler steps of sampling
    stats: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        problems = []
        if self.pad_language_to not in PAD_LANGUAGE:
            problems.append(f"pad_language_to '{self.pad_language_to}' (allowed: {', '.join(PAD_LANGUAGE)})")
        if self.attention_mode not in ATTENTION_MODES:
            problems.append(f"attention_mode '{self.attention_mode}' (allowed: {', '.join(ATTENTION_MODES)})")
        for name in ("load_vlm_weights", "add_image_special_tokens"):
            if getattr(self, name) not in (0, 1):
                problems.append(f"{name} {getattr(self, name)} (allowed: 0, 1)")
        if not self.vlm:
            problems.append("vlm is empty (a local SmolVLM directory or a cached hub id, e.g. " + PUBLISHED_VLM + ")")
        if self.num_expert_layers and self.num_vlm_layers % self.num_expert_layers:
            problems.append(f"num_vlm_layers {self.num_vlm_layers} is not a multiple of num_expert_layers "
                            f"{self.num_expert_layers}")
        if self.state_dim > self.max_state_dim or self.action_dim > self.max_action_dim:
            problems.append(f"state/action dims {self.state_dim}/{self.action_dim} exceed max_state_dim/"
                            f"max_action_dim {self.max_state_dim}/{self.max_action_dim}")
        if problems:
            raise ValueError("invalid lerobot_smolvla architecture: " + "; ".join(problems))


PRESETS: dict[str, LeRobotSmolVLAArch] = {
    # LeRobot's SmolVLA (smolvla_base): SmolVLM2-500M's first 16 layers + a 0.75-wide expert, 512² frames, ~450M.
    "smolvla": LeRobotSmolVLAArch(),
    # Trains on CPU in seconds, with a tiny SmolVLM directory (model.arch.vlm) of 4 text layers.
    "tiny": LeRobotSmolVLAArch(image_size=32, num_cameras=1, state_dim=2, action_dim=2, chunk_size=4, resolution=32,
                               num_vlm_layers=4, num_steps=4),
}


def hub_cache() -> Path:
    """The local Hugging Face hub cache, as ``huggingface_hub`` resolves it."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def local_vlm(name: str) -> str | None:
    """``name`` as a local directory LeRobot can read offline: the folder itself, or the cached snapshot of a hub id
    (None when neither holds the VLM's config and tokenizer)."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        return str(folder) if all((folder / f).is_file() for f in VLM_FILES) else None
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        found = [try_to_load_from_cache(name, f) for f in VLM_FILES]
    except HFValidationError:  # NOTE: not a hub id either (e.g. a folder that does not exist)
        return None
    if all(isinstance(f, str) for f in found):
        return str(Path(found[0]).parent)
    return None
