"""An HF directory's config.json must describe its weights: every tensor's shape is compared with the shape
transformers derives from the config (the model built on the meta device, so nothing is allocated)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

from loongforge.errors import CheckpointError


def config_shapes(hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the HF model config.json describes ({} when transformers cannot build it)."""
    import torch
    import transformers as tf

    cfg = dict(hf_config)
    model_type = cfg.pop("model_type", None)
    try:
        config = tf.AutoConfig.for_model(model_type, **cfg)
        auto = tf.AutoModelForCausalLM if type(config) in tf.MODEL_FOR_CAUSAL_LM_MAPPING else tf.AutoModelForImageTextToText
        with torch.device("meta"), contextlib.redirect_stderr(io.StringIO()):
            model = auto.from_config(config)
    except Exception:  # noqa: BLE001 - a family transformers does not know here: nothing to compare with
        return {}
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_config_matches_weights(hf_dir: str | Path, hf_config: dict[str, Any], reader: Any) -> None:
    """Raise CheckpointError naming the first tensor whose shape in the weights differs from config.json's."""
    expected = config_shapes(hf_config)
    names = [n for n in reader.keys() if n in expected]
    for name in sorted(names):
        have, want = tuple(reader.shape(name)), expected[name]
        if have != want:
            sizes = ", ".join(f"{k} {hf_config[k]}" for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                                "num_key_value_heads", "vocab_size", "head_dim")
                              if k in hf_config)
            raise CheckpointError(f"{Path(hf_dir) / 'config.json'} does not match the weights: tensor '{name}' has "
                                  f"shape {have} but the config ({sizes}) gives {want}")
