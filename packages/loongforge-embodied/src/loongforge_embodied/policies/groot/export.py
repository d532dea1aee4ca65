"""Export / load of the GR00T-style policy as a LeRobot policy directory (config.json + model.safetensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from loongforge_embodied.policies import lerobot_export
from loongforge_embodied.policies.groot.configuration_groot import GrootArch


def write_pretrained(out_dir: Path, *, arch: GrootArch, weights: dict[str, torch.Tensor],
                     features: dict[str, Any]) -> Path:
    """Write atomically (staging dir + rename). ``features``: camera keys."""
    from loongforge_embodied.policies.groot.configuration_groot import GrootConfig

    return lerobot_export.write_pretrained(out_dir, config_class=GrootConfig, arch=arch, weights=weights,
                                           features=features)


def load_model(path: str | Path):
    """Our own loader (no LeRobot import): the bare :class:`GrootModel` from an exported directory."""
    from loongforge_embodied.policies.groot.modeling_groot import GrootModel

    return lerobot_export.load_model(path, arch_class=GrootArch, model_class=GrootModel)
