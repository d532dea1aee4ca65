"""Batch preparation for the GR00T-style policy: normalise, zero-pad state/actions to the model's max dims,
tokenise the task (UTF-8 bytes) and attach the embodiment id."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongforge_embodied.policies.byte_tokens import encode_tasks
from loongforge_embodied.policies.groot.configuration_groot import GrootArch


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    return F.pad(x, (0, size - x.shape[-1]))


def prepare_batch(raw: dict, *, arch: GrootArch, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Raw collated samples (``images``, ``state``, ``task``, optional ``actions``/``action_pad``/``noise``/
    ``time``/``embodiment_id``) → the model's inputs. Noise is zero-padded like the actions: padded action
    dims stay exactly zero along the flow."""
    state = (raw["state"].float() - stats["state_mean"]) / stats["state_std"]
    text, text_mask = encode_tasks(raw["task"], max_tokens=arch.max_text_tokens)
    images = raw["images"]
    if images.shape[-1] != arch.image_size or images.shape[-2] != arch.image_size:
        flat = F.interpolate(images.flatten(0, 1).float(), size=(arch.image_size,) * 2, mode="bilinear",
                             align_corners=False)
        images = flat.reshape(*images.shape[:2], *flat.shape[1:])
    b = state.shape[0]
    emb = raw.get("embodiment_id")
    out = {
        "images": images,
        "lang_tokens": text.to(state.device),
        "lang_mask": text_mask.to(state.device),
        "state": _pad_last(state, arch.max_state_dim),
        "embodiment": torch.as_tensor(arch.embodiment_id if emb is None else emb, dtype=torch.long,
                                      device=state.device).reshape(-1).expand(b).clone(),
    }
    if "actions" in raw:
        actions = (raw["actions"].float() - stats["action_mean"]) / stats["action_std"]
        out["actions"] = _pad_last(actions, arch.max_action_dim)
        dims = torch.arange(arch.max_action_dim, device=actions.device) < actions.shape[-1]
        out["action_mask"] = (~raw["action_pad"].bool())[..., None] & dims
    if "noise" in raw:
        out["noise"] = _pad_last(raw["noise"], arch.max_action_dim)
    if "time" in raw:
        out["time"] = raw["time"]
    return out
