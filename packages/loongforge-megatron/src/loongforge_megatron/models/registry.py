"""Model-family registry: the ``loongforge.megatron.models`` entry-point group -> :class:`ModelSpec`.

The backend's own families are registered there too (its pyproject), so the family list exists once and a
third-party package adds a family by declaring an entry point. Specs load lazily, on first use.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from loongforge import registry as core_registry
from loongforge.errors import CheckpointError, PluginError

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


def load_config_json(path: Path) -> dict[str, Any]:
    """A ``config.json`` as a dict: a file that is not a bounded JSON object (a regular file, size and nesting
    bounded, a string ``model_type``) is one CheckpointError naming it."""
    from loongforge.bounded_json import read_json_object

    from loongforge_megatron.conversion.config_tree import check_config_tree

    cfg = read_json_object(path, error=CheckpointError)
    check_config_tree(cfg, where=path, limit=None)
    model_type = cfg.get("model_type", cfg.get("_class_name"))
    if model_type is not None and not isinstance(model_type, str):
        raise CheckpointError(f"{path}: key 'model_type' must be a string, got {type(model_type).__name__}")
    return cfg


def complete(spec: ModelSpec, cfg: HFConfig, path: Path) -> HFConfig:
    """``spec.complete_hf_config(cfg)``; a config whose nested parts are not what the family reads (a
    ``vision_config`` that is a string) is one CheckpointError naming the file."""
    for key in ("text_config", "vision_config", "rope_parameters", "rope_scaling"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise CheckpointError(f"{path}: key '{key}' must be an object, got {type(cfg[key]).__name__}")
    try:
        return spec.complete_hf_config(cfg)
    except CheckpointError:
        raise
    except RecursionError:
        raise CheckpointError(f"{path}: not a model config (nested too deep)") from None
    except Exception as exc:  # noqa: BLE001 - transformers' config classes validate with errors of their own
        first = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{path}: not a valid {spec.name} config ({first})") from None


def read_hf_config(hf_dir: str | Path) -> HFConfig:
    """An HF directory's ``config.json``, completed with its family's defaults."""
    path = Path(hf_dir) / "config.json"
    if not path.exists():
        raise CheckpointError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
    cfg = load_config_json(path)
    return complete(get_family(hf_config=cfg), cfg, path)


def spec_of(arch: Any) -> ModelSpec:
    """The spec an architecture belongs to (``arch.spec_name``: its family, or the model kind holding it)."""
    return get(arch.spec_name)


def hf_config(arch: Any, *, torch_dtype: str = "float32") -> HFConfig:
    """An HF ``config.json`` dict for ``arch`` (what an HF export writes; diffusers' for a diffusers model)."""
    return spec_of(arch).hf_config(arch, torch_dtype=torch_dtype)
