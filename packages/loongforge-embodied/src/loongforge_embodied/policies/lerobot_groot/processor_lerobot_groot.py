"""Our collated samples → GR00T N1.7 inputs, made by LeRobot's own N1.7 processor steps (as
``make_groot_pre_post_processors`` chains them for a model without checkpoint statistics):

- ``GrootN17PackInputsStep``: state and actions min-max normalised to [-1, 1] with the dataset's min / max (left as
  they are where the dataset records none, as LeRobot does), zero-padded to ``max_state_dim`` / ``max_action_dim``;
  the action mask from the chunk's padded steps; the task formalised; the embodiment id;
- ``GrootN17VLMEncodeStep``: frames cropped and resized, put with the task into Qwen3-VL's chat template and encoded
  by the backbone's own processor (read from the local ``vlm`` directory, not the hub id LeRobot names).

Flow noise (padded to ``max_action_dim``) and time pass through from the data pipeline.
"""

from __future__ import annotations

import os

import torch

from loongforge_embodied.policies.flow_noise import pad_noise
from loongforge_embodied.policies.lerobot_groot.configuration_lerobot_groot import (
    LeRobotGrootArch,
    hub_cache,
    local_vlm,
)

MODEL_KEYS = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids", "embodiment_id",
              "action_mask")
_steps: dict[int, tuple] = {}


def vlm_dir(arch: LeRobotGrootArch) -> str:
    """The backbone's local directory (never the network), or a one-line error naming ``model.arch.vlm``."""
    from loongforge.errors import RecipeError

    from loongforge_embodied.policies.lerobot_groot.configuration_lerobot_groot import (
        PUBLISHED_VLM,
        VLM_FILES,
    )

    folder = local_vlm(arch.vlm)
    if folder is None:
        raise RecipeError(f"'{arch.vlm}': no local folder with {' and '.join(VLM_FILES)}, and no such hub id in the "
                          f"local Hugging Face cache ({hub_cache()}); download it first (e.g. `hf download "
                          f"{PUBLISHED_VLM}`) or name a local Qwen3-VL directory", key="model.arch.vlm")
    return folder


def check_arch(arch: LeRobotGrootArch) -> None:
    """Run once at job setup: the backbone directory is here and its Qwen3-VL processor loads (in the main process:
    one clear error there, not a worker's traceback)."""
    from loongforge.errors import RecipeError

    try:
        _processor_steps(arch, {})[1].proc  # noqa: B018 (loads the processor)
    except RecipeError:
        raise
    except Exception as e:  # NOTE: a broken processor file fails in many ways (OSError, ValueError, KeyError, ...)
        raise RecipeError(f"'{arch.vlm}' has no Qwen3-VL processor that loads from a local folder: "
                          f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}", key="model.arch.vlm") from e


def _lerobot_stats(stats: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for ours, theirs in (("state", "observation.state"), ("action", "action")):
        if f"{ours}_min" in stats and f"{ours}_max" in stats:
            out[theirs] = {k: torch.as_tensor(stats[f"{ours}_{k}"], dtype=torch.float32) for k in ("min", "max")}
    return out


def _processor_steps(arch: LeRobotGrootArch, stats: dict[str, torch.Tensor]):
    """LeRobot's pack and VLM-encode steps for ``stats`` (cached per stats object)."""
    hit = _steps.get(id(stats))
    if hit is not None and hit[0] is stats and hit[1] == arch:
        return hit[2]
    from lerobot.policies.groot.processor_groot import GrootN17PackInputsStep, GrootN17VLMEncodeStep

    # NOTE: every DataLoader worker tokenizes its own batches: no tokenizer thread pool per worker
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    mapping = {"new_embodiment": arch.embodiment_id}
    steps = (GrootN17PackInputsStep(action_horizon=arch.chunk_size, valid_action_horizon=arch.chunk_size,
                                    max_state_dim=arch.max_state_dim, max_action_dim=arch.max_action_dim,
                                    embodiment_tag="new_embodiment", embodiment_mapping=mapping,
                                    stats=_lerobot_stats(stats)),
             GrootN17VLMEncodeStep(model_name=vlm_dir(arch), image_crop_size=[arch.image_crop_size] * 2,
                                   image_target_size=[arch.image_target_size] * 2))
    _steps[id(stats)] = (stats, arch, steps)
    return steps


def unnormalize(x: torch.Tensor, key: str, *, stats: dict[str, torch.Tensor]) -> torch.Tensor:
    """Inverse of LeRobot's min-max normalisation of ``key`` (``state`` / ``action``) to [-1, 1], clipped to
    [-1, 1] first as LeRobot's N1.7 post-processor does (``clip_normalized_action``)."""
    lo, hi = stats[f"{key}_min"], stats[f"{key}_max"]
    x = x.clamp(-1.0, 1.0)
    return torch.where(hi != lo, (x + 1) / 2 * (hi - lo) + lo, lo)


def lerobot_frames(raw: dict) -> dict:
    """Our raw keys → the LeRobot batch the N1.7 pre-processor takes (``observation.images.cam<i>``, state,
    ``task``, ``action`` / ``action_is_pad``)."""
    batch = {f"observation.images.cam{i}": raw["images"][:, i] for i in range(raw["images"].shape[1])}
    batch["observation.state"] = raw["state"].float()
    batch["task"] = list(raw["task"])
    if "actions" in raw:
        batch["action"] = raw["actions"].float()
        if "action_pad" in raw:
            batch["action_is_pad"] = raw["action_pad"].bool()
    return batch


def prepare_batch(raw: dict, *, arch: LeRobotGrootArch, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Collated samples (``images`` in [0, 1], ``state``, ``task``, optional ``actions``/``action_pad``/``noise``/
    ``time``) → model inputs."""
    from lerobot.processor.converters import batch_to_transition, transition_to_batch

    pack, encode = _processor_steps(arch, stats)
    out = transition_to_batch(encode(pack(batch_to_transition(lerobot_frames(raw)))))
    model = {k: out[k] for k in MODEL_KEYS if k in out}
    model["state"] = out["state"]
    if "actions" in raw:
        model["actions"] = out["action"]
    if "noise" in raw:
        model["noise"] = pad_noise(raw["noise"].float(), arch.max_action_dim)
    if "time" in raw:
        model["time"] = raw["time"].float()
    return model
