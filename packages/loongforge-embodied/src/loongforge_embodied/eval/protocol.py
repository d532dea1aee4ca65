"""What a request to the policy server must hold, checked before it reaches a policy.

OpenPI's protocol: the client sends a msgpack map of numpy arrays (``openpi_client.msgpack_numpy``) and gets a
map back, ``{"actions": (T, action_dim)}`` here; an error is a text frame (``WebsocketClientPolicy.infer``
raises it as ``RuntimeError``). The keys are the policy's input features (LeRobot names, e.g.
``observation.image`` as uint8 (H, W, 3), ``observation.state`` as float (S,)) and an optional ``prompt``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

PROMPT = "prompt"


class RequestError(ValueError):
    """A malformed request: the message names the key, what came and what is allowed."""


@dataclass(frozen=True)
class Feature:
    """One array the policy reads: its shape and dtype kind (``uint8`` or ``float``)."""

    shape: tuple[int, ...]
    kind: str  # "uint8" | "float"

    def describe(self) -> str:
        return f"{self.kind} {tuple(self.shape)}"

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.kind}


def image(height: int, width: int) -> Feature:
    return Feature((height, width, 3), "uint8")


def vector(dim: int) -> Feature:
    return Feature((dim,), "float")


def check_request(obs: Any, spec: dict[str, Feature], *, prompt: str) -> dict[str, Any]:
    """``obs`` against ``spec``; returns the arrays (floats as float32) and the prompt. ``prompt`` is
    ``"required"``, ``"optional"`` or ``"ignored"``. Raises :class:`RequestError`."""
    if not isinstance(obs, dict):
        raise RequestError(f"a request is a map of observation arrays (got {type(obs).__name__})")
    allowed = sorted(spec) + ([] if prompt == "ignored" else [PROMPT])
    extra = sorted(k for k in obs if k not in spec and k != PROMPT)
    missing = sorted(k for k in spec if k not in obs)
    if missing or extra:
        what = "; ".join(filter(None, [missing and f"missing {', '.join(map(repr, missing))}",
                                       extra and f"unexpected {', '.join(map(repr, map(str, extra)))}"]))
        raise RequestError(f"{what}; the policy takes: {', '.join(allowed)}")
    out: dict[str, Any] = {}
    for key, feat in spec.items():
        value = obs[key]
        if not isinstance(value, np.ndarray):
            raise RequestError(f"'{key}' must be a numpy array {feat.describe()} (got {type(value).__name__})")
        if tuple(value.shape) != tuple(feat.shape):
            raise RequestError(f"'{key}' has shape {tuple(value.shape)}; expected {feat.describe()}")
        if feat.kind == "uint8" and value.dtype != np.uint8:
            raise RequestError(f"'{key}' has dtype {value.dtype}; expected {feat.describe()} (images are uint8)")
        if feat.kind == "float":
            if value.dtype.kind != "f":
                raise RequestError(f"'{key}' has dtype {value.dtype}; expected {feat.describe()}")
            value = value.astype(np.float32)
            if not np.isfinite(value).all():
                raise RequestError(f"'{key}' holds NaN or inf")
        out[key] = value
    text = obs.get(PROMPT)
    if prompt == "required" and text is None:
        raise RequestError(f"missing '{PROMPT}' (the task instruction); the policy takes: {', '.join(allowed)}")
    if text is not None and not isinstance(text, str):
        raise RequestError(f"'{PROMPT}' must be a string (got {type(text).__name__})")
    if text is not None:
        out[PROMPT] = text
    return out
