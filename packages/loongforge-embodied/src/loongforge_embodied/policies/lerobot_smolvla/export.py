"""Export / load in LeRobot's own SmolVLA layout: ``config.json`` (``SmolVLAConfig``, type ``smolvla``) +
``model.safetensors`` (``SmolVLAPolicy``'s names), which ``SmolVLAPolicy.from_pretrained(dir)`` loads strictly.

``config.json``'s ``vlm_model_name`` is the recipe's ``model.arch.vlm`` (LeRobot reads the VLM's config and
processor from it when it loads the export). ``loongforge.json`` next to them keeps what ``SmolVLAConfig`` cannot
hold: the dataset's normalisation statistics and our arch. LeRobot's pre/post-processor files are not written
(``make_smolvla_pre_post_processors(config, dataset_stats)`` builds them from those statistics).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from loongforge_embodied.policies.lerobot_export import staged_dir
from loongforge_embodied.policies.lerobot_smolvla.configuration_lerobot_smolvla import LeRobotSmolVLAArch

SIDECAR = "loongforge.json"
STATS_PREFIX = "stats."


def write_pretrained(out_dir: Path, *, arch: LeRobotSmolVLAArch, weights: dict[str, torch.Tensor],
                     features: dict[str, Any]) -> Path:
    """Write atomically (staging dir + rename). ``features``: the camera keys and the state's feature key."""
    from safetensors.torch import save_file

    from loongforge_embodied.policies.lerobot_smolvla.build import smolvla_config

    out_dir = Path(out_dir)
    with staged_dir(out_dir) as staging:
        config = smolvla_config(arch, cameras=list(features["cameras"]),
                                state_key=features.get("state", "observation.state"), vlm=arch.vlm)
        config._save_pretrained(staging)
        model = {k: v.contiguous() for k, v in weights.items() if not k.startswith(STATS_PREFIX)}
        save_file(model, str(staging / "model.safetensors"))
        stats = {}
        for k, v in weights.items():
            if k.startswith(STATS_PREFIX):
                name = k[len(STATS_PREFIX):]
                stats[name] = v[: arch.state_dim if name.startswith("state") else arch.action_dim].tolist()
        (staging / SIDECAR).write_text(json.dumps({"arch": arch.to_dict(), "stats": stats}, indent=1))
    return out_dir


def serving_note(arch: LeRobotSmolVLAArch) -> str:
    """What loading the export in LeRobot needs: the VLM directory its config names."""
    return (f"LeRobot's SmolVLAPolicy.from_pretrained reads the VLM's config and processor from '{arch.vlm}' "
            "(config.json's vlm_model_name): keep it reachable where the export is loaded")


def arch_from_dir(path: str | Path) -> LeRobotSmolVLAArch:
    """Our arch of an exported dir, or of a LeRobot SmolVLA checkpoint (its ``config.json`` alone)."""
    from loongforge.bounded_json import read_json_object
    from loongforge.errors import CheckpointError

    path = Path(path)
    sidecar = path / SIDECAR
    if sidecar.exists():
        arch = read_json_object(sidecar, error=CheckpointError).get("arch")
        try:
            if not isinstance(arch, dict):
                raise TypeError(f"a JSON object of sizes is expected, got {type(arch).__name__}")
            return LeRobotSmolVLAArch(**arch)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{sidecar}: key 'arch': {(str(exc).splitlines() or [''])[0][:300]}") from None
    cfg = read_json_object(path / "config.json", error=CheckpointError)
    try:
        return _arch_from_config(cfg)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path / 'config.json'}: not a smolvla config LeRobot writes ({type(exc).__name__}: "
                              f"{(str(exc).splitlines() or [''])[0][:200]})") from None


def _arch_from_config(cfg: dict[str, Any]) -> LeRobotSmolVLAArch:
    if cfg.get("type") != "smolvla":
        raise ValueError(f"type is {cfg.get('type')!r}, not 'smolvla'")
    inputs = cfg["input_features"]
    cams = [f for f in inputs.values() if f["type"] == "VISUAL"]
    state = next(f for f in inputs.values() if f["type"] == "STATE")
    res = cfg["resize_imgs_with_padding"]
    return LeRobotSmolVLAArch(
        image_size=int(cams[0]["shape"][-1]), num_cameras=len(cams), state_dim=int(state["shape"][0]),
        action_dim=int(cfg["output_features"]["action"]["shape"][0]), chunk_size=int(cfg["chunk_size"]),
        resolution=int(res[0]), max_state_dim=int(cfg["max_state_dim"]), max_action_dim=int(cfg["max_action_dim"]),
        tokenizer_max_length=int(cfg["tokenizer_max_length"]), pad_language_to=cfg["pad_language_to"],
        vlm=cfg["vlm_model_name"], num_vlm_layers=int(cfg["num_vlm_layers"]),
        num_expert_layers=max(0, int(cfg["num_expert_layers"])),
        self_attn_every_n_layers=max(0, int(cfg["self_attn_every_n_layers"])),
        expert_width_percent=round(100 * float(cfg["expert_width_multiplier"])), attention_mode=cfg["attention_mode"],
        add_image_special_tokens=int(bool(cfg["add_image_special_tokens"])), num_steps=int(cfg["num_steps"]))


def load_model(path: str | Path):
    """Our ``LeRobotSmolVLAModel`` of an exported directory (or a LeRobot SmolVLA checkpoint), strictly; the
    statistics from ``loongforge.json`` where it has them."""
    from loongforge.bounded_json import read_json_object
    from loongforge.checkpoint import check_shapes
    from loongforge.checkpoint.safetensors_io import read_header
    from loongforge.errors import CheckpointError
    from safetensors.torch import load_file

    from loongforge_embodied.policies.lerobot_smolvla.configuration_lerobot_smolvla import local_vlm
    from loongforge_embodied.policies.lerobot_smolvla.modeling_lerobot_smolvla import LeRobotSmolVLAModel

    path = Path(path)
    arch = arch_from_dir(path)
    if local_vlm(arch.vlm) is None:
        raise CheckpointError(f"{path}: its VLM '{arch.vlm}' (config.json's vlm_model_name) is no local folder and not "
                              "in the local Hugging Face cache")
    model = LeRobotSmolVLAModel(arch)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.startswith(STATS_PREFIX)}
    weights = path / "model.safetensors"
    check_shapes(expected, {k: tuple(v["shape"]) for k, v in read_header(weights).items()},
                 where=f"{weights} (against {path / 'config.json'})")
    state = load_file(str(weights))
    stats = read_json_object(path / SIDECAR, error=CheckpointError).get("stats", {}) if (path / SIDECAR).exists() else {}
    model.load_state_dict({**state, **{k: v for k, v in model.state_dict().items() if k.startswith(STATS_PREFIX)}},
                          strict=True)
    model.set_stats({k: torch.tensor(v) for k, v in stats.items()})
    return model
