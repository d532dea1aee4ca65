"""The structure every HF config must have before a family reads it: bounded nesting, and counts (layers,
experts) that are non-negative integers no larger than the weights can hold."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongforge.errors import CheckpointError

# config keys that count repeated things (layers, experts): each must be a non-negative integer no larger than the
# number of tensors the files hold, so a layer count of 10**9 is refused before a name map walks that many layers
_COUNT_KEYS = ("num_hidden_layers", "num_layers", "depth", "n_routed_experts", "num_experts", "num_local_experts",
               "num_nextn_predict_layers")
_MAX_DEPTH = 16  # nesting of the config's objects (text_config / vision_config / rope_parameters ...)


def check_config_tree(cfg: Any, *, where: str | Path, limit: int | None) -> None:
    """Structure every family relies on: nested objects at most ``_MAX_DEPTH`` deep, counts (layers, experts)
    non-negative integers no larger than ``limit`` (the number of tensors in the files; None: depth only)."""
    def walk(node: Any, path: str, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise CheckpointError(f"{where}: key '{path}' nests objects more than {_MAX_DEPTH} deep")
        if isinstance(node, list):
            for i, v in enumerate(node[:4096]):
                walk(v, f"{path}[{i}]", depth + 1)
            return
        if not isinstance(node, dict):
            return
        for k, v in node.items():
            key = f"{path}.{k}" if path else str(k)
            if limit is not None and k in _COUNT_KEYS and v is not None:
                if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= limit:
                    raise CheckpointError(f"{where}: key '{key}' must be an integer from 0 to {limit} (the number "
                                          f"of tensors in the weights), got {v!r:.40}")
            walk(v, key, depth + 1)

    walk(cfg, "", 0)
