"""Export / load in LeRobot's own GR00T layout: ``config.json`` (``GrootConfig``, type ``groot``) +
``model.safetensors`` (``GrootPolicy``'s names, ``_groot_model.…``), which ``GrootPolicy.from_pretrained(dir)``
loads strictly.

``GrootPolicy`` first builds its network from a GR00T N1.7 model directory (``base_model_path``): the export holds
one under ``base/`` (``GR00TN17Config`` + the same weights under ``GR00TN17``'s names) and its ``config.json`` names
it by absolute path. The backbone's config and processor are read from ``model.arch.vlm`` (``base/config.json``'s
``model_name``). ``loongforge.json`` keeps what ``GrootConfig`` cannot hold: the dataset's min / max statistics and
our arch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from loongforge_embodied.policies.lerobot_export import staged_dir
from loongforge_embodied.policies.lerobot_groot.configuration_lerobot_groot import LeRobotGrootArch

SIDECAR = "loongforge.json"
STATS_PREFIX = "stats."
PREFIX = "_groot_model."  # GrootPolicy's attribute holding GR00TN17
BASE = "base"
TIED = "backbone.model.lm_head.weight"  # the unused LM head, tied to the embeddings (not saved, as LeRobot)


def _network(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``GR00TN17``'s weights (no prefix, no tied LM head), contiguous."""
    return {k[len(PREFIX):]: v.contiguous() for k, v in weights.items()
            if k.startswith(PREFIX) and k != PREFIX + TIED}


def write_pretrained(out_dir: Path, *, arch: LeRobotGrootArch, weights: dict[str, torch.Tensor],
                     features: dict[str, Any]) -> Path:
    """Write atomically (staging dir + rename). ``features``: the camera keys and the state's feature key."""
    from safetensors.torch import save_file

    from loongforge_embodied.policies.lerobot_groot.build import model_config, policy_config

    out_dir = Path(out_dir).resolve()
    network = _network(weights)
    with staged_dir(out_dir) as staging:
        config = policy_config(arch, base=str(out_dir / BASE), cameras=list(features["cameras"]),
                               state_key=features.get("state", "observation.state"))
        config._save_pretrained(staging)
        save_file({PREFIX + k: v for k, v in network.items()}, str(staging / "model.safetensors"))
        (staging / BASE).mkdir()
        model_config(arch, vlm=arch.vlm).save_pretrained(staging / BASE)
        save_file(network, str(staging / BASE / "model.safetensors"), metadata={"format": "pt"})
        stats = {}
        for k, v in weights.items():
            if k.startswith(STATS_PREFIX):
                name = k[len(STATS_PREFIX):]
                stats[name] = v[: arch.state_dim if name.startswith("state") else arch.action_dim].tolist()
        (staging / SIDECAR).write_text(json.dumps({"arch": arch.to_dict(), "stats": stats}, indent=1))
    return out_dir


def serving_note(arch: LeRobotGrootArch) -> str:
    """What loading the export in LeRobot needs."""
    return (f"LeRobot's GrootPolicy.from_pretrained builds from the export's base/ directory (by absolute path: "
            f"move the export and update config.json's base_model_path) and reads the backbone's config and "
            f"processor from '{arch.vlm}'; its pre-processor is LeRobot's N1.7 pack and VLM-encode steps with "
            f"model_name '{arch.vlm}' and the min / max in loongforge.json")


def arch_from_dir(path: str | Path) -> LeRobotGrootArch:
    """Our arch of an exported dir (its ``loongforge.json``) or of a GR00T N1.7 model directory (a
    ``GR00TN17Config``'s ``config.json``, as ``GR00TN17.save_pretrained`` writes it: e.g. the published N1.7)."""
    from loongforge.bounded_json import read_json_object
    from loongforge.errors import CheckpointError

    path = Path(path)
    sidecar = path / SIDECAR
    if sidecar.is_file():
        arch = read_json_object(sidecar, error=CheckpointError).get("arch")
        try:
            if not isinstance(arch, dict):
                raise TypeError(f"a JSON object of sizes is expected, got {type(arch).__name__}")
            return LeRobotGrootArch(**arch)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{sidecar}: key 'arch': {(str(exc).splitlines() or [''])[0][:300]}") from None
    cfg = read_json_object(path / "config.json", error=CheckpointError)
    try:
        return _arch_from_model_config(cfg)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path / 'config.json'}: neither a lerobot_groot export ({SIDECAR}) nor a GR00T N1.7 "
                              f"model config ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]})") from None


