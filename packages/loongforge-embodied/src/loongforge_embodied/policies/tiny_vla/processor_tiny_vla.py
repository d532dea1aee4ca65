"""Batch preparation for the tiny VLA: normalise state/actions, tokenise the task and the state (pi05-style)."""

from __future__ import annotations

import torch

from loongforge_embodied.policies.byte_tokens import BYTE_VOCAB, TEXT_OFFSET, encode_tasks
from loongforge_embodied.policies.tiny_vla.configuration_tiny_vla import TinyVLAArch

STATE_RANGE = 3.0  # normalised state is clipped to ±3 std before binning


def state_tokens(state: torch.Tensor, *, bins: int) -> torch.Tensor:
    """Discretise a normalised state into ``bins`` ids placed after the byte vocabulary."""
    x = (state.clamp(-STATE_RANGE, STATE_RANGE) + STATE_RANGE) / (2 * STATE_RANGE)
    return (x * (bins - 1)).round().long() + TEXT_OFFSET + BYTE_VOCAB


def prepare_batch(raw: dict, *, arch: TinyVLAArch, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Raw LeRobot-style batch (``observation.*``, ``action``, ``task``) → the model's normalised inputs."""
    state = (raw["state"].float() - stats["state_mean"]) / stats["state_std"]
    text, text_mask = encode_tasks(raw["task"], max_tokens=arch.max_text_tokens)
    if arch.state_input == "linear":  # NOTE: one continuous token (the model's state_proj), counted in the mask
        st = text.new_zeros((text.shape[0], 0))
        st_mask = torch.ones(text.shape[0], 1, dtype=torch.bool)
    else:
        st = state_tokens(state, bins=arch.state_bins)
        st_mask = torch.ones_like(st, dtype=torch.bool)
    images = raw["images"]
    if images.shape[-1] != arch.image_size or images.shape[-2] != arch.image_size:
        flat = torch.nn.functional.interpolate(images.flatten(0, 1).float(), size=(arch.image_size,) * 2,
                                               mode="bilinear", align_corners=False)
        images = flat.reshape(*images.shape[:2], *flat.shape[1:])
    out = {
        "images": images,
        "lang_tokens": torch.cat([text, st], dim=1),
        "lang_mask": torch.cat([text_mask, st_mask], dim=1),
    }
    if arch.state_input == "linear":
        out["state"] = state.clamp(-STATE_RANGE * 2, STATE_RANGE * 2)
    if "actions" in raw:
        out["actions"] = (raw["actions"].float() - stats["action_mean"]) / stats["action_std"]
        out["action_pad"] = raw["action_pad"]
    for key in ("noise", "time"):
        if key in raw:
            out[key] = raw[key]
    return out
