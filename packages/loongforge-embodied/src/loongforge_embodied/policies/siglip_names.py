"""SigLIP tower parameter names across transformers versions (no torch import).

transformers < 5.6 — the range LeRobot 0.6.1 supports — nests ``SiglipVisionModel``'s modules under
``vision_model.`` (``<root>vision_model.embeddings...``); 5.24 holds them directly (``<root>embeddings...``).
Neither LeRobot's loaders nor ``load_state_dict`` map one to the other. Exports are written nested (what a LeRobot
user has); loading maps a checkpoint to the layout of the model at hand. A tower's root is found by its patch
embedding, so this serves every policy (pi05's PaliGemma, tiny_vla, GR00T) without naming their modules.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

INNER = "vision_model."
MARK = "embeddings.patch_embedding.weight"
CHILDREN = ("embeddings.", "encoder.", "post_layernorm.", "head.")  # SiglipVisionTransformer's modules
V = TypeVar("V")


def roots(keys: Iterable[str]) -> set[str]:
    """Prefixes of every SigLIP tower in ``keys`` (flat or nested), without the ``vision_model.`` level."""
    out = set()
    for k in keys:
        if k.endswith(MARK):
            root = k[: -len(MARK)]
            out.add(root[: -len(INNER)] if root.endswith(INNER) else root)
    return out


def is_nested(keys: Iterable[str]) -> bool:
    keys = list(keys)
    return any(r + INNER + MARK in keys for r in roots(keys))


def to_layout(sd: Mapping[str, V], *, nested: bool) -> dict[str, V]:
    """``sd`` with every SigLIP tower's names nested under ``vision_model.`` (or flattened)."""
    towers = roots(sd)
    out: dict[str, V] = {}
    for k, v in sd.items():
        for r in towers:
            if nested and any(k.startswith(r + c) for c in CHILDREN):
                k = r + INNER + k[len(r):]
                break
            if not nested and k.startswith(r + INNER):
                k = r + k[len(r) + len(INNER):]
                break
        out[k] = v
    return out


def encoder_layers(tower: Any) -> Any:
    """The encoder layers of a ``SiglipVisionModel`` in either layout."""
    return getattr(tower, "vision_model", tower).encoder.layers


def installed_nests() -> bool:
    """Whether the installed transformers nests ``SiglipVisionModel`` under ``vision_model`` (< 5.6)."""
    import inspect

    from transformers.models.siglip.modeling_siglip import SiglipVisionModel

    return "self.vision_model = " in inspect.getsource(SiglipVisionModel.__init__)


def match(sd: Mapping[str, V], expected: Iterable[Any]) -> dict[str, V]:
    """``sd`` in the layout of the model whose state-dict names are ``expected``."""
    return to_layout(sd, nested=is_nested(expected))
