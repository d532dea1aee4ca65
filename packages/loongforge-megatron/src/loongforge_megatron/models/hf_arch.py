"""The architecture of an HF model directory, its config checked against its weights' headers first: the one
door every ``model.hf`` goes through (kept apart from the registry, which the conversion code imports)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongforge.errors import CheckpointError, RecipeError

from loongforge_megatron.models.registry import all_specs, complete, get_family, load_config_json
from loongforge_megatron.models.spec import HFConfig, ModelSpec


def arch_from_hf(hf_dir: str | Path) -> Any:
    """The architecture of an HF model directory (RecipeError naming ``model.hf`` when it has none we train)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        if (Path(hf_dir) / "model_index.json").is_file() and (Path(hf_dir) / "transformer" / "config.json").is_file():
            raise RecipeError(f"'{hf_dir}' is a diffusers pipeline; give its transformer folder "
                              f"'{Path(hf_dir) / 'transformer'}'", key="model.hf")
        raise RecipeError(f"no config.json in HF model directory '{hf_dir}'", key="model.hf")
    try:
        cfg = load_config_json(path)
    except CheckpointError as exc:
        raise RecipeError(str(exc), key="model.hf") from None
    try:
        spec = get_family(hf_config=cfg)
    except CheckpointError:
        model_type = cfg.get("model_type") or cfg.get("_class_name")
        known = ", ".join(sorted(t for s in all_specs().values() for t in s.model_types))
        raise RecipeError(f"model_type '{model_type}' in {path} is not supported; supported: {known}",
                          key="model.hf") from None
    try:
        full = complete(spec, cfg, path)
        _check_weights(Path(hf_dir), full, spec)
    except CheckpointError as exc:
        raise RecipeError(str(exc), key="model.hf") from None
    try:
        return spec.arch_from_hf(full, path=path)
    except KeyError as exc:
        raise RecipeError(f"{path}: key {exc} is missing", key="model.hf") from None
    except (TypeError, AttributeError, ZeroDivisionError, OverflowError) as exc:
        first = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise RecipeError(f"{path}: a key has a value of the wrong kind ({first})", key="model.hf") from None


def _check_weights(hf_dir: Path, cfg: HFConfig, spec: ModelSpec) -> None:
    """The config against its weights' headers when the directory holds weights (a config-only directory
    describes a model to train from scratch): refused before anything is built."""
    if not any(hf_dir.glob("*.safetensors")):
        return
    from loongforge.checkpoint import SafetensorsReader

    from loongforge_megatron.conversion.aliased_reader import AliasedReader
    from loongforge_megatron.conversion.config_check import check_hf_dir
    from loongforge_megatron.conversion.fp8_blocks import fp8_reader

    reader = AliasedReader(fp8_reader(SafetensorsReader(hf_dir), cfg, where=hf_dir / "config.json"), spec.hf_alias)
    check_hf_dir(hf_dir, cfg, family=spec, reader=reader)
