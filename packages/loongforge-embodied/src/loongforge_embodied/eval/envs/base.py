"""The environment adapter interface: one simulator seen as OpenPI-protocol observations and action chunks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np


@dataclass
class Step:
    """What one environment step returns to the rollout."""

    observation: dict[str, Any]
    reward: float
    done: bool
    success: bool
    info: dict[str, Any] = field(default_factory=dict)


class EnvAdapter(Protocol):
    """A simulator for ``loongforge eval``.

    ``reset(seed)`` starts episode ``seed`` and returns its first observation: a map with the keys policies read
    (LeRobot feature names: ``observation.image`` uint8 (H, W, 3), ``observation.state`` float32, and where the
    simulator has it ``observation.environment_state``, the privileged state reference experts read) plus
    ``prompt``. ``step(action)`` applies one action (action_dim,). ``render()`` is one RGB frame for the video.
    ``reference_policy(name, **options)`` builds the env's reference policies (``expert``, ``random``,
    ``replay``) served like any trained policy. The same seed must give the same episode in any process."""

    name: ClassVar[str]
    max_steps: ClassVar[int]  # the episode length when ``--max-steps`` is not given
    fps: ClassVar[int]
    references: ClassVar[tuple[str, ...]]

    def __init__(self, *, image_size: int | None = None): ...

    def reset(self, seed: int) -> dict[str, Any]: ...

    def step(self, action: np.ndarray) -> Step: ...

    def render(self) -> np.ndarray: ...

    def close(self) -> None: ...

    @classmethod
    def reference_policy(cls, name: str, **options: Any): ...
