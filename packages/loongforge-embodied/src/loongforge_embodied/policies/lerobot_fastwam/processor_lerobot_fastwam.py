"""Our collated samples → ``FastWAM`` inputs, the way LeRobot's FastWAM pre-processor
(``make_fastwam_pre_post_processors``) and ``FastWAMPolicy._batch_to_training_sample`` do it, with their own steps
and functions:

- state and actions through ``NormalizerProcessorStep`` (mean / std, LeRobot's FastWAM default, or identity);
  images stay in [0, 1] (the model maps them to the VAE's [-1, 1]);
- each camera resized to ``height`` x ``width / cameras`` (``_resize_frames``: bilinear, antialiased) and the
  cameras put side by side in their order (NOTE: LeRobot puts them in the sorted order of their keys), a clip
  ``(B, 3, T, H, W)``; one frame (serving) is the clip's first;
- the task in LeRobot's prompt template, tokenized by LeRobot's ``WanTokenizer`` (padded to
  ``tokenizer_max_length``, truncated); the frozen text encoder runs in the model;
- the flow draws: ``noise`` / ``time`` of the actions come from the data pipeline; the video's (``video_noise``,
  ``video_time``) from a generator seeded by the sample's own action noise, so a sample is identical on any rank.
"""

from __future__ import annotations

import functools
import os

import torch

from loongforge_embodied.policies import lerobot_normalize as normalize
from loongforge_embodied.policies.lerobot_fastwam.configuration_lerobot_fastwam import LeRobotFastWAMArch

_steps: dict[int, tuple] = {}


@functools.cache
def load_tokenizer(name: str, max_length: int):
    """LeRobot's ``WanTokenizer`` of the local tokenizer folder (never the network); one per process."""
    from lerobot.policies.fastwam.wan.components import build_wan_tokenizer
    from loongforge.errors import RecipeError

    from loongforge_embodied.policies.lerobot_fastwam.build import tokenizer_dir

    # NOTE: every DataLoader worker tokenizes its own batches: no tokenizer thread pool per worker
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    folder = tokenizer_dir(name)
    try:
        return build_wan_tokenizer(model_id=folder, tokenizer_max_len=max_length)
    except Exception as e:  # NOTE: a broken tokenizer file fails in many ways (OSError, ValueError, KeyError, ...)
        raise RecipeError(f"'{name}' has no tokenizer that loads from a local folder: {type(e).__name__}: {e}",
                          key="model.arch.tokenizer") from e


def check_arch(arch: LeRobotFastWAMArch) -> None:
    """Run once at job setup: the Wan directory and the tokenizer are here (one clear error in the main process)."""
    from loongforge_embodied.policies.lerobot_fastwam.build import wan_dir

    wan_dir(arch.wan)
    load_tokenizer(arch.tokenizer, arch.tokenizer_max_length)


def check_stats(arch: LeRobotFastWAMArch, stats: dict) -> None:
    """Run once at job setup: the dataset statistics hold the mean / std the normaliser needs."""
    normalize.check_stats("lerobot_fastwam", stats, normalization=arch.normalization)


def _normalizer(arch: LeRobotFastWAMArch, stats: dict[str, torch.Tensor]):
    """LeRobot's normaliser step for ``stats`` (cached per stats object)."""
    hit = _steps.get(id(stats))
    if hit is not None and hit[0] is stats and hit[1] == arch:
        return hit[2]

    step = normalize.normalizer_step("lerobot_fastwam", stats,
                                     state_dim=arch.state_dim, action_dim=arch.action_dim,
                                     normalization=arch.normalization)
    _steps[id(stats)] = (stats, arch, step)
    return step


def unnormalize(x: torch.Tensor, *, arch: LeRobotFastWAMArch, stats: dict[str, torch.Tensor]) -> torch.Tensor:
    """Inverse of the action normalisation (LeRobot's post-processor)."""
    if arch.normalization == "identity":
        return x
    return x * stats["action_std"].to(x) + stats["action_mean"].to(x)


def prepare_video(images: torch.Tensor, *, arch: LeRobotFastWAMArch) -> torch.Tensor:
    """(B, cams, [T,] 3, H, W) in [0, 1] → the clip (B, 3, T, height, width), cameras side by side (one frame: a
    clip of one frame)."""
    from lerobot.policies.fastwam.modeling_fastwam import _resize_frames

    if images.ndim == 5:
        images = images.unsqueeze(2)
    cams = images.shape[1]
    per_cam = (arch.height, arch.width // cams)
    frames = torch.cat([_resize_frames(images[:, i].float(), per_cam) for i in range(cams)], dim=-1)
    return frames.permute(0, 2, 1, 3, 4)


def video_draws(noise: torch.Tensor, *, arch: LeRobotFastWAMArch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's video flow noise (its latent's shape) and uniform time, from a generator seeded by that
    sample's action noise: identical on any rank and in any batch."""
    out_noise, out_time = [], []
    for sample in noise:
        seed = int(sample.float().flatten().view(torch.int32).to(torch.int64).sum()) & 0x7FFF_FFFF
        g = torch.Generator().manual_seed(seed)
        out_noise.append(torch.randn(*arch.latent_shape, generator=g))
        out_time.append(torch.rand((), generator=g))
    return torch.stack(out_noise), torch.stack(out_time)


def prepare_batch(raw: dict, *, arch: LeRobotFastWAMArch, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Collated samples (``images`` (B, cams, [T,] 3, H, W), ``state``, ``task``, optional ``actions`` /
    ``action_pad`` / ``noise`` / ``time`` / ``video_noise`` / ``video_time``) → model inputs."""
    from lerobot.lerobot_types import TransitionKey
    from lerobot.policies.fastwam.configuration_fastwam import FastWAMConfig

    normalize = _normalizer(arch, stats)
    transition = {TransitionKey.OBSERVATION: {"observation.state": raw["state"].float()}}
    if "actions" in raw:
        transition[TransitionKey.ACTION] = raw["actions"].float()
    transition = normalize(transition)
    prompts = [FastWAMConfig.prompt_template.format(task=str(t)) for t in raw["task"]]
    ids, mask = load_tokenizer(arch.tokenizer, arch.tokenizer_max_length)(prompts, return_mask=True,
                                                                         add_special_tokens=True)
    out = {"video": prepare_video(raw["images"], arch=arch), "input_ids": ids, "attention_mask": mask.bool(),
           "state": transition[TransitionKey.OBSERVATION]["observation.state"]}
    if "actions" in raw:
        out["actions"] = transition[TransitionKey.ACTION]
        out["action_pad"] = raw.get("action_pad", torch.zeros(out["actions"].shape[:2], dtype=torch.bool)).bool()
    if "noise" in raw:
        out["noise"] = raw["noise"].float()
        if "video_noise" not in raw:
            out["video_noise"], out["video_time"] = video_draws(out["noise"], arch=arch)
    for key in ("time", "video_noise", "video_time"):
        if key in raw:
            out[key] = raw[key].float()
    return out
