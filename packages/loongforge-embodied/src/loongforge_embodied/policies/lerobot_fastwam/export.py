"""Export / load in LeRobot's own FastWAM layout: ``config.json`` (``FastWAMConfig``, type ``fastwam``) +
``model.safetensors`` (``FastWAMPolicy``'s names: the two experts and the state encoder), which
``FastWAMPolicy.from_pretrained(dir)`` loads strictly.

As in LeRobot, the frozen VAE and text encoder are not in the export: ``config.json``'s ``text_encoder_model_id`` /
``tokenizer_model_id`` are the recipe's ``model.arch.wan`` / ``model.arch.tokenizer``, and LeRobot reads the VAE from
the ``Wan-AI/Wan2.2-TI2V-5B-Diffusers`` snapshot of its Hugging Face cache. ``loongforge.json`` next to them keeps
what ``FastWAMConfig`` cannot hold: the dataset's normalisation statistics and our arch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from loongforge_embodied.policies.lerobot_export import staged_dir
from loongforge_embodied.policies.lerobot_fastwam.configuration_lerobot_fastwam import LeRobotFastWAMArch

SIDECAR = "loongforge.json"
STATS_PREFIX = "stats."


def write_pretrained(out_dir: Path, *, arch: LeRobotFastWAMArch, weights: dict[str, torch.Tensor],
                     features: dict[str, Any]) -> Path:
    """Write atomically (staging dir + rename). ``features``: the camera keys and the state's feature key."""
    from safetensors.torch import save_file

    from loongforge_embodied.policies.lerobot_fastwam.build import fastwam_config

    out_dir = Path(out_dir)
    with staged_dir(out_dir) as staging:
        config = fastwam_config(arch, cameras=list(features["cameras"]),
                                state_key=features.get("state", "observation.state"))
        config._save_pretrained(staging)
        model = {k: v.contiguous() for k, v in weights.items() if not k.startswith(STATS_PREFIX)}
        save_file(model, str(staging / "model.safetensors"))
        stats = {k[len(STATS_PREFIX):]: v.tolist() for k, v in weights.items() if k.startswith(STATS_PREFIX)}
        (staging / SIDECAR).write_text(json.dumps({"arch": arch.to_dict(), "stats": stats}, indent=1))
    return out_dir


def serving_note(arch: LeRobotFastWAMArch) -> str:
    """What loading the export in LeRobot needs: the frozen parts its config names, and the camera order."""
    return (f"LeRobot's FastWAM loads its text encoder from '{arch.wan}' (config.json's text_encoder_model_id), its "
            f"tokenizer from '{arch.tokenizer}' and its VAE from the Wan-AI/Wan2.2-TI2V-5B-Diffusers snapshot of the "
            "Hugging Face cache: keep them reachable where the export is loaded; it puts the cameras side by side in "
            "the sorted order of their keys")


def load_model(path: str | Path):
    """Our ``LeRobotFastWAMModel`` of an exported directory, strictly; the statistics from ``loongforge.json``."""
    from loongforge.bounded_json import read_json_object
    from loongforge.checkpoint import check_shapes
    from loongforge.checkpoint.safetensors_io import read_header
    from loongforge.errors import CheckpointError
    from safetensors.torch import load_file

    from loongforge_embodied.policies.lerobot_fastwam.modeling_lerobot_fastwam import LeRobotFastWAMModel

    path = Path(path)
    sidecar = path / SIDECAR
    if not sidecar.is_file():
        raise CheckpointError(f"{path}: no {SIDECAR} (the arch and statistics our FastWAM export writes)")
    meta = read_json_object(sidecar, error=CheckpointError)
    try:
        arch = LeRobotFastWAMArch(**meta["arch"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{sidecar}: {(str(exc).splitlines() or [''])[0][:300]}") from None
    model = LeRobotFastWAMModel(arch)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith(STATS_PREFIX)}
    weights = path / "model.safetensors"
    check_shapes(expected, {k: tuple(v["shape"]) for k, v in read_header(weights).items()},
                 where=f"{weights} (against {path / 'config.json'})")
    state = load_file(str(weights))
    model.load_state_dict({**state, **{k: v for k, v in model.state_dict().items() if k.startswith(STATS_PREFIX)}},
                          strict=True)
    model.set_stats({k: torch.tensor(v) for k, v in meta.get("stats", {}).items()})
    return model
