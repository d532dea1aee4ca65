"""Export / load of the tiny VLA as a LeRobot policy directory (config.json + model.safetensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from loongforge_embodied.policies import lerobot_export
from loongforge_embodied.policies.tiny_vla.configuration_tiny_vla import TinyVLAArch


def write_pretrained(out_dir: Path, *, arch: TinyVLAArch, weights: dict[str, torch.Tensor],
                     features: dict[str, Any]) -> Path:
    """Write atomically (staging dir + rename). ``features``: camera keys and state/action shapes."""
    from loongforge_embodied.policies.tiny_vla.configuration_tiny_vla import TinyVLAConfig

    return lerobot_export.write_pretrained(out_dir, config_class=TinyVLAConfig, arch=arch, weights=weights,
                                           features=features)


def load_model(path: str | Path):
    """Our own loader (no LeRobot import): the bare :class:`TinyVLAModel` from an exported directory."""
    from loongforge_embodied.policies.tiny_vla.modeling_tiny_vla import TinyVLAModel

    return lerobot_export.load_model(path, arch_class=TinyVLAArch, model_class=TinyVLAModel)