def _arch_from_model_config(cfg: dict[str, Any]) -> LeRobotGrootArch:
    if cfg.get("model_type") != "Gr00tN1d7":
        raise ValueError(f"model_type is {cfg.get('model_type')!r}, not 'Gr00tN1d7'")
    dit, vl = cfg["diffusion_model_cfg"], cfg["vl_self_attention_cfg"]
    # NOTE: the dataset's dims are not the model's (it pads to max_*_dim): the recipe's data sets them
    return LeRobotGrootArch(
        state_dim=int(cfg["max_state_dim"]), action_dim=int(cfg["max_action_dim"]), chunk_size=int(cfg["action_horizon"]), max_state_dim=int(cfg["max_state_dim"]),
        max_action_dim=int(cfg["max_action_dim"]), vlm=cfg["model_name"], select_layer=int(cfg["select_layer"]),
        backbone_embedding_dim=int(cfg["backbone_embedding_dim"]), hidden_size=int(cfg["hidden_size"]),
        input_embedding_dim=int(cfg["input_embedding_dim"]), dit_layers=int(dit["num_layers"]),
        dit_heads=int(dit["num_attention_heads"]), dit_head_dim=int(dit["attention_head_dim"]),
        vl_layers=int(vl["num_layers"]), vl_heads=int(vl["num_attention_heads"]),
        vl_head_dim=int(vl["attention_head_dim"]), dropout_percent=round(100 * float(dit["dropout"])),
        state_dropout_percent=round(100 * float(cfg["state_dropout_prob"])),
        num_embodiments=int(cfg["max_num_embodiments"]), image_crop_size=int(cfg["image_crop_size"][0]),
        image_target_size=int(cfg["image_target_size"][0]), num_steps=int(cfg["num_inference_timesteps"]))


def _weights(path: Path) -> tuple[dict[str, tuple[int, ...]], list[Path], str]:
    """The shapes (under our names), files and name prefix to add of an export or a GR00T N1.7 model directory
    (its ``*.safetensors`` shards)."""
    from loongforge.checkpoint.safetensors_io import read_header
    from loongforge.errors import CheckpointError

    if (path / SIDECAR).is_file():
        files, prefix = [path / "model.safetensors"], ""
    else:
        files, prefix = sorted(path.glob("*.safetensors")), PREFIX
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors next to its GR00T N1.7 config.json")
    shapes = {prefix + k: tuple(v["shape"]) for f in files for k, v in read_header(f).items()}
    return {k: v for k, v in shapes.items() if k != PREFIX + TIED}, files, prefix


def load_model(path: str | Path):
    """Our ``LeRobotGrootModel`` of an exported directory (statistics from ``loongforge.json``) or of a GR00T N1.7
    model directory (``model.load`` of the published weights), strictly."""
    from loongforge.bounded_json import read_json_object
    from loongforge.checkpoint import check_shapes
    from loongforge.errors import CheckpointError
    from safetensors.torch import load_file

    from loongforge_embodied.policies.lerobot_groot.configuration_lerobot_groot import local_vlm
    from loongforge_embodied.policies.lerobot_groot.modeling_lerobot_groot import LeRobotGrootModel

    path = Path(path)
    arch = arch_from_dir(path)
    if local_vlm(arch.vlm) is None:
        raise CheckpointError(f"{path}: its backbone '{arch.vlm}' is no local folder and not in the local Hugging Face "
                              "cache")
    shapes, files, prefix = _weights(path)
    model = LeRobotGrootModel(arch)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()
                if k.startswith(PREFIX) and k != PREFIX + TIED}
    check_shapes(expected, shapes, where=f"{path} (against its config)")
    state = {prefix + k: v for f in files for k, v in load_file(str(f)).items() if prefix + k != PREFIX + TIED}
    model.load_state_dict(state, strict=False)  # NOTE: every tensor but the tied head and the stats, checked above
    if (path / SIDECAR).is_file():
        stats = read_json_object(path / SIDECAR, error=CheckpointError).get("stats", {})
        model.set_stats({k: torch.tensor(v) for k, v in stats.items()})
    return model
