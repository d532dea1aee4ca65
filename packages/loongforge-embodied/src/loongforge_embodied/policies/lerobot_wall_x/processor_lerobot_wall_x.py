"""Our collated samples → Wall-X inputs, made by LeRobot's own steps and functions, as ``WallXPolicy`` trains:

- state and actions normalised by LeRobot's ``NormalizerProcessorStep`` (MEAN_STD, Wall-X's default) and the task
  ended with a period (``WallXTaskProcessor``), as ``make_wall_x_pre_post_processors`` chains them;
- then ``WallXPolicy.preprocess_inputs`` itself: frames resized (256 on the long side, then Qwen2.5-VL's 28-pixel
  grid), Wall-X's prompt (the cameras' names, the task, a proprioception token, ``chunk_size`` action tokens),
  tokenized with the directory's Qwen2.5-VL processor; state / actions zero-padded to ``max_*_dim`` with their
  masks; the MoE token types and the 3-D RoPE positions.

Flow noise (padded to ``max_action_dim``) and time pass through from the data pipeline.
"""

from __future__ import annotations

import functools

import torch

from loongforge_embodied.policies import lerobot_normalize as normalize
from loongforge_embodied.policies.flow_noise import pad_noise
from loongforge_embodied.policies.lerobot_wall_x.configuration_lerobot_wall_x import LeRobotWallXArch

MODEL_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "position_ids", "proprioception",
              "agent_pos_mask", "dof_mask", "moe_token_types")
_steps: dict[int, tuple] = {}


def check_arch(arch: LeRobotWallXArch) -> None:
    """Run once at job setup: the Wall-X directory is here, its processor loads and its widths are the arch's (in the
    main process: one clear error there, not a worker's traceback)."""
    from loongforge_embodied.policies.lerobot_wall_x.build import load_base

    load_base(arch)


def check_stats(arch: LeRobotWallXArch, stats: dict) -> None:
    """Run once at job setup: the dataset statistics hold the mean / std the normaliser needs."""
    normalize.check_stats("lerobot_wall_x", stats)


class _Preprocessor:
    """What ``WallXPolicy.preprocess_inputs`` reads of its policy (``config``; ``model``'s processor, action
    tokenizer and RoPE index), without building LeRobot's network: that function runs as LeRobot wrote it."""

    def __init__(self, arch: LeRobotWallXArch):
        from types import SimpleNamespace

        from lerobot.policies.wall_x.modeling_wall_x import Qwen2_5_VLMoEForAction, WallXPolicy

        from loongforge_embodied.policies.lerobot_wall_x.build import load_base, policy_config

        config, processor = load_base(arch)
        self.config = policy_config(arch, base=arch.base)
        self.model = SimpleNamespace(processor=processor, action_tokenizer=None, get_rope_index=functools.partial(
            Qwen2_5_VLMoEForAction.get_rope_index, SimpleNamespace(config=config)))
        self._run = functools.partial(WallXPolicy.preprocess_inputs, self)

    def __call__(self, batch: dict, **kw):
        return self._run(batch, **kw)


def _processor_steps(arch: LeRobotWallXArch, stats: dict[str, torch.Tensor]):
    """LeRobot's normaliser and task steps for ``stats`` and the preprocessor (cached per stats object)."""
    hit = _steps.get(id(stats))
    if hit is not None and hit[0] is stats and hit[1] == arch:
        return hit[2]
    from lerobot.policies.wall_x.processor_wall_x import WallXTaskProcessor

    steps = (normalize.normalizer_step("lerobot_wall_x", stats,
                                       state_dim=arch.state_dim, action_dim=arch.action_dim),
             WallXTaskProcessor(), _Preprocessor(arch))
    _steps[id(stats)] = (stats, arch, steps)
    return steps


def unnormalize(x: torch.Tensor, key: str, *, stats: dict[str, torch.Tensor]) -> torch.Tensor:
    """Inverse of LeRobot's MEAN_STD normalisation of ``key`` (``state`` / ``action``)."""
    return x * stats[f"{key}_std"] + stats[f"{key}_mean"]


def prepare_batch(raw: dict, *, arch: LeRobotWallXArch, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Collated samples (``images`` in [0, 1], ``state``, ``task``, optional ``actions``/``noise``/``time``) → model
    inputs (``actions``: normalised and padded)."""
    from lerobot.lerobot_types import TransitionKey

    normalize, task, preprocess = _processor_steps(arch, stats)
    transition = {TransitionKey.OBSERVATION: {"observation.state": raw["state"].float()},
                  TransitionKey.COMPLEMENTARY_DATA: {"task": list(raw["task"])}}
    if "actions" in raw:
        transition[TransitionKey.ACTION] = raw["actions"].float()
    transition = task(normalize(transition))
    batch = {k: raw["images"][:, i].float() for i, k in enumerate(arch.cameras())}
    batch["observation.state"] = transition[TransitionKey.OBSERVATION]["observation.state"]
    batch["task"] = transition[TransitionKey.COMPLEMENTARY_DATA]["task"]
    if "actions" in raw:
        batch["action"] = transition[TransitionKey.ACTION]
    inputs = preprocess(batch, compute_position_ids=True)
    out = {k: inputs[k] for k in MODEL_KEYS}
    if "actions" in raw:
        out["actions"] = inputs["action_chunk"]
    if "noise" in raw:
        out["noise"] = pad_noise(raw["noise"].float(), arch.max_action_dim)
    if "time" in raw:
        out["time"] = raw["time"].float()
    return out
