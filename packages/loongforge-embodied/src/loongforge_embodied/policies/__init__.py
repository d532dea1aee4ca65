"""Policies the embodied backend trains: a plain dict registry (one folder per policy, LeRobot-style)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loongforge_embodied.config import DataConfig, ModelConfig
    from loongforge_embodied.policies.tiny_vla.config import TinyVLAArch


def resolve_arch(model: ModelConfig, data: DataConfig | None = None) -> TinyVLAArch:
    """Preset + ``model.arch`` overrides + the dataset's shapes (state/action dims, cameras, image size)."""
    from loongforge_embodied.policies.tiny_vla.config import PRESETS

    arch = PRESETS[model.preset].with_overrides(**model.arch)
    if data is not None and data.format == "lerobot":
        arch = arch.with_overrides(**dataset_shapes(data))
    return arch


def dataset_shapes(data: DataConfig) -> dict[str, Any]:
    """Shapes from ``meta/info.json`` (read as JSON: no LeRobot import); empty when not recorded yet."""
    info_path = Path(data.root or "") / "meta" / "info.json"
    if not info_path.is_file():
        return {}
    feats = json.loads(info_path.read_text())["features"]
    cams = data.cameras or [k for k, f in feats.items() if f["dtype"] in ("image", "video")]
    return {"state_dim": int(feats["observation.state"]["shape"][0]), "action_dim": int(feats["action"]["shape"][0]),
            "num_cameras": len(cams)}
