"""Export / load in LeRobot's own LingBot-VA layout: ``config.json`` (``LingBotVAConfig``, type ``lingbot_va``) +
``model.safetensors`` (``LingBotVAPolicy``'s names: the transformer), which ``LingBotVAPolicy.from_pretrained(dir)``
loads strictly.

As in LeRobot, the frozen VAE, text encoder and tokenizer are not in the export: ``config.json``'s
``wan_pretrained_path`` is the recipe's ``model.arch.wan``. ``loongforge.json`` next to them keeps what
``LingBotVAConfig`` cannot hold: the dataset's normalisation statistics and our arch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from loongforge_embodied.policies.lerobot_export import staged_dir
from loongforge_embodied.policies.lerobot_lingbot_va.configuration_lerobot_lingbot_va import (
    LeRobotLingBotVAArch,
)

SIDECAR = "loongforge.json"
STATS_PREFIX = "stats."


def write_pretrained(out_dir: Path, *, arch: LeRobotLingBotVAArch, weights: dict[str, torch.Tensor],
                     features: dict[str, Any]) -> Path:
    """Write atomically (staging dir + rename). ``features``: the camera keys and the state's feature key."""
    from safetensors.torch import save_file

    from loongforge_embodied.policies.lerobot_lingbot_va.build import lingbot_config

    out_dir = Path(out_dir)
    with staged_dir(out_dir) as staging:
        config = lingbot_config(arch, cameras=list(features["cameras"]),
                                state_key=features.get("state", "observation.state"))
        config._save_pretrained(staging)
        model = {k: v.contiguous() for k, v in weights.items() if not k.startswith(STATS_PREFIX)}
        save_file(model, str(staging / "model.safetensors"))
        stats = {k[len(STATS_PREFIX):]: v.tolist() for k, v in weights.items() if k.startswith(STATS_PREFIX)}
        (staging / SIDECAR).write_text(json.dumps({"arch": arch.to_dict(), "stats": stats}, indent=1))
    return out_dir


def serving_note(arch: LeRobotLingBotVAArch) -> str:
    """What loading the export in LeRobot needs: the frozen parts its config names, and the action scale."""
    scale = ("the actions are the dataset's own" if arch.normalization == "identity" else
             "its actions are normalised by the dataset's mean / std (loongforge.json's stats), not LeRobot's "
             "q01 / q99: unnormalise with those")
    return (f"LeRobot's LingBot-VA loads its VAE, text encoder and tokenizer from '{arch.wan}' (config.json's "
            f"wan_pretrained_path): keep it reachable where the export is loaded; {scale}; config.json's attn_mode "
            "is torch (sampling): LeRobot trains with attn_mode flex")


def load_model(path: str | Path):
    """Our ``LeRobotLingBotVAModel`` of an exported directory, strictly; the statistics from ``loongforge.json``."""
    from loongforge.bounded_json import read_json_object
    from loongforge.checkpoint import check_shapes
    from loongforge.checkpoint.safetensors_io import read_header
    from loongforge.errors import CheckpointError
    from safetensors.torch import load_file

    from loongforge_embodied.policies.lerobot_lingbot_va.modeling_lerobot_lingbot_va import (
        LeRobotLingBotVAModel,
    )

    path = Path(path)
    sidecar = path / SIDECAR
    if not sidecar.is_file():
        raise CheckpointError(f"{path}: no {SIDECAR} (the arch and statistics our LingBot-VA export writes)")
    meta = read_json_object(sidecar, error=CheckpointError)
    try:
        arch = LeRobotLingBotVAArch(**meta["arch"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{sidecar}: {(str(exc).splitlines() or [''])[0][:300]}") from None
    model = LeRobotLingBotVAModel(arch)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith(STATS_PREFIX)}
    weights = path / "model.safetensors"
    check_shapes(expected, {k: tuple(v["shape"]) for k, v in read_header(weights).items()},
                 where=f"{weights} (against {path / 'config.json'})")
    state = load_file(str(weights))
    model.load_state_dict({**state, **{k: v for k, v in model.state_dict().items() if k.startswith(STATS_PREFIX)}},
                          strict=True)
    model.set_stats({k: torch.tensor(v) for k, v in meta.get("stats", {}).items()})
    return model
