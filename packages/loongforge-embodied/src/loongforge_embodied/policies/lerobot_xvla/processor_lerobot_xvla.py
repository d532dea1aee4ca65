"""Our collated samples → ``XVLAModel`` inputs, the way LeRobot's X-VLA pre-processor
(``make_xvla_pre_post_processors``) and ``XVLAPolicy._build_model_inputs`` / ``_prepare_action_targets`` do it,
with their own steps and functions:

- the task tokenized by ``TokenizerProcessorStep`` (right padding to ``tokenizer_max_length`` or the batch's longest
  prompt, truncation); no newline appended (X-VLA's pipeline has none);
- images (in [0, 1]) ImageNet-normalised (``XVLAImageNetNormalizeProcessorStep``), then resized with padding (pad 0)
  to ``resolution``; views past the cameras are zero images with a false mask (NOTE: LeRobot's step finds cameras by
  the ``observation.images.`` prefix and leaves a camera keyed otherwise, e.g. ``observation.image``, unnormalised:
  we normalise every camera, so such a dataset's export needs ``image_keys`` given to LeRobot's step);
- state and actions through ``NormalizerProcessorStep`` (identity, LeRobot's X-VLA default, or mean / std), state
  zero-padded to ``max_state_dim``, actions to the action space's width; flow noise drawn for the padded columns;
- the embodiment's ``domain_id`` for every sample (``XVLAAddDomainIdProcessorStep``).
"""

from __future__ import annotations

import functools
import os

import torch

from loongforge_embodied.policies import lerobot_normalize as normalize
from loongforge_embodied.policies.flow_noise import pad_noise
from loongforge_embodied.policies.lerobot_xvla.configuration_lerobot_xvla import (
    PUBLISHED_TOKENIZER,
    LeRobotXVLAArch,
    hub_cache,
    local_dir,
)

TOKENIZER_FILES = ("tokenizer_config.json",)
_steps: dict[int, tuple] = {}


@functools.cache
def load_tokenizer(name: str):
    """The prompt tokenizer from its local folder or the local hub cache (never the network); one per process."""
    from loongforge.errors import RecipeError
    from transformers import AutoTokenizer

    # NOTE: every DataLoader worker tokenizes its own batches: no tokenizer thread pool per worker
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    folder = local_dir(name, TOKENIZER_FILES)
    if folder is None:
        raise RecipeError(f"'{name}': no local folder with {TOKENIZER_FILES[0]}, and no such hub id in the local "
                          f"Hugging Face cache ({hub_cache()}); download it first (e.g. `hf download "
                          f"{PUBLISHED_TOKENIZER}`) or name a local tokenizer directory", key="model.arch.tokenizer")
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # NOTE: a broken tokenizer file fails in many ways (OSError, ValueError, KeyError, ...)
        raise RecipeError(f"'{name}' has no tokenizer that loads from a local folder: {type(e).__name__}: {e}",
                          key="model.arch.tokenizer") from e


def check_arch(arch: LeRobotXVLAArch) -> None:
    """Run once at job setup: the Florence-2 config and the tokenizer are here (one clear error in the main
    process, before LeRobot reads them)."""
    from loongforge_embodied.policies.lerobot_xvla.build import florence_config

    florence_config(arch.florence)
    load_tokenizer(arch.tokenizer)


def check_stats(arch: LeRobotXVLAArch, stats: dict) -> None:
    """Run once at job setup: the dataset statistics hold the mean / std the normaliser needs."""
    normalize.check_stats("lerobot_xvla", stats, normalization=arch.normalization)


