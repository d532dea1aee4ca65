"""Export / load in LeRobot's own X-VLA layout: ``config.json`` (``XVLAConfig``, type ``xvla``, its
``florence_config`` inline) + ``model.safetensors`` (``XVLAPolicy``'s names), which ``XVLAPolicy.from_pretrained(dir)``
loads strictly.

``config.json``'s ``tokenizer_name`` is the recipe's ``model.arch.tokenizer`` (LeRobot's processor loads it).
``loongforge.json`` next to them keeps what ``XVLAConfig`` cannot hold: the dataset's normalisation statistics and
our arch. The BART token embedding is tied (``shared`` = ``encoder.embed_tokens``): it is written once, under
``shared``, as safetensors requires and as LeRobot's loader expects.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from loongforge_embodied.policies.lerobot_export import staged_dir
from loongforge_embodied.policies.lerobot_xvla.configuration_lerobot_xvla import LeRobotXVLAArch

SIDECAR = "loongforge.json"
STATS_PREFIX = "stats."
SHARED = "model.vlm.language_model.shared.weight"
TIED = "model.vlm.language_model.encoder.embed_tokens.weight"


def write_pretrained(out_dir: Path, *, arch: LeRobotXVLAArch, weights: dict[str, torch.Tensor],
                     features: dict[str, Any]) -> Path:
    """Write atomically (staging dir + rename). ``features``: the camera keys and the state's feature key."""
    from safetensors.torch import save_file

    from loongforge_embodied.policies.lerobot_xvla.build import xvla_config

    out_dir = Path(out_dir)
    with staged_dir(out_dir) as staging:
        config = xvla_config(arch, cameras=list(features["cameras"]),
                             state_key=features.get("state", "observation.state"))
        config.tokenizer_name = arch.tokenizer
        config._save_pretrained(staging)
        model = {k: v.contiguous() for k, v in weights.items() if not k.startswith(STATS_PREFIX) and k != TIED}
        save_file(model, str(staging / "model.safetensors"))
        stats = {}
        for k, v in weights.items():
            if k.startswith(STATS_PREFIX):
                name = k[len(STATS_PREFIX):]
                stats[name] = v[: arch.state_dim if name.startswith("state") else arch.action_dim].tolist()
        (staging / SIDECAR).write_text(json.dumps({"arch": arch.to_dict(), "stats": stats}, indent=1))
    return out_dir


def serving_note(arch: LeRobotXVLAArch) -> str:
    """What loading the export in LeRobot needs: the tokenizer its config names."""
    return (f"LeRobot's X-VLA processor loads its tokenizer from '{arch.tokenizer}' (config.json's tokenizer_name): "
            "keep it reachable where the export is loaded")


def load_model(path: str | Path):
    """Our ``LeRobotXVLAModel`` of an exported directory, strictly; the statistics from ``loongforge.json``."""
    from loongforge.bounded_json import read_json_object
    from loongforge.checkpoint import check_shapes
    from loongforge.checkpoint.safetensors_io import read_header
    from loongforge.errors import CheckpointError
    from safetensors.torch import load_file

    from loongforge_embodied.policies.lerobot_xvla.modeling_lerobot_xvla import LeRobotXVLAModel

    path = Path(path)
    sidecar = path / SIDECAR
    if not sidecar.is_file():
        raise CheckpointError(f"{path}: no {SIDECAR} (the arch and statistics our X-VLA export writes)")
    meta = read_json_object(sidecar, error=CheckpointError)
    try:
        arch = LeRobotXVLAArch(**meta["arch"])
        florence = read_json_object(path / "config.json", error=CheckpointError)["florence_config"]
        if not isinstance(florence, dict):
            raise TypeError("florence_config is not a JSON object")
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{sidecar}: {(str(exc).splitlines() or [''])[0][:300]}") from None
    # NOTE: the export carries Florence-2's config inline: the model builds without the original directory
    model = LeRobotXVLAModel(arch, florence=florence)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith(STATS_PREFIX) and k != TIED}
    weights = path / "model.safetensors"
    check_shapes(expected, {k: tuple(v["shape"]) for k, v in read_header(weights).items()},
                 where=f"{weights} (against {path / 'config.json'})")
    state = load_file(str(weights))
    state[TIED] = state[SHARED]
    model.load_state_dict({**state, **{k: v for k, v in model.state_dict().items() if k.startswith(STATS_PREFIX)}},
                          strict=True)
    model.set_stats({k: torch.tensor(v) for k, v in meta.get("stats", {}).items()})
    return model
