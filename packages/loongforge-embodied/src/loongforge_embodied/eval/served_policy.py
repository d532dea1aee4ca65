"""What the policy server serves: a batch of checked observations in, one action chunk per observation out."""

from __future__ import annotations

import zlib
from typing import Any, Protocol

import numpy as np

from loongforge_embodied.eval.protocol import Feature


class ServedPolicy(Protocol):
    """A policy behind :class:`~loongforge_embodied.eval.server.PolicyServer`.

    ``spec`` lists the arrays a request must hold; ``prompt`` says whether it must also carry a ``prompt``
    (``"required"`` / ``"optional"`` / ``"ignored"``); ``metadata`` is sent to every client on connect;
    ``infer_batch`` maps checked requests to ``{"actions": (T, action_dim) float32}`` each, in order."""

    name: str
    spec: dict[str, Feature]
    prompt: str

    def metadata(self) -> dict[str, Any]: ...

    def infer_batch(self, requests: list[dict[str, Any]]) -> list[dict[str, np.ndarray]]: ...


def request_seed(request: dict[str, Any]) -> int:
    """A seed that is a function of the request's content alone: a sampling policy then answers the same
    observation with the same chunk, whichever requests it was batched with and in whatever order they came."""
    crc = 0
    for key in sorted(request):
        value = request[key]
        data = value.tobytes() if isinstance(value, np.ndarray) else str(value).encode()
        crc = zlib.crc32(data, zlib.crc32(key.encode(), crc))
    return crc
