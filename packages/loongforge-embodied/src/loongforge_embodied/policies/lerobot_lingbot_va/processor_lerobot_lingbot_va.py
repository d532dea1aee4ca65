"""Our collated samples → the inputs of LeRobot's LingBot-VA, the way ``LingBotVAPolicy._build_training_streams``
and its inference helpers make them, with LeRobot's own functions:

- actions normalised by LeRobot's ``NormalizerProcessorStep`` (mean / std, or identity); LeRobot's LingBot-VA
  pre-processor is identity and expects actions already in [-1, 1]; the state is not an input of LingBot-VA;
- each camera frame resized to ``height`` x ``width`` (bilinear, as ``_encode_training_latents`` /
  ``_camera_frame``), a clip ``(B, cams, 3, T, height, width)`` in [0, 1] (one frame, serving: a clip of one);
- the task cleaned (``clean_prompt``) and tokenized by LeRobot's ``load_tokenizer`` (the ``tokenizer/`` of
  ``wan``), padded to 512 tokens; the empty prompt too (the negative prompt of classifier-free guidance);
- the flow draws of ``_add_noise_stream`` (per-frame timestep ids, noise, whether the clean video copy is noised,
  and the attention mask's chunk and window) from a generator seeded by the sample's own action noise, so a sample
  is identical on any rank. LeRobot draws the timesteps, the noising choice, chunk and window once per batch; we
  draw them per sample (a batch of one is LeRobot's).
"""

from __future__ import annotations

import functools
import os

import torch

from loongforge_embodied.policies import lerobot_normalize as normalize
from loongforge_embodied.policies.lerobot_lingbot_va.configuration_lerobot_lingbot_va import (
    PROMPT_LENGTH,
    LeRobotLingBotVAArch,
)

NUM_TRAIN_TIMESTEPS = 1000
NOISY_COND_PROB = 0.5  # LeRobot's noisy_cond_prob of the video stream (the action stream's is 0)
DRAW_KEYS = ("latent_ids", "latent_noise", "noisy_cond", "cond_ids", "cond_noise", "action_ids", "action_noise",
             "mask_chunk", "mask_window")

_steps: dict[int, tuple] = {}


@functools.cache
def load_tokenizer(name: str):
    """LeRobot's tokenizer of the ``tokenizer/`` folder of the local Wan directory (never the network)."""
    from lerobot.policies.lingbot_va.utils import load_tokenizer as lerobot_load
    from loongforge.errors import RecipeError

    from loongforge_embodied.policies.lerobot_lingbot_va.build import wan_dir

    # NOTE: every DataLoader worker tokenizes its own batches: no tokenizer thread pool per worker
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    folder = wan_dir(name)
    try:
        return lerobot_load(folder, subfolder="tokenizer")
    except Exception as e:  # NOTE: a broken tokenizer file fails in many ways (OSError, ValueError, KeyError, ...)
        detail = str(e).splitlines()[0][:160] if str(e) else ""
        raise RecipeError(f"'{name}' has no tokenizer/ that loads: {type(e).__name__}: {detail}",
                          key="model.arch.wan") from None


def tokenize(prompts: list[str], *, arch: LeRobotLingBotVAArch) -> tuple[torch.Tensor, torch.Tensor]:
    """``_get_t5_prompt_embeds``'s tokenization: cleaned prompts, padded / truncated to 512 tokens."""
    from lerobot.policies.lingbot_va.utils import clean_prompt

    out = load_tokenizer(arch.wan)([clean_prompt(p) for p in prompts], padding="max_length",
                                   max_length=PROMPT_LENGTH, truncation=True, add_special_tokens=True,
                                   return_attention_mask=True, return_tensors="pt")
    return out.input_ids, out.attention_mask.bool()


def check_arch(arch: LeRobotLingBotVAArch) -> None:
    """Run once at job setup: the Wan directory and its tokenizer are here (one clear error in the main process)."""
    from loongforge_embodied.policies.lerobot_lingbot_va.build import wan_dir

    wan_dir(arch.wan)
    load_tokenizer(arch.wan)


def check_stats(arch: LeRobotLingBotVAArch, stats: dict) -> None:
    """Run once at job setup: the dataset statistics hold the mean / std the normaliser needs."""
    normalize.check_stats("lerobot_lingbot_va", stats, normalization=arch.normalization)


