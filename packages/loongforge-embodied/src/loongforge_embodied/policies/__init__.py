"""Policies the embodied backend trains: a plain dict registry (one folder per policy, LeRobot-style).

A policy folder ``policies/<name>/`` provides, found lazily by module name (choosing one policy never imports
another's modules, and validating a recipe imports no torch):

- ``configuration_<name>.py``: ``PRESETS`` — named frozen dataclasses of sizes with ``with_overrides(**kw)``, ``to_dict()``
  and the dataset-shaped fields ``image_size, num_cameras, state_dim, action_dim, chunk_size``;
- ``modeling_<name>.py``: the ``nn.Module(arch)``: ``forward(batch) -> (B,)`` per-sample loss, ``components()`` (names
  ``model.freeze`` takes), ``wrap_units()`` (FSDP2 / recompute units in execution order),
  ``enable_activation_checkpointing()``, ``set_stats(stats)``, ``sample_actions(batch)``; optionally a module-level
  ``adaptations()``: the named library adaptations (``loongforge.accelerator.adaptation``) a run applies;
- ``processor_<name>.py``: ``prepare_batch(raw, *, arch, stats)`` — collated samples → model inputs; optionally
  ``check_arch(arch)`` (run once at job setup, e.g. load the tokenizer);
- ``export.py``: ``write_pretrained(out_dir, *, arch, weights, features)`` and ``load_model(path)``; optionally
  ``serving_note(arch) -> str`` (logged after an export: what serving the export in LeRobot must match);
- where LeRobot loads our export (tiny_vla, groot), the same two modules also hold LeRobot's config and policy
  classes (``from_pretrained``, ``select_action``), made on first access so that choosing a preset imports no
  lerobot (the lerobot_* policies export LeRobot's own types instead: ``pi05``, ``smolvla``, ``xvla``, ``groot``,
  ``wall_x``, ``fastwam``, ``lingbot_va``).

What the folders share lives next to them: ``arch.ArchMixin`` (``with_overrides``/``to_dict`` of the size
dataclasses), ``byte_tokens`` (tiny_vla's and groot's task tokenizer), ``flow_noise`` (noise for padded action
dims), ``lerobot_glue`` (the bodies of ``configuration_<name>``/``modeling_<name>``), ``lerobot_normalize``
(LeRobot's mean / std normaliser step from the dataset statistics) and ``lerobot_export`` (the atomic LeRobot policy
directory).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from types import ModuleType


class PolicyChoice(Protocol):
    """What the registry reads of the recipe's ``model`` section (``loongforge_embodied.config.ModelConfig``)."""

    policy: str
    preset: str
    arch: dict[str, Any]


class DatasetChoice(Protocol):
    """What the registry reads of the recipe's ``data`` section (``loongforge_embodied.config.DataConfig``)."""

    format: str
    root: str | None
    cameras: list[str] | None
    state_key: str


class PolicyArch(Protocol):
    """The fields of a policy's size dataclass the data pipeline reads (filled from the dataset)."""

    image_size: int
    num_cameras: int
    state_dim: int
    action_dim: int
    chunk_size: int

    def with_overrides(self, **kw: Any) -> PolicyArch: ...


@dataclass(frozen=True)
class PolicySpec:
    """Where a policy's parts live (module names under ``policies/<name>/``)."""

    name: str
    model_class: str

    def module(self, part: str) -> ModuleType:
        return importlib.import_module(f"{__name__}.{self.name}.{part}")

    @property
    def presets(self) -> dict[str, Any]:
        return self.module(f"configuration_{self.name}").PRESETS

    def model_cls(self) -> type:
        return getattr(self.module(f"modeling_{self.name}"), self.model_class)

    @property
    def prepare_batch(self):
        return self.module(f"processor_{self.name}").prepare_batch

    @property
    def export(self) -> ModuleType:
        return self.module("export")

    def adaptations(self) -> list:
        """The library adaptations a run of this policy applies (the model module's optional ``adaptations()``,
        e.g. lerobot_pi05's joint attention layer); the job holds them for its run and undoes them after."""
        make = getattr(self.module(f"modeling_{self.name}"), "adaptations", None)
        return list(make()) if make is not None else []

    def check_data_pipeline(self, arch: Any, stats: dict[str, Any] | None = None) -> None:
        """The processor's ``check_arch(arch)`` and ``check_stats(arch, stats)`` where it has them: what its workers
        will need, checked once in the main process so a problem is one clear error at setup (not a worker's
        traceback at the first batch)."""
        processor = self.module(f"processor_{self.name}")
        check = getattr(processor, "check_arch", None)
        if check is not None:
            check(arch)
        check = getattr(processor, "check_stats", None)
        if check is not None and stats is not None:
            check(arch, stats)


