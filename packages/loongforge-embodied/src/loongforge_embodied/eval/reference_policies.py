"""Reference policies any environment can serve: uniform random actions, and open-loop replay of a recorded
LeRobotDataset. With the environment's scripted expert they check the harness itself: served through the same
server and client as a trained policy, the expert must succeed, random must fail, and replaying the expert's
recorded actions from the recorded seeds must succeed again (a broken observation or action convention shows up
as a failing score, not as a silent 0%)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from loongforge_embodied.eval.protocol import Feature, vector
from loongforge_embodied.eval.served_policy import request_seed


class RandomPolicy:
    """Actions uniform in [low, high], ``chunk`` per request, seeded by the request's content (reproducible)."""

    prompt = "ignored"

    def __init__(self, *, low: np.ndarray, high: np.ndarray, spec: dict[str, Feature], chunk: int = 8):
        self.name = "random"
        self.low, self.high = np.asarray(low, np.float32), np.asarray(high, np.float32)
        self.spec, self.chunk = spec, chunk

    def metadata(self) -> dict[str, Any]:
        return {"policy": self.name, "features": {k: f.to_dict() for k, f in self.spec.items()},
                "action_dim": int(self.low.shape[0]), "chunk_size": self.chunk, "n_action_steps": self.chunk}

    def infer_batch(self, requests: list[dict[str, Any]]) -> list[dict[str, np.ndarray]]:
        out = []
        for req in requests:
            rng = np.random.default_rng(request_seed(req))
            out.append({"actions": rng.uniform(self.low, self.high, (self.chunk, self.low.shape[0])).astype(np.float32)})
        return out


class ReplayPolicy:
    """Replays a recorded LeRobotDataset open-loop: a request is matched to the recorded frame with the nearest
    ``observation.state`` (the first frames of the episodes when the episode starts) and answered with the rest
    of that episode's recorded actions, executed whole (``n_action_steps`` 0)."""

    prompt = "ignored"

    def __init__(self, root: str | Path, *, state_key: str = "observation.state"):
        import pyarrow.parquet as pq

        root = Path(root)
        files = sorted((root / "data").rglob("*.parquet"))
        if not files:
            from loongforge.errors import LoongForgeError

            raise LoongForgeError(f"'{root}' holds no recorded frames (no data/*.parquet): record with "
                                  "loongforge data prepare RECIPE")
        cols = [state_key, "action", "episode_index", "frame_index"]
        tables = [pq.read_table(f, columns=cols).to_pydict() for f in files]
        self.states = np.concatenate([np.asarray(t[state_key], np.float32) for t in tables])
        self.actions = np.concatenate([np.asarray(t["action"], np.float32) for t in tables])
        self.episodes = np.concatenate([np.asarray(t["episode_index"]) for t in tables])
        self.frames = np.concatenate([np.asarray(t["frame_index"]) for t in tables])
        self.name, self.state_key = "replay", state_key
        self.spec = {state_key: vector(self.states.shape[1])}

    def metadata(self) -> dict[str, Any]:
        return {"policy": self.name, "features": {k: f.to_dict() for k, f in self.spec.items()},
                "action_dim": int(self.actions.shape[1]), "chunk_size": 0, "n_action_steps": 0,
                "episodes": int(len(np.unique(self.episodes)))}

    def infer_batch(self, requests: list[dict[str, Any]]) -> list[dict[str, np.ndarray]]:
        out = []
        for req in requests:
            state = req[self.state_key]
            # NOTE: prefer episode starts: at reset the state is the recorded first frame's, exactly.
            starts = np.flatnonzero(self.frames == 0)
            d0 = np.linalg.norm(self.states[starts] - state, axis=1)
            if d0.min() < 1e-3:
                i = int(starts[d0.argmin()])
            else:
                i = int(np.linalg.norm(self.states - state, axis=1).argmin())
            rest = np.flatnonzero((self.episodes == self.episodes[i]) & (self.frames >= self.frames[i]))
            out.append({"actions": self.actions[rest]})
        return out
