"""Sizes of LeRobot's own LingBot-VA as our trainer builds it: no torch, no LeRobot import (recipes resolve here).

The model is LeRobot 0.6.1's ``LingBotVAPolicy``: an autoregressive video-action world model whose one trainable
part is a dual-stream Wan2.2 transformer (``WanTransformer3DModel``): video latents and actions, each a noisy and a
clean (conditioning) copy, in one sequence under a block-causal mask. Clips are encoded by the frozen Wan2.2 VAE,
prompts by the frozen UMT5 text encoder; both and the prompt tokenizer come from ``wan`` (a directory holding
``vae/``, ``text_encoder/`` and ``tokenizer/``, LeRobot's ``wan_pretrained_path``, or that hub id in the local
Hugging Face cache). The directory is looked up at job setup (``processor``'s ``check_arch``), not when a recipe
validates: a recipe names it for the machine that trains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from loongforge_embodied.policies.arch import ArchMixin

PUBLISHED_WAN = "robbyant/lingbot-va-base"  # LeRobot's LingBotVAConfig.wan_pretrained_path
NORMALIZATIONS = ("identity", "mean_std")
FROZEN_DTYPES = ("float32", "bfloat16")
LATENT_CHANNELS = 48  # the Wan2.2 VAE's (LeRobot's in_channels / out_channels)
SPATIAL_FACTOR, TEMPORAL_FACTOR, PATCH = 16, 4, 2  # the VAE's compression and the transformer's spatial patch
PROMPT_LENGTH = 512  # LeRobot's max_sequence_length (its training's cross-attention mask assumes 512)


@dataclass(frozen=True)
class LeRobotLingBotVAArch(ArchMixin):
    """``image_size``/``num_cameras``/``state_dim``/``action_dim`` are the dataset's (LingBot-VA reads no state);
    ``action_dim`` is LeRobot's ``used_action_channel_ids`` (the first ``action_dim`` of the model's
    ``action_channels``, LeRobot's ``action_dim``). A chunk is ``frame_chunk_size`` latent frames of
    ``action_per_frame`` actions each (``chunk_size`` is their product); a training sample's clip is
    ``4 x frame_chunk_size`` dataset frames (LeRobot's ``observation_delta_indices``). Each camera is resized to
    ``height`` x ``width`` and the cameras' latents are put side by side (LeRobot's ``width_concat``)."""

    may_be_zero: ClassVar[tuple[str, ...]] = ()

    image_size: int = 128
    num_cameras: int = 2
    state_dim: int = 8
    action_dim: int = 7
    chunk_size: int = 16
    height: int = 128
    width: int = 128
    frame_chunk_size: int = 4
    action_per_frame: int = 4
    action_channels: int = 30
    # A directory holding vae/, text_encoder/ and tokenizer/ (LeRobot's wan_pretrained_path), or that hub id in
    # the local Hugging Face cache
    wan: str = PUBLISHED_WAN
    num_layers: int = 30
    num_heads: int = 24
    head_dim: int = 128  # the transformer's width is num_heads x head_dim
    ffn: int = 14336
    text_dim: int = 4096  # the text encoder's width
    freq_dim: int = 256
    video_shift: int = 5  # LeRobot's snr_shift
    action_shift_percent: int = 5  # LeRobot's action_snr_shift (0.05), in percent
    num_steps: int = 20  # video denoising steps of sampling (LeRobot's num_inference_steps)
    action_steps: int = 50  # action denoising steps of sampling
    guidance: int = 5  # classifier-free guidance of the video stream (LeRobot's guidance_scale; 1: none)
    action_guidance: int = 1  # of the action stream
    attn_window: int = 30  # LeRobot's attn_window (the sampling KV cache)
    normalization: str = "mean_std"  # actions (LeRobot's LingBot-VA trains on actions already in [-1, 1])
    # The frozen VAE's and text encoder's weights (LeRobot's dtype: bfloat16; UMT5-XXL is 5.7B)
    frozen_dtype: str = "bfloat16"
    stats: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        problems = []
        for name, allowed in (("normalization", NORMALIZATIONS), ("frozen_dtype", FROZEN_DTYPES)):
            if getattr(self, name) not in allowed:
                problems.append(f"{name} '{getattr(self, name)}' (allowed: {', '.join(allowed)})")
        if self.head_dim % 2 or (self.head_dim // 3) % 2:
            problems.append(f"head_dim {self.head_dim}: it and a third of it must be even (the rotary embedding "
                            "splits it over frame, height and width)")
        step = SPATIAL_FACTOR * PATCH
        if self.height % step or self.width % step:
            problems.append(f"height x width {self.height} x {self.width} must be multiples of {step}")
        if self.chunk_size != self.frame_chunk_size * self.action_per_frame:
            problems.append(f"chunk_size {self.chunk_size} is not frame_chunk_size x action_per_frame "
                            f"({self.frame_chunk_size} x {self.action_per_frame})")
        if self.frame_chunk_size < 2:
            problems.append("frame_chunk_size must be at least 2 (the first frame conditions the chunk)")
        if self.action_dim > self.action_channels:
            problems.append(f"the dataset's action_dim {self.action_dim} exceeds action_channels "
                            f"{self.action_channels}")
        if not self.wan:
            problems.append("wan is empty (a local directory or a cached hub id)")
        if problems:
            raise ValueError("invalid lerobot_lingbot_va architecture: " + "; ".join(problems))

    @property
    def frame_offsets(self) -> tuple[int, ...]:
        """The data pipeline's clip: the dataset frames a sample reads (LeRobot's ``observation_delta_indices``)."""
        stride = max(1, self.action_per_frame // TEMPORAL_FACTOR)
        return tuple(range(0, self.frame_chunk_size * TEMPORAL_FACTOR * stride, stride))

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """The VAE's latent of one clip (channels, frames, height, width), the cameras side by side."""
        return (LATENT_CHANNELS, self.frame_chunk_size, self.height // SPATIAL_FACTOR,
                self.width // SPATIAL_FACTOR * self.num_cameras)

    @property
    def action_shape(self) -> tuple[int, int, int, int]:
        """The action stream of one chunk (LeRobot's ``[action_dim, F, action_per_frame, 1]``)."""
        return (self.action_channels, self.frame_chunk_size, self.action_per_frame, 1)

    @property
    def served_steps(self) -> int:
        """Actions a first chunk returns: all but the conditioning frame's (LeRobot drops them)."""
        return (self.frame_chunk_size - 1) * self.action_per_frame


PRESETS: dict[str, LeRobotLingBotVAArch] = {
    # LingBot-VA on Wan2.2-TI2V-5B's transformer (30 layers, 3072 wide), LeRobot's LIBERO defaults: two 128²
    # cameras, 4 latent frames of 4 actions, 30 action channels of which the dataset's are the first.
    "lingbot_va": LeRobotLingBotVAArch(),
    # Trains on CPU in seconds, with a tiny Wan directory (model.arch.wan: vae/ saved by diffusers, text_encoder/
    # and tokenizer/ saved by transformers).
    "tiny": LeRobotLingBotVAArch(image_size=32, num_cameras=1, state_dim=2, action_dim=2, chunk_size=4, height=32,
                                 width=32, frame_chunk_size=2, action_per_frame=2, action_channels=4, num_layers=2,
                                 num_heads=2, head_dim=8, ffn=32, text_dim=16, freq_dim=16, num_steps=2,
                                 action_steps=2, attn_window=4, frozen_dtype="float32"),
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