def _processor_steps(arch: LeRobotXVLAArch, stats: dict[str, torch.Tensor]):
    """LeRobot's normaliser, tokenizer and ImageNet steps for ``stats`` (cached per stats object)."""
    hit = _steps.get(id(stats))
    if hit is not None and hit[0] is stats and hit[1] == arch:
        return hit[2]
    from lerobot.policies.xvla.processor_xvla import XVLAImageNetNormalizeProcessorStep
    from lerobot.processor import TokenizerProcessorStep

    steps = (normalize.normalizer_step("lerobot_xvla", stats,
                                       state_dim=arch.state_dim, action_dim=arch.action_dim,
                                       normalization=arch.normalization),
             TokenizerProcessorStep(tokenizer=load_tokenizer(arch.tokenizer), padding=arch.pad_language_to,
                                    padding_side="right", max_length=arch.tokenizer_max_length),
             XVLAImageNetNormalizeProcessorStep())
    _steps[id(stats)] = (stats, arch, steps)
    return steps


def unnormalize(x: torch.Tensor, *, arch: LeRobotXVLAArch, stats: dict[str, torch.Tensor]) -> torch.Tensor:
    """Inverse of the action normalisation (LeRobot's post-processor)."""
    if arch.normalization == "identity":
        return x
    return x * stats["action_std"].to(x) + stats["action_mean"].to(x)


def prepare_images(images: torch.Tensor, *, arch: LeRobotXVLAArch, imagenet) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, cams, 3, H, W) in [0, 1] → (B, views, 3, res, res) and the (B, views) mask, as LeRobot's ImageNet step
    and ``XVLAPolicy._prepare_images``."""
    from lerobot.lerobot_types import TransitionKey
    from lerobot.policies.common.vla_utils import resize_with_pad

    b, cams = images.shape[:2]
    obs = {f"observation.images.{i}": images[:, i].float() for i in range(cams)}
    obs = imagenet({TransitionKey.OBSERVATION: obs})[TransitionKey.OBSERVATION]
    views = []
    for i in range(cams):
        img = obs[f"observation.images.{i}"]
        if arch.resolution:
            img = resize_with_pad(img, arch.resolution, arch.resolution, pad_value=0.0)
        views.append(img)
    x = torch.stack(views, dim=1)
    mask = torch.ones(b, cams, dtype=torch.bool)
    extra = arch.views - cams
    if extra > 0:
        x = torch.cat([x, x.new_zeros(b, extra, *x.shape[2:])], dim=1)
        mask = torch.cat([mask, mask.new_zeros(b, extra)], dim=1)
    return x, mask


def prepare_batch(raw: dict, *, arch: LeRobotXVLAArch, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Collated samples (``images``, ``state``, ``task``, optional ``actions``/``noise``/``time``) → model inputs.
    ``time`` is X-VLA's flow time: the weight of the noise (1: pure noise)."""
    from lerobot.lerobot_types import TransitionKey
    from lerobot.policies.common.vla_utils import pad_vector
    from lerobot.utils.constants import OBS_LANGUAGE_TOKENS

    normalize, tokenize, imagenet = _processor_steps(arch, stats)
    transition = {TransitionKey.OBSERVATION: {"observation.state": raw["state"].float()},
                  TransitionKey.COMPLEMENTARY_DATA: {"task": list(raw["task"])}}
    if "actions" in raw:
        transition[TransitionKey.ACTION] = raw["actions"].float()
    transition = tokenize(normalize(transition))
    obs = transition[TransitionKey.OBSERVATION]
    images, mask = prepare_images(raw["images"], arch=arch, imagenet=imagenet)
    b = images.shape[0]
    out = {"input_ids": obs[OBS_LANGUAGE_TOKENS], "images": images, "image_mask": mask,
           "state": pad_vector(obs["observation.state"], arch.max_state_dim),
           "domain_id": torch.full((b,), arch.domain_id, dtype=torch.long)}
    if "actions" in raw:
        out["actions"] = pad_vector(transition[TransitionKey.ACTION], arch.action_width)
    if "noise" in raw:
        out["noise"] = pad_noise(raw["noise"].float(), arch.action_width)
    if "time" in raw:
        out["time"] = raw["time"].float()
    return out
