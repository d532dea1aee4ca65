"""Model-family registry: the ``loongforge.megatron.models`` entry-point group -> :class:`ModelSpec`.

The backend's own families are registered there too (its pyproject), so the family list exists once and a
third-party package adds a family by declaring an entry point. Specs load lazily, on first use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loongforge import registry as core_registry
from loongforge.errors import CheckpointError, PluginError, RecipeError

if TYPE_CHECKING:
    from loongforge_megatron.models.spec import HFConfig, ModelSpec

GROUP = "loongforge.megatron.models"
families = core_registry.REGISTRIES[GROUP]


def get(name: str) -> ModelSpec:
    """The spec registered as ``name`` (PluginError naming the installed families when there is none)."""
    return families.get(name)


def all_specs() -> dict[str, ModelSpec]:
    """Every family that loads (a broken plugin is reported by ``loongforge plugins``, not here)."""
    return {e.key: e.obj for e in families.entries() if e.error is None}


def presets() -> dict[str, tuple[ModelSpec, dict[str, Any]]]:
    """preset name -> (its family's spec, its fields); a name two families define is an error."""
    out: dict[str, tuple[ModelSpec, dict[str, Any]]] = {}
    for spec in all_specs().values():
        for name, fields in spec.presets.items():
            if name in out and out[name][0] is not spec:
                raise PluginError(f"preset '{name}' is defined by model families '{out[name][0].name}' and "
                                  f"'{spec.name}'")
            out[name] = (spec, dict(fields))
    return out


def get_family(name: str | None = None, *, hf_config: HFConfig | None = None) -> ModelSpec:
    """The spec by name, or detected from ``hf_config['model_type']`` (a diffusers config's ``_class_name``)
    when ``name`` is None."""
    if name is None:
        cfg = hf_config or {}
        model_type = cfg.get("model_type") or cfg.get("_class_name")
        specs = all_specs()
        for spec in specs.values():
            if model_type in spec.model_types:
                return spec
        known = sorted(t for s in specs.values() for t in s.model_types)
        raise CheckpointError(f"config.json model_type '{model_type}' is not supported; known: {', '.join(known)}")
    try:
        return get(name)
    except PluginError:
        raise CheckpointError(f"unknown model family '{name}'; known: {', '.join(families.keys())}") from None


def read_hf_config(hf_dir: str | Path) -> HFConfig:
    """An HF directory's ``config.json``, completed with its family's defaults."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({str(exc).splitlines()[0][:120]})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return get_family(hf_config=cfg).complete_hf_config(cfg)


def arch_from_hf(hf_dir: str | Path) -> Any:
    """The architecture of an HF model directory (RecipeError naming ``model.hf`` when it has none we train)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        if (Path(hf_dir) / "model_index.json").is_file() and (Path(hf_dir) / "transformer" / "config.json").is_file():
            raise RecipeError(f"'{hf_dir}' is a diffusers pipeline; give its transformer folder "
                              f"'{Path(hf_dir) / 'transformer'}'", key="model.hf")
        raise RecipeError(f"no config.json in HF model directory '{hf_dir}'", key="model.hf")
    cfg = json.loads(path.read_text())
    try:
        spec = get_family(hf_config=cfg)
    except CheckpointError:
        model_type = cfg.get("model_type") or cfg.get("_class_name")
        known = ", ".join(sorted(t for s in all_specs().values() for t in s.model_types))
        raise RecipeError(f"model_type '{model_type}' in {path} is not supported; supported: {known}",
                          key="model.hf") from None
    return spec.arch_from_hf(spec.complete_hf_config(cfg), path=path)


def spec_of(arch: Any) -> ModelSpec:
    """The spec an architecture belongs to (``arch.spec_name``: its family, or the model kind holding it)."""
    return get(arch.spec_name)


def hf_config(arch: Any, *, torch_dtype: str = "float32") -> HFConfig:
    """An HF ``config.json`` dict for ``arch`` (what an HF export writes; diffusers' for a diffusers model)."""
    return spec_of(arch).hf_config(arch, torch_dtype=torch_dtype)
