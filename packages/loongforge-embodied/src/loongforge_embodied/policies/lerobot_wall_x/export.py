"""Export / load in LeRobot's own Wall-X layout: ``config.json`` (``WallXConfig``, type ``wall_x``) +
``model.safetensors`` (``WallXPolicy``'s names, ``model.…``), which ``WallXPolicy.from_pretrained(dir)`` loads.

``WallXPolicy`` first builds its network from a Wall-X model directory (``pretrained_name_or_path``: config,
Qwen2.5-VL processor, ``model.safetensors``): the export holds one under ``base/`` (the same weights under
``Qwen2_5_VLMoEForAction``'s names) and its ``config.json`` names it by absolute path. ``loongforge.json`` keeps what
``WallXConfig`` cannot hold: the dataset's mean / std statistics and our arch. LeRobot's pre/post-processor files are
not written (``make_wall_x_pre_post_processors(config, dataset_stats)`` builds them from those statistics).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from loongforge_embodied.policies.lerobot_export import staged_dir
from loongforge_embodied.policies.lerobot_wall_x.configuration_lerobot_wall_x import LeRobotWallXArch

SIDECAR = "loongforge.json"
STATS_PREFIX = "stats."
PREFIX = "model."  # WallXPolicy's attribute holding Qwen2_5_VLMoEForAction
BASE = "base"
HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


def _network(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``Qwen2_5_VLMoEForAction``'s weights (no prefix), contiguous; the LM head left out where it is the embeddings
    (tied: LeRobot's loader restores it). NOTE: tied by value, not storage: a gathered state dict holds copies."""
    net = {k[len(PREFIX):]: v for k, v in weights.items() if k.startswith(PREFIX)}
    if HEAD in net and EMBED in net and net[HEAD].shape == net[EMBED].shape and torch.equal(net[HEAD], net[EMBED]):
        del net[HEAD]
    return {k: v.contiguous() for k, v in net.items()}


def write_pretrained(out_dir: Path, *, arch: LeRobotWallXArch, weights: dict[str, torch.Tensor],
                     features: dict[str, Any]) -> Path:
    """Write atomically (staging dir + rename). ``features``: the camera keys and the state's feature key."""
    from safetensors.torch import save_file

    from loongforge_embodied.policies.lerobot_wall_x.build import base_dir, load_base, policy_config

    out_dir = Path(out_dir).resolve()
    network = _network(weights)
    config, processor = load_base(arch)
    with staged_dir(out_dir) as staging:
        policy_config(arch, base=str(out_dir / BASE), cameras=list(features["cameras"]),
                      state_key=features.get("state", "observation.state"))._save_pretrained(staging)
        save_file({PREFIX + k: v for k, v in network.items()}, str(staging / "model.safetensors"))
        (staging / BASE).mkdir()
        config.save_pretrained(staging / BASE)
        processor.save_pretrained(staging / BASE)
        save_file(network, str(staging / BASE / "model.safetensors"), metadata={"format": "pt"})
        stats = {}
        for k, v in weights.items():
            if k.startswith(STATS_PREFIX):
                name = k[len(STATS_PREFIX):]
                stats[name] = v[: arch.state_dim if name.startswith("state") else arch.action_dim].tolist()
        sizes = {**arch.to_dict(), "base": base_dir(arch)}
        (staging / SIDECAR).write_text(json.dumps({"arch": sizes, "stats": stats}, indent=1))
    return out_dir


def serving_note(arch: LeRobotWallXArch) -> str:
    """What loading the export in LeRobot needs."""
    return ("LeRobot's WallXPolicy.from_pretrained builds from the export's base/ directory (by absolute path: move "
            "the export and update config.json's pretrained_name_or_path); its pre-processor is "
            "make_wall_x_pre_post_processors with the mean / std in loongforge.json; under transformers >= 5.6 load "
            "and run it inside loongforge_embodied.policies.lerobot_wall_x.adaptations.adapted()")


def arch_from_dir(path: str | Path) -> LeRobotWallXArch:
    """Our arch of an exported dir (its ``loongforge.json``), reading the network from the export's ``base/``."""
    from loongforge.bounded_json import read_json_object
    from loongforge.errors import CheckpointError

    path = Path(path)
    sidecar = path / SIDECAR
    if not sidecar.is_file():
        raise CheckpointError(f"{path}: no {SIDECAR} (not a lerobot_wall_x export)")
    arch = read_json_object(sidecar, error=CheckpointError).get("arch")
    try:
        if not isinstance(arch, dict):
            raise TypeError(f"a JSON object of sizes is expected, got {type(arch).__name__}")
        arch = LeRobotWallXArch.from_dict(arch)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{sidecar}: key 'arch': {(str(exc).splitlines() or [''])[0][:300]}") from None
    return arch.with_overrides(base=str((path / BASE).resolve()), load_weights=0) if (path / BASE).is_dir() else arch


def load_model(path: str | Path):
    """Our ``LeRobotWallXModel`` of an exported directory (statistics from ``loongforge.json``), strictly."""
    from loongforge.bounded_json import read_json_object
    from loongforge.checkpoint import check_shapes
    from loongforge.checkpoint.safetensors_io import read_header
    from loongforge.errors import CheckpointError, RecipeError
    from safetensors.torch import load_file

    from loongforge_embodied.policies.lerobot_wall_x.modeling_lerobot_wall_x import LeRobotWallXModel

    path = Path(path)
    arch = arch_from_dir(path)
    try:
        model = LeRobotWallXModel(arch)
    except RecipeError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    weights = path / "model.safetensors"
    expected = {PREFIX + k: tuple(v.shape) for k, v in _network(model.state_dict()).items()}
    check_shapes(expected, {k: tuple(v["shape"]) for k, v in read_header(weights).items()},
                 where=f"{weights} (against {path / SIDECAR})")
    state = load_file(str(weights))
    missing, unexpected = model.load_state_dict(state, strict=False)
    left = [k for k in missing if not k.startswith(STATS_PREFIX) and k != PREFIX + HEAD]
    if left or unexpected:  # NOTE: the header matched: only a tied head and the statistics come from elsewhere
        raise CheckpointError(f"{weights}: missing {left[:3]}, unexpected {unexpected[:3]}")
    stats = read_json_object(path / SIDECAR, error=CheckpointError).get("stats", {})
    model.set_stats({k: torch.tensor(v) for k, v in stats.items()})
    return model
