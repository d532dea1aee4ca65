"""Sizes of LeRobot's own X-VLA as our trainer builds it: no torch, no LeRobot import (recipes resolve here).

The model is LeRobot 0.6.1's ``XVLAModel`` (Florence-2's vision tower + BART encoder, then the soft-prompted
flow-matching transformer) built from an ``XVLAConfig``. As in LeRobot, the Florence-2 sizes are those of its
``config.json`` (``florence``: a local directory, or a hub id in the local Hugging Face cache; X-VLA-0.9B's is
Florence-2-large's), and the prompt is tokenized by ``tokenizer`` (LeRobot's default: BART-large's). The fields
here are LeRobot's own knobs. Both directories are looked up at job setup (``processor``'s ``check_arch``), not
when a recipe validates: a recipe names them for the machine that trains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from loongforge_embodied.policies.arch import ArchMixin

PUBLISHED_FLORENCE = "microsoft/Florence-2-large"  # X-VLA-0.9B's vision-language backbone
PUBLISHED_TOKENIZER = "facebook/bart-large"  # LeRobot's XVLAConfig.tokenizer_name
# LeRobot's action spaces (``action_hub``): the width the model predicts ("auto": max_action_dim)
ACTION_WIDTHS = {"auto": 0, "ee6d": 20, "joint": 14}
NORMALIZATIONS = ("identity", "mean_std")
PAD_LANGUAGE = ("longest", "max_length")


@dataclass(frozen=True)
class LeRobotXVLAArch(ArchMixin):
    """``image_size``/``num_cameras``/``state_dim``/``action_dim`` are the dataset's (images are resized with padding
    to ``resolution``; state is zero-padded to ``max_state_dim``, actions to the action space's width)."""

    may_be_zero: ClassVar[tuple[str, ...]] = ("resolution", "num_image_views", "use_hetero_proj", "domain_id",
                                              "len_soft_prompts", "dropout_percent")

    image_size: int = 224
    num_cameras: int = 2
    state_dim: int = 20
    action_dim: int = 20
    chunk_size: int = 32
    resolution: int = 224  # XVLAConfig.resize_imgs_with_padding (square; 0: frames as they come)
    num_image_views: int = 0  # 0: the camera count (views past the cameras are zero images, masked out)
    max_state_dim: int = 32
    max_action_dim: int = 20
    action_mode: str = "auto"
    # A local directory holding Florence-2's config.json (or a hub id in the local Hugging Face cache)
    florence: str = PUBLISHED_FLORENCE
    # A local tokenizer directory (or a cached hub id) for the prompt
    tokenizer: str = PUBLISHED_TOKENIZER
    tokenizer_max_length: int = 64
    pad_language_to: str = "max_length"
    hidden_size: int = 1024
    depth: int = 24
    num_heads: int = 16
    mlp_ratio: int = 4
    num_domains: int = 30
    len_soft_prompts: int = 32
    dim_time: int = 32
    max_len_seq: int = 512
    use_hetero_proj: int = 0
    domain_id: int = 0  # the embodiment's soft-prompt / projection slot (LeRobot's XVLAAddDomainIdProcessorStep)
    normalization: str = "identity"  # state and action (LeRobot's XVLA default: identity)
    dropout_percent: int = 10  # the policy transformer's dropout, attention and MLP (LeRobot's fixed 0.1)
    num_steps: int = 10  # denoising steps of sampling
    stats: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        problems = []
        for name, allowed in (("action_mode", tuple(ACTION_WIDTHS)), ("normalization", NORMALIZATIONS),
                              ("pad_language_to", PAD_LANGUAGE)):
            if getattr(self, name) not in allowed:
                problems.append(f"{name} '{getattr(self, name)}' (allowed: {', '.join(allowed)})")
        if self.use_hetero_proj not in (0, 1):
            problems.append(f"use_hetero_proj {self.use_hetero_proj} (allowed: 0, 1)")
        if self.hidden_size % self.num_heads:
            problems.append(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.domain_id >= self.num_domains:
            problems.append(f"domain_id {self.domain_id} is not below num_domains {self.num_domains}")
        if self.dropout_percent > 100:
            problems.append(f"dropout_percent {self.dropout_percent} (allowed: 0..100)")
        if self.num_image_views and self.num_image_views < self.num_cameras:
            problems.append(f"num_image_views {self.num_image_views} is below the camera count {self.num_cameras}")
        for name in ("florence", "tokenizer"):
            if not getattr(self, name):
                problems.append(f"{name} is empty (a local directory or a cached hub id)")
        if self.state_dim > self.max_state_dim or self.action_dim > self.action_width:
            problems.append(f"state/action dims {self.state_dim}/{self.action_dim} exceed max_state_dim/the action "
                            f"width {self.max_state_dim}/{self.action_width} (action_mode '{self.action_mode}')")
        if problems:
            raise ValueError("invalid lerobot_xvla architecture: " + "; ".join(problems))

    @property
    def action_width(self) -> int:
        """The width the model predicts: the action space's (``auto``: ``max_action_dim``)."""
        return ACTION_WIDTHS.get(self.action_mode) or self.max_action_dim

    @property
    def flow_time(self) -> str:
        """The data pipeline's flow-time law: X-VLA's is uniform in [0, 1) (the weight of the noise)."""
        return "uniform"

    @property
    def views(self) -> int:
        return self.num_image_views or self.num_cameras


PRESETS: dict[str, LeRobotXVLAArch] = {
    # X-VLA-0.9B: Florence-2-large (vision + BART encoder) + a 24-layer, 1024-wide soft-prompted transformer.
    "xvla": LeRobotXVLAArch(),
    # Trains on CPU in seconds, with a tiny Florence-2 config directory (model.arch.florence) and a tiny tokenizer
    # (model.arch.tokenizer); no dropout, so layouts reproduce each other.
    "tiny": LeRobotXVLAArch(image_size=32, num_cameras=1, state_dim=2, action_dim=2, chunk_size=4, resolution=32,
                            max_state_dim=4, max_action_dim=4, tokenizer_max_length=8, hidden_size=32, depth=2,
                            num_heads=2, num_domains=3, len_soft_prompts=4, dim_time=8, max_len_seq=64,
                            dropout_percent=0, num_steps=3),
}


def hub_cache() -> Path:
    """The local Hugging Face hub cache, as ``huggingface_hub`` resolves it."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def local_dir(name: str, files: tuple[str, ...]) -> str | None:
    """``name`` as a local directory holding ``files``: the folder itself, or the cached snapshot of a hub id (None
    when neither has them)."""
    folder = Path(name).expanduser()
    if folder.is_dir():
        return str(folder) if all((folder / f).is_file() for f in files) else None
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        found = [try_to_load_from_cache(name, f) for f in files]
    except HFValidationError:  # NOTE: not a hub id either (e.g. a folder that does not exist)
        return None
    if all(isinstance(f, str) for f in found):
        return str(Path(found[0]).parent)
    return None
