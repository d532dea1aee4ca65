"""Sizes of LeRobot's own PI05 as our trainer builds it: no torch, no LeRobot import (recipes resolve here).

The model is LeRobot 0.6.1's ``PI05Pytorch`` built from a ``PI05Config`` (``paligemma_variant``,
``action_expert_variant``, ``dtype`` (``bf16_params``), ...). The ``*_width``/``*_depth``/``*_mlp``/``head_dim``/``vision_*``/
``patch_size`` fields are 0 for LeRobot's real sizes (PaliGemma Gemma-2B + SigLIP So400m/14 + Gemma-300M
expert); non-zero values shrink the model for CPU tests (see ``build.py``: LeRobot's size lookups are
redirected while the model is constructed). Attention is always 8 query heads / 1 key-value head, as in both
Gemma variants: LeRobot's joint layer hard-codes the 8 in a reshape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from loongforge_embodied.policies.arch import ArchMixin

VARIANTS = ("gemma_2b", "gemma_300m")
PROMPT_PADDING = ("longest", "max_length")
NUM_HEADS, NUM_KV_HEADS = 8, 1  # LeRobot's compute_layer_complete reshapes to ``1 * 8 * head_dim``
SIZE_FIELDS = ("lm_width", "lm_depth", "lm_mlp", "expert_width", "expert_depth", "expert_mlp", "head_dim",
               "vision_width", "vision_depth", "vision_heads", "vision_mlp", "patch_size")


@dataclass(frozen=True)
class LeRobotPI05Arch(ArchMixin):
    """``image_size``/``num_cameras``/``state_dim``/``action_dim`` are the dataset's (images are resized with
    padding to ``resolution``; state and actions are zero-padded to ``max_state_dim``/``max_action_dim``)."""

    may_be_zero: ClassVar[tuple[str, ...]] = (*SIZE_FIELDS, "bf16_params", "quantile_norm", "sdpa")

    image_size: int = 224
    num_cameras: int = 2
    state_dim: int = 32
    action_dim: int = 32
    chunk_size: int = 50
    resolution: int = 224
    max_state_dim: int = 32
    max_action_dim: int = 32
    tokenizer_max_length: int = 200
    # "" = Gemma byte-fallback tokens (no download; LeRobot's PaliGemma tokenizer is not available offline);
    # else a Hugging Face tokenizer (a local folder, or a hub id already in the local cache, e.g.
    # google/paligemma-3b-pt-224 as LeRobot's pi05 processor uses), loaded without network access.
    tokenizer: str = ""
    # "longest": a batch is padded to its longest prompt, rounded up to prompt_pad_multiple (at most
    # tokenizer_max_length): padding is never computed, the valid tokens' outputs are unchanged.
    # "max_length": every prompt padded to tokenizer_max_length, as LeRobot's processor does.
    prompt_padding: str = "longest"
    prompt_pad_multiple: int = 16
    num_inference_steps: int = 10
    paligemma_variant: str = "gemma_2b"
    action_expert_variant: str = "gemma_300m"
    # 1: PI05Config.dtype "bfloat16" (LeRobot's split: bf16 but the vision tower, projector and norms in fp32);
    # 0: "float32" master weights (train.precision bf16 still computes in bf16). fsdp2/hsdp shard one dtype per
    # unit, so they keep fp32 master weights either way (``parallel._fully_shard`` upcasts and logs it).
    bf16_params: int = 1
    quantile_norm: int = 1  # 1: state/action normalised with q01/q99 (pi05's QUANTILES); 0: mean/std
    sdpa: int = 1  # 1: our SDPA twin of LeRobot's joint attention layer; 0: LeRobot's eager attention
    # 0 = LeRobot's size for the variant; any non-zero value builds a shrunken model (tests).
    lm_width: int = 0
    lm_depth: int = 0
    lm_mlp: int = 0
    expert_width: int = 0
    expert_depth: int = 0
    expert_mlp: int = 0
    head_dim: int = 0
    vision_width: int = 0
    vision_depth: int = 0
    vision_heads: int = 0
    vision_mlp: int = 0
    patch_size: int = 0
    stats: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        problems = []
        for name in ("paligemma_variant", "action_expert_variant"):
            if getattr(self, name) not in VARIANTS:
                problems.append(f"{name} '{getattr(self, name)}' (allowed: {', '.join(VARIANTS)})")
        if self.prompt_padding not in PROMPT_PADDING:
            problems.append(f"prompt_padding '{self.prompt_padding}' (allowed: {', '.join(PROMPT_PADDING)})")
        if self.prompt_pad_multiple < 1 or self.tokenizer_max_length < 2:
            problems.append(f"prompt_pad_multiple {self.prompt_pad_multiple} / tokenizer_max_length "
                            f"{self.tokenizer_max_length} (allowed: >= 1 / >= 2)")
        for name in ("bf16_params", "quantile_norm", "sdpa"):
            if getattr(self, name) not in (0, 1):
                problems.append(f"{name} {getattr(self, name)} (allowed: 0, 1)")
        if self.shrunk and not all(getattr(self, f) > 0 for f in SIZE_FIELDS):
            problems.append(f"a shrunken model sets every size field ({', '.join(SIZE_FIELDS)}) > 0")
        if self.shrunk and self.paligemma_variant == self.action_expert_variant:
            problems.append("a shrunken model needs different paligemma_variant and action_expert_variant (the sizes "
                            "are looked up by variant)")
        if self.shrunk and self.resolution % self.patch_size:
            problems.append(f"resolution {self.resolution} is not a multiple of patch_size {self.patch_size}")
        if self.state_dim > self.max_state_dim or self.action_dim > self.max_action_dim:
            problems.append(f"state/action dims {self.state_dim}/{self.action_dim} exceed max_state_dim/"
                            f"max_action_dim {self.max_state_dim}/{self.max_action_dim}")
        if problems:
            raise ValueError("invalid lerobot_pi05 architecture: " + "; ".join(problems))

    @property
    def shrunk(self) -> bool:
        """True when any size field is set: LeRobot's size lookups are redirected while building."""
        return any(getattr(self, f) for f in SIZE_FIELDS)


