"""The HF config an export writes keeps what the source HF config said about sliding-window attention."""
from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")


def _config_dir(out: Path, cls, **over) -> Path:
    out.mkdir(parents=True)
    cls(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, **over).to_json_file(out / "config.json")
    return out


@pytest.mark.parametrize("cls_name", ["Qwen2Config", "Qwen3Config"])
def test_qwen_sliding_window_survives_the_export(tmp_path, cls_name):
    """Qwen applies its window only with use_sliding_window, and only from layer max_window_layers on; the export
    wrote neither, so the exported model (HF defaults: no window) attended differently from the one read in."""
    from loongforge_megatron.models.hf_arch import arch_from_hf
    from loongforge_megatron.models.registry import hf_config

    cls = getattr(transformers, cls_name)
    src = _config_dir(tmp_path / "src", cls, sliding_window=32, use_sliding_window=True, max_window_layers=2)
    out = tmp_path / "out"
    out.mkdir()
    cls(**hf_config(arch_from_hf(src))).to_json_file(out / "config.json")
    want, got = cls.from_pretrained(src), cls.from_pretrained(out)
    assert (got.use_sliding_window, got.sliding_window, got.max_window_layers) == (True, 32, 2)
    assert got.layer_types == want.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2

    plain = _config_dir(tmp_path / "plain", cls, sliding_window=32, use_sliding_window=False)
    exported = hf_config(arch_from_hf(plain))
    assert not exported.get("use_sliding_window") and "max_window_layers" not in exported
