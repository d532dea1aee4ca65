"""Our collated samples → ``VLAFlowMatching.forward`` inputs, the way LeRobot's SmolVLA pre-processor
(``make_smolvla_pre_post_processors``) and ``SmolVLAPolicy.prepare_images`` / ``prepare_state`` /
``prepare_action`` do it, with their own steps and functions:

- state and actions normalised with LeRobot's ``NormalizerProcessorStep`` (MEAN_STD, SmolVLA's default), then
  zero-padded to ``max_state_dim`` / ``max_action_dim``; flow noise drawn for the padded action dims too;
- the task ended with a newline (``NewLineTaskProcessorStep``) and tokenized by ``TokenizerProcessorStep`` with the
  VLM's own tokenizer (right padding to the batch's longest prompt or to ``tokenizer_max_length``, truncation);
- images resized with padding, top-left (``resize_with_pad``, pad 0), to ``resolution`` and mapped to [-1, 1].
"""

from __future__ import annotations

import functools
import os

import torch

from loongforge_embodied.policies import lerobot_normalize as normalize
from loongforge_embodied.policies.flow_noise import pad_noise
from loongforge_embodied.policies.lerobot_smolvla.configuration_lerobot_smolvla import (
    LeRobotSmolVLAArch,
    hub_cache,
    local_vlm,
)

_steps: dict[int, tuple] = {}


@functools.cache
def load_tokenizer(name: str):
    """The VLM's tokenizer from its local folder or the local hub cache (never the network); one per process."""
    from loongforge.errors import RecipeError
    from transformers import AutoTokenizer

    from loongforge_embodied.policies.lerobot_smolvla.configuration_lerobot_smolvla import (
        PUBLISHED_VLM,
        VLM_FILES,
    )

    # NOTE: every DataLoader worker tokenizes its own batches: no tokenizer thread pool per worker
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    folder = local_vlm(name)
    if folder is None:
        raise RecipeError(f"'{name}': no local folder with {' and '.join(VLM_FILES)}, and no such hub id in the local "
                          f"Hugging Face cache ({hub_cache()}); download it first (e.g. `hf download {PUBLISHED_VLM}`)"
                          " or name a local SmolVLM directory", key="model.arch.vlm")
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # NOTE: a broken tokenizer file fails in many ways (OSError, ValueError, KeyError, ...)
        raise RecipeError(f"'{name}' has no tokenizer that loads from a local folder or the Hugging Face cache "
                          f"({hub_cache()}): {type(e).__name__}: {e}", key="model.arch.vlm") from e


def check_arch(arch: LeRobotSmolVLAArch) -> None:
    """Run once at job setup: the VLM directory is here and its tokenizer loads (in the main process: one clear
    error there, before LeRobot reads the directory)."""
    load_tokenizer(arch.vlm)


def check_stats(arch: LeRobotSmolVLAArch, stats: dict) -> None:
    """Run once at job setup: the dataset statistics hold the mean / std the normaliser needs."""
    normalize.check_stats("lerobot_smolvla", stats)


def _processor_steps(arch: LeRobotSmolVLAArch, stats: dict[str, torch.Tensor]):
    """LeRobot's normaliser, newline and tokenizer steps for ``stats`` (cached per stats object)."""
    hit = _steps.get(id(stats))
    if hit is not None and hit[0] is stats and hit[1] == arch:
        return hit[2]
    from lerobot.processor import NewLineTaskProcessorStep, TokenizerProcessorStep

    steps = (normalize.normalizer_step("lerobot_smolvla", stats,
                                       state_dim=arch.state_dim, action_dim=arch.action_dim),
             NewLineTaskProcessorStep(),
             TokenizerProcessorStep(tokenizer=load_tokenizer(arch.vlm), padding=arch.pad_language_to,
                                    padding_side="right", max_length=arch.tokenizer_max_length))
    _steps[id(stats)] = (stats, arch, steps)
    return steps


def unnormalize(x: torch.Tensor, key: str, *, stats: dict[str, torch.Tensor]) -> torch.Tensor:
    """Inverse of LeRobot's MEAN_STD normalisation of ``key`` (``state`` / ``action``)."""
    return x * stats[f"{key}_std"] + stats[f"{key}_mean"]


def preprocess_images(images: torch.Tensor, *, resolution: int) -> torch.Tensor:
    """(B, cams, 3, H, W) in [0, 1] → (B, cams, 3, res, res) in [-1, 1], as ``SmolVLAPolicy.prepare_images``."""
    from lerobot.policies.common.vla_utils import resize_with_pad

    b, cams = images.shape[:2]
    x = resize_with_pad(images.flatten(0, 1).float(), resolution, resolution, pad_value=0)
    x = x * 2.0 - 1.0
    return x.reshape(b, cams, *x.shape[1:])


def prepare_batch(raw: dict, *, arch: LeRobotSmolVLAArch, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Collated samples (``images``, ``state``, ``task``, optional ``actions``/``action_pad``/``noise``/``time``) →
    model inputs."""
    from lerobot.lerobot_types import TransitionKey
    from lerobot.policies.common.vla_utils import pad_vector
    from lerobot.utils.constants import OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS

    normalize, newline, tokenize = _processor_steps(arch, stats)
    transition = {TransitionKey.OBSERVATION: {"observation.state": raw["state"].float()},
                  TransitionKey.COMPLEMENTARY_DATA: {"task": list(raw["task"])}}
    if "actions" in raw:
        transition[TransitionKey.ACTION] = raw["actions"].float()
    transition = tokenize(newline(normalize(transition)))
    obs = transition[TransitionKey.OBSERVATION]
    out = {"images": preprocess_images(raw["images"], resolution=arch.resolution),
           "lang_tokens": obs[OBS_LANGUAGE_TOKENS], "lang_mask": obs[OBS_LANGUAGE_ATTENTION_MASK].bool(),
           "state": pad_vector(obs["observation.state"], arch.max_state_dim)}
    if "actions" in raw:
        out["actions"] = pad_vector(transition[TransitionKey.ACTION], arch.max_action_dim)
        if "action_pad" in raw:
            out["action_pad"] = raw["action_pad"].bool()
    if "noise" in raw:
        out["noise"] = pad_noise(raw["noise"].float(), arch.max_action_dim)
    if "time" in raw:
        out["time"] = raw["time"].float()
    return out
