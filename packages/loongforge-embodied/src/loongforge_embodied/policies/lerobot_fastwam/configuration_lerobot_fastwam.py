"""Sizes of LeRobot's own FastWAM as our trainer builds it: no torch, no LeRobot import (recipes resolve here).

The model is LeRobot 0.6.1's ``FastWAM`` world-action model: a Wan2.2 video DiT and an action DiT joined layer by
layer in one mixture-of-transformers (``MoT``), on clips encoded by the frozen Wan2.2 VAE and prompts encoded by the
frozen UMT5 text encoder. Both frozen parts come from ``wan`` (a Wan2.2-TI2V-5B diffusers directory holding ``vae/``
and ``text_encoder/``, or that hub id in the local Hugging Face cache), the prompt tokenizer from ``tokenizer``; the
fields here are LeRobot's own knobs. Directories are looked up at job setup (``processor``'s ``check_arch``), not
when a recipe validates: a recipe names them for the machine that trains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from loongforge_embodied.policies.arch import ArchMixin

PUBLISHED_WAN = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"  # LeRobot's FastWAMConfig.text_encoder_model_id (and its VAE's)
PUBLISHED_TOKENIZER = "google/umt5-xxl"  # LeRobot's FastWAMConfig.tokenizer_model_id
NORMALIZATIONS = ("identity", "mean_std")
VIDEO_MASKS = ("first_frame_causal", "per_frame_causal", "bidirectional")
FROZEN_DTYPES = ("float32", "bfloat16")
LATENT_CHANNELS = 48  # the Wan2.2 VAE's (LeRobot's adapter fixes it)
SPATIAL_FACTOR, TEMPORAL_FACTOR, PATCH = 16, 4, 2  # the VAE's compression and the video DiT's spatial patch


@dataclass(frozen=True)
class LeRobotFastWAMArch(ArchMixin):
    """``image_size``/``num_cameras``/``state_dim``/``action_dim`` are the dataset's; ``chunk_size`` is LeRobot's
    ``action_horizon``. Each camera is resized to ``height`` x ``width / num_cameras`` and the cameras are put side
    by side (LeRobot's ``image_size``); a training sample is a clip of ``video_frames`` dataset frames taken every
    ``frame_stride`` frames (LeRobot's ``num_video_frames`` / ``action_video_freq_ratio``)."""

    may_be_zero: ClassVar[tuple[str, ...]] = ("proprio", "video_loss_percent")

    image_size: int = 224
    num_cameras: int = 2
    state_dim: int = 8
    action_dim: int = 7
    chunk_size: int = 32
    height: int = 224
    width: int = 448
    video_frames: int = 33
    frame_stride: int = 4
    proprio: int = 1  # the state as one extra context token (0: LeRobot's proprio_dim None)
    # A Wan2.2-TI2V-5B diffusers directory (vae/ + text_encoder/), or that hub id in the local Hugging Face cache
    wan: str = PUBLISHED_WAN
    # A local tokenizer directory (or a cached hub id) for the prompt
    tokenizer: str = PUBLISHED_TOKENIZER
    tokenizer_max_length: int = 128
    num_layers: int = 30
    num_heads: int = 24
    head_dim: int = 128  # the video DiT's width is num_heads x head_dim
    video_ffn: int = 14336
    action_hidden: int = 1024
    action_ffn: int = 4096
    text_dim: int = 4096  # the text encoder's width
    freq_dim: int = 256
    video_mask: str = "first_frame_causal"
    video_shift: int = 5  # flow-time shift of the video scheduler, training and sampling
    action_shift: int = 5
    video_loss_percent: int = 100  # LeRobot's loss.lambda_video, in percent (lambda_action is 1)
    normalization: str = "mean_std"  # state and action (LeRobot's FastWAM default)
    num_steps: int = 10  # denoising steps of sampling
    # The frozen VAE's and text encoder's weights (LeRobot's torch_dtype: bfloat16; UMT5-XXL is 5.7B)
    frozen_dtype: str = "bfloat16"
    stats: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        problems = []
        for name, allowed in (("normalization", NORMALIZATIONS), ("video_mask", VIDEO_MASKS),
                              ("frozen_dtype", FROZEN_DTYPES)):
            if getattr(self, name) not in allowed:
                problems.append(f"{name} '{getattr(self, name)}' (allowed: {', '.join(allowed)})")
        if self.proprio not in (0, 1):
            problems.append(f"proprio {self.proprio} (allowed: 0, 1)")
        if self.head_dim % 2:
            problems.append(f"head_dim {self.head_dim} is odd (rotary embeddings need it even)")
        if self.freq_dim % 2:
            problems.append(f"freq_dim {self.freq_dim} is odd")
        step = SPATIAL_FACTOR * PATCH
        if self.height % step or self.width % step or self.width % self.num_cameras:
            problems.append(f"height x width {self.height} x {self.width} must be multiples of {step}, the width "
                            f"also of the camera count ({self.num_cameras})")
        if (self.video_frames - 1) % self.frame_stride:
            problems.append(f"video_frames - 1 ({self.video_frames - 1}) is not a multiple of frame_stride "
                            f"({self.frame_stride})")
        elif self.transitions % TEMPORAL_FACTOR:
            problems.append(f"the clip's {self.transitions} transitions ((video_frames - 1) / frame_stride) are not a "
                            f"multiple of {TEMPORAL_FACTOR} (the VAE's temporal compression)")
        elif self.chunk_size % self.transitions:
            problems.append(f"chunk_size {self.chunk_size} is not a multiple of the clip's {self.transitions} "
                            "transitions")
        for name in ("wan", "tokenizer"):
            if not getattr(self, name):
                problems.append(f"{name} is empty (a local directory or a cached hub id)")
        if problems:
            raise ValueError("invalid lerobot_fastwam architecture: " + "; ".join(problems))

    @property
    def transitions(self) -> int:
        """Frames of the model's clip, less the first (LeRobot's ``model_video_frames - 1``)."""
        return (self.video_frames - 1) // self.frame_stride

    @property
    def frame_offsets(self) -> tuple[int, ...]:
        """The data pipeline's clip: the dataset frames a sample reads (LeRobot's ``observation_delta_indices``)."""
        return tuple(range(0, self.video_frames, self.frame_stride))

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """The VAE's latent of one clip (channels, frames, height, width): the shape of the video flow noise."""
        return (LATENT_CHANNELS, self.transitions // TEMPORAL_FACTOR + 1, self.height // SPATIAL_FACTOR,
                self.width // SPATIAL_FACTOR)

    @property
    def flow_time(self) -> str:
        """The data pipeline's flow-time law: FastWAM's is uniform in [0, 1), before the scheduler's shift."""
        return "uniform"


PRESETS: dict[str, LeRobotFastWAMArch] = {
    # FastWAM on Wan2.2-TI2V-5B: the 30-layer, 3072-wide video DiT + a 30-layer, 1024-wide action DiT (LIBERO's
    # two 224² cameras side by side, 33-frame clips every 4th frame, 32-action chunks).
    "fastwam": LeRobotFastWAMArch(),
    # Trains on CPU in seconds, with a tiny Wan directory (model.arch.wan: vae/ + text_encoder/ saved by diffusers
    # and transformers) and a tiny tokenizer (model.arch.tokenizer).
    "tiny": LeRobotFastWAMArch(image_size=32, num_cameras=1, state_dim=2, action_dim=2, chunk_size=4, height=32,
                               width=64, video_frames=5, frame_stride=1, tokenizer_max_length=16, num_layers=2,
                               num_heads=2, head_dim=8, video_ffn=32, action_hidden=16, action_ffn=32, text_dim=16,
                               freq_dim=16, num_steps=3, frozen_dtype="float32"),
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
        return str(Path(found[0]).parents[len(Path(files[0]).parts) - 1])
    return None
