"""A trained policy served for evaluation: an exported policy directory (ours, or LeRobot's pi05 layout), with
the preprocessing and normalisation of training: the policy's own ``prepare_batch`` and the dataset statistics
the export carries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from loongforge_embodied.eval.protocol import Feature, image, vector
from loongforge_embodied.eval.served_policy import request_seed

# config.json "type" → our policy name
EXPORT_TYPES = {"loongforge_tiny_vla": "tiny_vla", "loongforge_groot": "groot", "pi05": "lerobot_pi05",
                "smolvla": "lerobot_smolvla",
                "xvla": "lerobot_xvla", "groot": "lerobot_groot", "wall_x": "lerobot_wall_x",
                "fastwam": "lerobot_fastwam", "lingbot_va": "lerobot_lingbot_va"}


def policy_dir(path: str | Path) -> Path:
    """A run directory (its ``hf/`` export) or an exported policy directory → the exported directory."""
    from loongforge.errors import LoongForgeError

    path = Path(path)
    for cand in (path, path / "hf"):
        if (cand / "config.json").is_file() and (cand / "model.safetensors").is_file():
            return cand
    if (path / "checkpoints").is_dir():
        raise LoongForgeError(f"'{path}' has resume checkpoints but no exported policy (hf/): train with "
                              "checkpoint.save_format [dist, hf]")
    raise LoongForgeError(f"'{path}' is neither a run directory with hf/ nor an exported policy directory "
                          "(config.json + model.safetensors)")


def run_task(path: str | Path) -> str | None:
    """The task string a run trained with (its recipe's ``data.task``), where the run directory says."""
    from loongforge_embodied.eval.run_folder import run_data

    return run_data(path).get("task")


class TrainedPolicy:
    """``model`` (one of our policy modules, statistics in its buffers) behind the protocol: requests carry one
    uint8 (H, W, 3) image per camera key and the state under ``state_key`` (``observation.state``, or the feature
    the run was trained on: ``data.state_key``); the reply is the un-normalised chunk."""

    prompt = "optional"

    def __init__(self, model, *, policy: str, cameras: list[str], task: str | None, device: str = "cpu",
                 n_action_steps: int | None = None, label: str | None = None, state_key: str = "observation.state"):
        import torch

        from loongforge_embodied.policies import get_policy

        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.policy, self.cameras, self.task = policy, list(cameras), task
        self.name = label or policy
        self._prepare = get_policy(policy).prepare_batch
        # NOTE: the library adaptations the policy samples with (e.g. a KV-cache shim), applied around each batch
        self._adaptations = get_policy(policy).adaptations()
        a = model.arch
        self.spec: dict[str, Feature] = {k: image(a.image_size, a.image_size) for k in self.cameras}
        self.state_key = state_key
        self.spec[state_key] = vector(a.state_dim)
        self.prompt = "optional" if task else "required"
        self.chunk_size = a.served_steps
        self.n_action_steps = n_action_steps or self.chunk_size
        self._noise_dim = getattr(a, "max_action_dim", a.action_dim)
        # NOTE: the processor builds its tensors (tokens, normalised state) on the CPU, as training's data workers
        # do: the statistics stay there and only its batch goes to the policy's device
        if hasattr(model, "stats_dict"):
            self.stats = {k: v.cpu() for k, v in model.stats_dict().items()}
        else:
            keys = type(model).__module__
            import importlib

            names = importlib.import_module(keys).STAT_KEYS
            self.stats = {k: getattr(model, k).cpu() for k in names}

    @classmethod
    def load(cls, path: str | Path, *, device: str = "cpu", n_action_steps: int | None = None) -> TrainedPolicy:
        """From a run directory or an exported policy directory."""
        from loongforge.bounded_json import read_json_object
        from loongforge.errors import CheckpointError, LoongForgeError

        from loongforge_embodied.policies import get_policy

        export = policy_dir(path)
        config = export / "config.json"
        cfg = read_json_object(config, error=CheckpointError)
        policy = EXPORT_TYPES.get(cfg.get("type")) if isinstance(cfg.get("type"), str) else None
        if policy is None:
            raise LoongForgeError(f"{config}: key 'type' is {str(cfg.get('type'))[:60]!r}; servable: "
                                  f"{', '.join(EXPORT_TYPES)}")
        features = cfg.get("input_features", {})
        if not isinstance(features, dict) or not all(isinstance(k, str) and isinstance(f, dict)
                                                     for k, f in features.items()):
            raise LoongForgeError(f"{config}: key 'input_features' must map feature names to objects")
        cameras = cfg.get("camera_keys") or [k for k, f in features.items() if f.get("type") == "VISUAL"]
        if not isinstance(cameras, list) or not all(isinstance(c, str) and c for c in cameras):
            raise LoongForgeError(f"{config}: key 'camera_keys' must be a list of feature names")
        task = run_task(path) or run_task(export.parent)
        state_key = next((k for k, f in features.items() if f.get("type") == "STATE"), "observation.state")
        model = get_policy(policy).export.load_model(export)
        return cls(model, policy=policy, cameras=cameras, task=task, device=device, n_action_steps=n_action_steps,
                   label=f"{policy}:{export}", state_key=state_key)

    def metadata(self) -> dict[str, Any]:
        a = self.model.arch
        return {"policy": self.name, "features": {k: f.to_dict() for k, f in self.spec.items()},
                "prompt": self.prompt, "task": self.task, "action_dim": a.action_dim, "chunk_size": self.chunk_size,
                "n_action_steps": self.n_action_steps}

    def infer_batch(self, requests: list[dict[str, Any]]) -> list[dict[str, np.ndarray]]:
        import torch

        a = self.model.arch
        images = torch.stack([torch.stack([torch.from_numpy(np.array(r[k])).permute(2, 0, 1)
                                           for k in self.cameras]) for r in requests]).float().div_(255.0)
        raw = {"images": images, "state": torch.from_numpy(np.stack([r[self.state_key] for r in requests]).astype(np.float32)),
               "task": [r.get("prompt") or self.task for r in requests]}
        # NOTE: the processor builds its tensors (tokens, normalised state) on the CPU, as training's data workers
        # do: it gets the statistics there, and its batch goes to the policy's device
        batch = {k: v.to(self.device) for k, v in self._prepare(raw, arch=a, stats=self.stats).items()}
        # NOTE: each request's starting noise is seeded by its content, so a chunk does not depend on the
        # requests it was batched with.
        noise = torch.stack([torch.randn(a.chunk_size, self._noise_dim,
                                         generator=torch.Generator().manual_seed(request_seed(r)))
                             for r in requests]).to(self.device)
        from loongforge.accelerator.adaptation import AdaptationSet

        with AdaptationSet(self._adaptations), torch.inference_mode():
            actions = self.model.unnormalize_actions(self.model.sample_actions(batch, noise=noise))
        actions = actions.float().cpu().numpy()
        return [{"actions": actions[i]} for i in range(len(requests))]