PRESETS: dict[str, LeRobotPI05Arch] = {
    # LeRobot's real pi05: PaliGemma (Gemma-2B + SigLIP So400m/14 at 224²) + Gemma-300M expert, 4.14B params.
    "pi05": LeRobotPI05Arch(),
    # Trains on CPU in seconds (most of its ~41M parameters are the two 257,152-row token tables).
    "tiny": LeRobotPI05Arch(
        image_size=32, num_cameras=1, state_dim=2, action_dim=2, chunk_size=4, resolution=32,
        tokenizer_max_length=96, bf16_params=0, quantile_norm=0,
        lm_width=64, lm_depth=2, lm_mlp=128, expert_width=32, expert_depth=2, expert_mlp=64, head_dim=16,
        vision_width=32, vision_depth=2, vision_heads=2, vision_mlp=64, patch_size=8,
    ),
}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # a fast tokenizer, or SentencePiece's model
LEROBOT_TOKENIZER = "google/paligemma-3b-pt-224"  # what LeRobot's pi05 processor loads


def hub_cache() -> Path:
    """The local Hugging Face hub cache, as ``huggingface_hub`` resolves it (``HF_HUB_CACHE``, ``HF_HOME``,
    ``XDG_CACHE_HOME``, ...)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def check_recipe_arch(arch: LeRobotPI05Arch) -> None:
    """What a recipe can check on the file system before training (no network, no torch): the tokenizer is a
    local folder with a tokenizer file, or a hub id whose tokenizer file is in the local cache. (The job then
    loads it once at setup: ``processor_lerobot_pi05.check_arch``.)"""
    name = arch.tokenizer
    if not name:
        return
    folder = Path(name).expanduser()
    if folder.is_dir():
        if not any((folder / f).is_file() for f in TOKENIZER_FILES):
            raise ValueError(f"model.arch.tokenizer '{name}': the folder has neither {' nor '.join(TOKENIZER_FILES)}")
        return
    from huggingface_hub import try_to_load_from_cache

    if not any(isinstance(try_to_load_from_cache(name, f), str) for f in TOKENIZER_FILES):
        raise ValueError(f"model.arch.tokenizer '{name}': no such local folder, and no {' or '.join(TOKENIZER_FILES)} "
                         f"of it in the Hugging Face cache ({hub_cache()}); download it first (nothing is fetched at "
                         "run time), or leave model.arch.tokenizer unset for Gemma byte-fallback tokens")
