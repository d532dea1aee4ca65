"""Export / load in LeRobot's own pi05 layout: ``config.json`` (``PI05Config``, type ``pi05``) +
``model.safetensors`` (``PI05Policy``'s names), which ``PI05Policy.from_pretrained(dir)`` loads strictly.

SigLIP's names follow transformers < 5.6 (``vision_tower.vision_model.``), the range LeRobot 0.6.1 supports; under
transformers >= 5.6 the ``pi05-siglip-names`` adaptation (``attention.py``) lets LeRobot's loader read them.

``loongforge.json`` next to them keeps what ``PI05Config`` cannot hold: the dataset's normalisation statistics
and, for shrunken test models, their sizes (load those in LeRobot with ``build.shrunk_sizes(arch)`` active).
LeRobot's pre/post-processor files are not written: its pi05 pre-processor loads the PaliGemma tokenizer from
the Hub (``make_pi05_pre_post_processors(config, dataset_stats)`` builds them where that is reachable).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from loongforge_embodied.policies import siglip_names
from loongforge_embodied.policies.lerobot_export import staged_dir
from loongforge_embodied.policies.lerobot_pi05.configuration_lerobot_pi05 import (
    LEROBOT_TOKENIZER,
    LeRobotPI05Arch,
)

SIDECAR = "loongforge.json"
STATS_PREFIX = "stats."
LM_HEAD = "model.paligemma_with_expert.paligemma.lm_head.weight"
EMBED = "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"


def write_pretrained(out_dir: Path, *, arch: LeRobotPI05Arch, weights: dict[str, torch.Tensor],
                     features: dict[str, Any]) -> Path:
    """Write atomically (staging dir + rename). ``features``: the camera keys."""
    from safetensors.torch import save_file

    from loongforge_embodied.policies.lerobot_pi05.build import pi05_config

    out_dir = Path(out_dir)
    with staged_dir(out_dir) as staging:
        pi05_config(arch, cameras=list(features["cameras"]))._save_pretrained(staging)
        model = {k: v.contiguous() for k, v in weights.items() if not k.startswith(STATS_PREFIX)}
        # NOTE: LeRobot 0.6.1 supports transformers < 5.6 only, where SigLIP sits under ``vision_model.``: write
        # that layout whatever transformers built our model (its loader maps no names).
        model = siglip_names.to_layout(model, nested=True)
        # NOTE: PaliGemma ties lm_head to the token table and LeRobot's loader copies lm_head over embed_tokens
        # (``_fix_pytorch_state_dict_keys``); ours is frozen and unused in training, so write the trained table.
        model[LM_HEAD] = model[EMBED].clone()
        save_file(model, str(staging / "model.safetensors"))
        stats = {}
        for k, v in weights.items():
            if k.startswith(STATS_PREFIX):
                name = k[len(STATS_PREFIX):]
                stats[name] = v[: arch.state_dim if name.startswith("state") else arch.action_dim].tolist()
        (staging / SIDECAR).write_text(json.dumps({"arch": arch.to_dict(), "stats": stats}, indent=1))
    return out_dir


def serving_note(arch: LeRobotPI05Arch) -> str:
    """What a user of the export must know before LeRobot loads or serves it ("" if nothing): a shrunken model
    (LeRobot's ``PI05Policy.from_pretrained`` builds only the real sizes and would report size mismatches and keep
    random weights), and prompts tokenized differently from LeRobot's pi05 processor."""
    notes = []
    if arch.shrunk:
        notes.append("the model is smaller than LeRobot's pi05 (gemma_2b + gemma_300m + So400m), which is all "
                     "PI05Policy.from_pretrained builds: load it with `with shrunk_sizes(arch_from_dir(DIR)): "
                     "PI05Policy.from_pretrained(DIR)` (from loongforge_embodied.policies.lerobot_pi05.build / .export)")
    if arch.tokenizer != LEROBOT_TOKENIZER:
        used = f"the tokenizer {arch.tokenizer}" if arch.tokenizer else "Gemma byte-fallback tokens (model.arch.tokenizer unset)"
        notes.append(f"trained on prompts in {used}; LeRobot's pi05 processor tokenizes with {LEROBOT_TOKENIZER}, "
                     "so serve the export with the same tokens, or train with model.arch.tokenizer set to it")
    return "; ".join(notes)


