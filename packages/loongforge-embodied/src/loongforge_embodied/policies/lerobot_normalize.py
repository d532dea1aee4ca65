"""LeRobot's mean / std normaliser step for the lerobot_* policies that normalise state and action by the dataset's
mean and std (SmolVLA, X-VLA, Wall-X, FastWAM): our statistics (``state_mean``, ``action_std``, ...) in LeRobot's
layout, the job-setup check that they are there, and LeRobot's ``NormalizerProcessorStep`` built from them."""

from __future__ import annotations

import torch


def lerobot_stats(policy: str, stats: dict, *, normalization: str | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """``stats`` as LeRobot's ``{"observation.state": {"mean", "std"}, "action": {...}}``; ValueError naming what
    is missing. ``normalization`` (a policy's own switch, where it has one): ``"identity"`` needs none."""
    if normalization == "identity":
        return {}
    mode = f" '{normalization}'" if normalization is not None else ""
    out = {}
    for ours, theirs in (("state", "observation.state"), ("action", "action")):
        missing = [f"{ours}_{k}" for k in ("mean", "std") if f"{ours}_{k}" not in stats]
        if missing:
            raise ValueError(f"{policy} normalisation{mode} needs {missing} from the dataset statistics")
        out[theirs] = {k: torch.as_tensor(stats[f"{ours}_{k}"], dtype=torch.float32) for k in ("mean", "std")}
    return out


def check_stats(policy: str, stats: dict, *, normalization: str | None = None) -> None:
    """Run once at job setup: the dataset statistics hold what the normaliser needs (one RecipeError on ``data``)."""
    from loongforge.errors import RecipeError

    try:
        lerobot_stats(policy, stats, normalization=normalization)
    except ValueError as exc:
        raise RecipeError(str(exc), key="data") from None


def normalizer_step(policy: str, stats: dict, *, state_dim: int, action_dim: int,
                    normalization: str | None = None):
    """LeRobot's ``NormalizerProcessorStep`` over state and action: mean / std, or identity where
    ``normalization`` says so."""
    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.processor import NormalizerProcessorStep

    features = {"observation.state": PolicyFeature(type=FeatureType.STATE, shape=(state_dim,)),
                "action": PolicyFeature(type=FeatureType.ACTION, shape=(action_dim,))}
    mode = NormalizationMode.IDENTITY if normalization == "identity" else NormalizationMode.MEAN_STD
    return NormalizerProcessorStep(features=features, norm_map={FeatureType.STATE: mode, FeatureType.ACTION: mode},
                                   stats=lerobot_stats(policy, stats, normalization=normalization))