POLICIES: dict[str, PolicySpec] = {
    "tiny_vla": PolicySpec("tiny_vla", "TinyVLAModel"),
    "groot": PolicySpec("groot", "GrootModel"),
    "lerobot_pi05": PolicySpec("lerobot_pi05", "LeRobotPI05Model"),
    "lerobot_smolvla": PolicySpec("lerobot_smolvla", "LeRobotSmolVLAModel"),
    "lerobot_xvla": PolicySpec("lerobot_xvla", "LeRobotXVLAModel"),
    "lerobot_groot": PolicySpec("lerobot_groot", "LeRobotGrootModel"),
    "lerobot_wall_x": PolicySpec("lerobot_wall_x", "LeRobotWallXModel"),
    "lerobot_fastwam": PolicySpec("lerobot_fastwam", "LeRobotFastWAMModel"),
    "lerobot_lingbot_va": PolicySpec("lerobot_lingbot_va", "LeRobotLingBotVAModel"),
}


def get_policy(name: str) -> PolicySpec:
    return POLICIES[name]


def resolve_arch(model: PolicyChoice, data: DatasetChoice | None = None) -> PolicyArch:
    """Preset + ``model.arch`` overrides + the dataset's shapes (state / action dims, camera count)."""
    arch = get_policy(model.policy).presets[model.preset].with_overrides(**model.arch)
    if data is not None and data.format == "lerobot":
        shapes = dataset_shapes(data)
        if "camera_keys" in arch.to_dict() and "num_cameras" in shapes:
            # NOTE: a policy whose prompt names its cameras (Wall-X) also takes the dataset's camera keys
            shapes["camera_keys"] = ",".join(dataset_cameras(data))
        try:
            arch = arch.with_overrides(**shapes)
        except ValueError as exc:
            from loongforge.errors import RecipeError

            raise RecipeError(f"{exc}, with the dataset at '{data.root}' ({', '.join(f'{k} {v}' for k, v in shapes.items())})"
                              f"; raise the preset's limits in model.arch or pick another preset", key="model.arch") from None
    return arch


def dataset_cameras(data: DatasetChoice) -> list[str]:
    """The camera keys a run reads (``data.cameras``, or every image / video feature of ``meta/info.json``)."""
    from loongforge_embodied.data.lerobot_files import load_info

    feats = load_info(data.root)["features"]
    return list(data.cameras or [k for k, f in feats.items() if f["dtype"] in ("image", "video")])


def dataset_shapes(data: DatasetChoice) -> dict[str, Any]:
    """Shapes from ``meta/info.json`` (read as JSON: no LeRobot import); empty when not recorded yet."""
    info_path = Path(data.root or "") / "meta" / "info.json"
    if not info_path.is_file():
        return {}
    from loongforge_embodied.data.lerobot_files import load_info

    feats = load_info(data.root)["features"]
    found = [k for k, f in feats.items() if f["dtype"] in ("image", "video")]
    unknown = [c for c in data.cameras or [] if c not in found]
    if unknown:
        from loongforge.errors import RecipeError

        raise RecipeError(f"{', '.join(map(repr, unknown))} not among the cameras of '{data.root}'; allowed: "
                          f"{', '.join(found) or '(none)'}", key="data.cameras")
    cams = data.cameras or found
    state = feats.get(data.state_key)
    if not (isinstance(state, dict) and isinstance(state.get("shape"), list) and len(state["shape"]) == 1):
        from loongforge.errors import RecipeError

        vectors = [k for k, f in feats.items() if k.startswith("observation.") and len(f.get("shape") or []) == 1]
        raise RecipeError(f"'{data.state_key}' is not a vector feature of '{data.root}'; allowed: "
                          f"{', '.join(vectors) or '(none)'}", key="data.state_key")
    return {"state_dim": int(state["shape"][0]), "action_dim": int(feats["action"]["shape"][0]),
            "num_cameras": len(cams)}