def arch_from_dir(path: str | Path) -> LeRobotPI05Arch:
    """Our arch of an exported dir, or of a LeRobot pi05 checkpoint (its ``config.json`` alone)."""
    from loongforge.bounded_json import read_json_object
    from loongforge.errors import CheckpointError

    path = Path(path)
    sidecar = path / SIDECAR
    if sidecar.exists():
        arch = read_json_object(sidecar, error=CheckpointError).get("arch")
        try:
            if not isinstance(arch, dict):
                raise TypeError(f"a JSON object of sizes is expected, got {type(arch).__name__}")
            return LeRobotPI05Arch(**arch)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{sidecar}: key 'arch': {(str(exc).splitlines() or [''])[0][:300]}") from None
    cfg = read_json_object(path / "config.json", error=CheckpointError)
    try:
        return _arch_from_config(cfg)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path / 'config.json'}: not a pi05 config LeRobot writes ({type(exc).__name__}: "
                              f"{(str(exc).splitlines() or [''])[0][:200]})") from None


def _arch_from_config(cfg: dict[str, Any]) -> LeRobotPI05Arch:
    feats = cfg.get("input_features", {})
    cams = [k for k, f in feats.items() if f.get("type") == "VISUAL"]
    state = feats.get("observation.state", {}).get("shape", [cfg.get("max_state_dim", 32)])
    action = cfg.get("output_features", {}).get("action", {}).get("shape", [cfg.get("max_action_dim", 32)])
    res = cfg.get("image_resolution", [224, 224])
    return LeRobotPI05Arch(
        image_size=res[0], num_cameras=max(1, len(cams)), state_dim=state[0], action_dim=action[0],
        chunk_size=cfg.get("chunk_size", 50), resolution=res[0], max_state_dim=cfg.get("max_state_dim", 32),
        max_action_dim=cfg.get("max_action_dim", 32), tokenizer_max_length=cfg.get("tokenizer_max_length", 200),
        paligemma_variant=cfg.get("paligemma_variant", "gemma_2b"),
        action_expert_variant=cfg.get("action_expert_variant", "gemma_300m"),
        bf16_params=int(cfg.get("dtype", "float32") == "bfloat16"),
        quantile_norm=int(cfg.get("normalization_mapping", {}).get("STATE", "QUANTILES") == "QUANTILES"),
    )


def load_model(path: str | Path):
    """The bare :class:`LeRobotPI05Model` from our export or from a local LeRobot pi05 checkpoint dir (keys
    fixed the way ``PI05Policy.from_pretrained`` fixes them; missing statistics keep their defaults)."""
    from lerobot.policies.pi05.modeling_pi05 import PI05Policy
    from loongforge.checkpoint.safetensors_io import read_header
    from loongforge.errors import CheckpointError
    from safetensors.torch import load_file

    from loongforge_embodied.policies.lerobot_pi05.modeling_lerobot_pi05 import LeRobotPI05Model

    path = Path(path)
    arch = arch_from_dir(path)
    read_header(path / "model.safetensors")  # NOTE: a truncated or garbled file is one line naming it
    model = LeRobotPI05Model(arch)
    sd = PI05Policy._fix_pytorch_state_dict_keys(model, load_file(str(path / "model.safetensors")), model.config)
    sd = {k if k.startswith("model.") else f"model.{k}": v for k, v in sd.items()}
    sd = siglip_names.match(sd, model.state_dict().keys())
    try:
        missing, unexpected = model.load_state_dict(sd, strict=False)
    except RuntimeError as exc:  # NOTE: size mismatches: the config disagrees with the weights
        lines = [x.strip() for x in str(exc).splitlines() if "size mismatch" in x]
        raise CheckpointError(f"{path}: config.json does not match model.safetensors "
                              f"({(lines or [str(exc)])[0][:300]})") from None
    missing = [k for k in missing if not k.startswith(STATS_PREFIX)]
    if missing or unexpected:
        raise CheckpointError(f"{path}: does not match the lerobot_pi05 model (missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]})")
    sidecar = path / SIDECAR
    if sidecar.exists():
        from loongforge.bounded_json import read_json_object

        try:
            model.set_stats(read_json_object(sidecar, error=CheckpointError)["stats"])
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{sidecar}: key 'stats': {(str(exc).splitlines() or [''])[0][:200]}") from None
    return model
