"""Sizes of LeRobot's own GR00T N1.7 as our trainer builds it: no torch, no LeRobot import (recipes resolve here).

The model is LeRobot 0.6.1's ``GR00TN17`` (``lerobot.policies.groot``): a Qwen3-VL backbone (Cosmos-Reason2-2B for the
published N1.7, cut to its first ``select_layer`` text layers) and the multi-embodiment flow-matching action head (a
VL self-attention stack and an alternating cross-attention DiT). As in LeRobot, the backbone's sizes are those of its
Hugging Face directory (``vlm``: its config and Qwen3-VL processor, read from a local folder or the local hub cache,
never the network); the fields here are the action head's and the processor's. A tiny model for tests is a tiny
Qwen3-VL directory saved by transformers (``model.arch.vlm=DIR``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from loongforge_embodied.policies.arch import ArchMixin

PUBLISHED_VLM = "nvidia/Cosmos-Reason2-2B"  # LeRobot's GROOT_N1_7_BACKBONE_MODEL
VLM_FILES = ("config.json", "tokenizer_config.json")  # what LeRobot reads of the backbone (AutoConfig, processor)
NEW_EMBODIMENT = 10  # LeRobot's N1_7_EMBODIMENT_MAPPING["new_embodiment"]: the id a new robot trains under


@dataclass(frozen=True)
class LeRobotGrootArch(ArchMixin):
    """``image_size``/``num_cameras``/``state_dim``/``action_dim`` are the dataset's; state and actions are min-max
    normalised to [-1, 1] and zero-padded to ``max_state_dim``/``max_action_dim``; ``chunk_size`` is the action
    horizon (at most N1.7's native 40)."""

    may_be_zero: ClassVar[tuple[str, ...]] = ("load_vlm_weights", "dropout_percent", "state_dropout_percent",
                                              "embodiment_id")

    image_size: int = 256
    num_cameras: int = 2
    state_dim: int = 32
    action_dim: int = 32
    chunk_size: int = 40
    max_state_dim: int = 132
    max_action_dim: int = 132
    # A local Qwen3-VL directory or a hub id already in the local Hugging Face cache (config + processor).
    vlm: str = PUBLISHED_VLM
    load_vlm_weights: int = 0  # 1: start the backbone from the weights in ``vlm``
    select_layer: int = 16  # the backbone's first text layers kept (their output feeds the action head)
    backbone_embedding_dim: int = 2048  # the backbone's hidden size
    hidden_size: int = 1024  # the DiT's output width
    input_embedding_dim: int = 1536  # the state / action embeddings' width (= DiT heads x head dim)
    dit_layers: int = 32
    dit_heads: int = 32
    dit_head_dim: int = 48
    vl_layers: int = 4  # the VL self-attention stack over the backbone's features
    vl_heads: int = 32
    vl_head_dim: int = 64
    dropout_percent: int = 20  # DiT / VL self-attention dropout (N1.7: 0.2)
    state_dropout_percent: int = 20  # whole-state dropout per sample in training (N1.7: 0.2)
    num_embodiments: int = 32
    embodiment_id: int = NEW_EMBODIMENT
    image_crop_size: int = 230  # the processor's crop, then resize to image_target_size (square)
    image_target_size: int = 256
    num_steps: int = 4  # Euler steps of sampling
    stats: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        problems = []
        if self.load_vlm_weights not in (0, 1):
            problems.append(f"load_vlm_weights {self.load_vlm_weights} (allowed: 0, 1)")
        if not self.vlm:
            problems.append("vlm is empty (a local Qwen3-VL directory or a cached hub id, e.g. " + PUBLISHED_VLM + ")")
        if self.chunk_size > 40:
            problems.append(f"chunk_size {self.chunk_size} exceeds GR00T N1.7's action horizon 40")
        if self.input_embedding_dim != self.dit_heads * self.dit_head_dim:
            problems.append(f"input_embedding_dim {self.input_embedding_dim} is not dit_heads x dit_head_dim "
                            f"({self.dit_heads} x {self.dit_head_dim})")
        if self.backbone_embedding_dim != self.vl_heads * self.vl_head_dim:
            problems.append(f"backbone_embedding_dim {self.backbone_embedding_dim} is not vl_heads x vl_head_dim "
                            f"({self.vl_heads} x {self.vl_head_dim})")
        if self.embodiment_id >= self.num_embodiments:
            problems.append(f"embodiment_id {self.embodiment_id} is not below num_embodiments {self.num_embodiments}")
        for name in ("dropout_percent", "state_dropout_percent"):
            if getattr(self, name) > 100:
                problems.append(f"{name} {getattr(self, name)} (allowed: 0..100)")
        if self.image_crop_size > self.image_target_size:
            problems.append(f"image_crop_size {self.image_crop_size} exceeds image_target_size {self.image_target_size}")
        if self.state_dim > self.max_state_dim or self.action_dim > self.max_action_dim:
            problems.append(f"state/action dims {self.state_dim}/{self.action_dim} exceed max_state_dim/"
                            f"max_action_dim {self.max_state_dim}/{self.max_action_dim}")
        if problems:
            raise ValueError("invalid lerobot_groot architecture: " + "; ".join(problems))


PRESETS: dict[str, LeRobotGrootArch] = {
    # LeRobot's GR00T N1.7 (GR00T_N1_7_DEFAULTS): Cosmos-Reason2-2B's first 16 layers + a 32-layer DiT, ~3B.
    "n1_7": LeRobotGrootArch(),
    # Trains on CPU in seconds, with a tiny Qwen3-VL directory (model.arch.vlm) of 64-wide text layers.
    "tiny": LeRobotGrootArch(image_size=32, num_cameras=1, state_dim=2, action_dim=2, chunk_size=4, max_state_dim=8,
                             max_action_dim=8, select_layer=2, backbone_embedding_dim=64, hidden_size=32,
                             input_embedding_dim=32, dit_layers=2, dit_heads=2, dit_head_dim=16, vl_layers=1,
                             vl_heads=2, vl_head_dim=32, dropout_percent=0, state_dropout_percent=0,
                             num_embodiments=16, image_crop_size=30, image_target_size=32),
}


def hub_cache() -> Path:
    """The local Hugging Face hub cache, as ``huggingface_hub`` resolves it."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def local_vlm(name: str) -> str | None:
    """``name`` as a local directory LeRobot can read offline: the folder itself, or the cached snapshot of a hub id
    (None when neither holds the backbone's config and tokenizer)."""
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
