"""Export / load of the GR00T-style policy as a LeRobot policy directory (config.json + model.safetensors)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from loongforge_embodied.policies.groot.config import GrootArch

PREFIX = "model."  # GrootPolicy holds the network as ``self.model``


def write_pretrained(out_dir: Path, *, arch: GrootArch, weights: dict[str, torch.Tensor],
                     features: dict[str, Any]) -> Path:
    """Write atomically (staging dir + rename). ``features``: camera keys."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from loongforge.checkpoint.atomic import fsync_tree, replace_dir
    from safetensors.torch import save_file

    from loongforge_embodied.policies.groot.configuration_groot import GrootConfig

    out_dir = Path(out_dir)
    staging = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    inputs = {k: PolicyFeature(type=FeatureType.VISUAL, shape=(3, arch.image_size, arch.image_size))
              for k in features["cameras"]}
    inputs["observation.state"] = PolicyFeature(type=FeatureType.STATE, shape=(arch.state_dim,))
    config = GrootConfig(**arch.to_dict(), camera_keys=list(features["cameras"]), device="cpu",
                         n_action_steps=arch.chunk_size, input_features=inputs,
                         output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(arch.action_dim,))})
    config._save_pretrained(staging)
    save_file({PREFIX + k: v for k, v in weights.items()}, str(staging / "model.safetensors"))
    fsync_tree(staging)
    replace_dir(staging, out_dir)
    return out_dir


def load_model(path: str | Path):
    """Our own loader (no LeRobot import): the bare :class:`GrootModel` from an exported directory."""
    from safetensors.torch import load_file

    from loongforge_embodied.policies.groot.model import GrootModel

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    names = {f for f in GrootArch.__dataclass_fields__ if f != "stats"}
    model = GrootModel(GrootArch(**{k: v for k, v in cfg.items() if k in names}))
    sd = {k[len(PREFIX):]: v for k, v in load_file(str(path / "model.safetensors")).items() if k.startswith(PREFIX)}
    model.load_state_dict(sd, strict=True)
    return model