def _normalizer(arch: LeRobotLingBotVAArch, stats: dict[str, torch.Tensor]):
    """LeRobot's normaliser step for ``stats`` (cached per stats object)."""
    hit = _steps.get(id(stats))
    if hit is not None and hit[0] is stats and hit[1] == arch:
        return hit[2]
    step = normalize.normalizer_step("lerobot_lingbot_va", stats, state_dim=arch.state_dim,
                                     action_dim=arch.action_dim, normalization=arch.normalization)
    _steps[id(stats)] = (stats, arch, step)
    return step


def unnormalize(x: torch.Tensor, *, arch: LeRobotLingBotVAArch, stats: dict[str, torch.Tensor]) -> torch.Tensor:
    """Inverse of the action normalisation."""
    if arch.normalization == "identity":
        return x
    return x * stats["action_std"].to(x) + stats["action_mean"].to(x)


def prepare_video(images: torch.Tensor, *, arch: LeRobotLingBotVAArch) -> torch.Tensor:
    """(B, cams, [T,] 3, H, W) in [0, 1] → (B, cams, 3, T, height, width), each frame resized bilinearly."""
    import torch.nn.functional as F  # noqa: N812

    if images.ndim == 5:
        images = images.unsqueeze(2)
    b, cams, t = images.shape[:3]
    frames = F.interpolate(images.flatten(0, 2).float(), size=(arch.height, arch.width), mode="bilinear",
                           align_corners=False)
    return frames.view(b, cams, t, 3, arch.height, arch.width).transpose(2, 3)


def _timestep_ids(n: int, g: torch.Generator, *, low: float = 0.0) -> torch.Tensor:
    """``_sample_timestep_id``: ``n`` ids of the 1000 training timesteps, uniform in [low, 1)."""
    u = torch.rand(n, generator=g) * (1.0 - low) + low
    return (u * NUM_TRAIN_TIMESTEPS).clamp(min=0, max=NUM_TRAIN_TIMESTEPS - 1).to(torch.int64)


def flow_draws(noise: torch.Tensor, *, arch: LeRobotLingBotVAArch) -> dict[str, torch.Tensor]:
    """Each sample's draws of LeRobot's ``training_loss_from_streams`` (in its order), from a generator seeded by
    that sample's action noise: identical on any rank and in any batch."""
    f = arch.frame_chunk_size
    out: dict[str, list[torch.Tensor]] = {k: [] for k in DRAW_KEYS}
    for sample in noise:
        seed = int(sample.float().flatten().view(torch.int32).to(torch.int64).sum()) & 0x7FFF_FFFF
        g = torch.Generator().manual_seed(seed)
        out["latent_ids"].append(_timestep_ids(f, g))
        out["latent_noise"].append(torch.randn(*arch.latent_shape, generator=g))
        out["noisy_cond"].append(torch.rand((), generator=g) < NOISY_COND_PROB)
        out["cond_ids"].append(_timestep_ids(f, g, low=0.5))
        out["cond_noise"].append(torch.randn(*arch.latent_shape, generator=g))
        out["action_ids"].append(_timestep_ids(f, g))
        out["action_noise"].append(torch.randn(*arch.action_shape, generator=g))
        out["mask_chunk"].append(torch.randint(1, 5, (), generator=g))
        out["mask_window"].append(torch.randint(4, 65, (), generator=g))
    return {k: torch.stack(v) for k, v in out.items()}


def prepare_batch(raw: dict, *, arch: LeRobotLingBotVAArch,
                  stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Collated samples (``images`` (B, cams, [T,] 3, H, W), ``state``, ``task``, optional ``actions`` / ``noise``
    and the draws of :func:`flow_draws`) → model inputs."""
    from lerobot.lerobot_types import TransitionKey

    b = raw["images"].shape[0]
    ids, mask = tokenize([str(t) for t in raw["task"]], arch=arch)
    empty_ids, empty_mask = tokenize([""], arch=arch)
    out = {"video": prepare_video(raw["images"], arch=arch), "input_ids": ids, "attention_mask": mask,
           "negative_ids": empty_ids.expand(b, -1), "negative_mask": empty_mask.expand(b, -1)}
    if "actions" in raw:
        transition = {TransitionKey.OBSERVATION: {"observation.state": raw["state"].float()},
                      TransitionKey.ACTION: raw["actions"].float()}
        out["actions"] = _normalizer(arch, stats)(transition)[TransitionKey.ACTION]
    if "noise" in raw and not all(k in raw for k in DRAW_KEYS):
        out.update(flow_draws(raw["noise"].float(), arch=arch))
    for key in DRAW_KEYS:
        if key in raw:
            out[key] = raw[key]
    return out
