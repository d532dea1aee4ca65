"""Policy directories LeRobot loads (``config.json`` + ``model.safetensors``), written atomically.

``write_pretrained`` / ``load_model`` serve the policies whose LeRobot wrapper is an
:class:`~loongforge_embodied.policies.lerobot_glue.ArchPolicyMixin` (tiny_vla, groot); ``staged_dir`` also serves
lerobot_pi05, which writes LeRobot's own pi05 layout. LeRobot is imported only to write.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loongforge_embodied.policies import siglip_names

if TYPE_CHECKING:
    import torch

    from loongforge_embodied.policies.arch import ArchMixin

PREFIX = "model."  # an ArchPolicyMixin policy holds the network as ``self.model``
MAX_SIZE = 2**24  # any one size or count of an exported architecture


@contextlib.contextmanager
def staged_dir(out_dir: str | Path) -> Iterator[Path]:
    """Yield an empty ``<out_dir>.tmp``; on normal exit fsync it and rename it over ``out_dir``, so a reader
    never sees a half-written export (a failed write leaves the staging dir for the next write to clear)."""
    from loongforge.checkpoint.atomic import fsync_tree, replace_dir

    out_dir = Path(out_dir)
    staging = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    yield staging
    fsync_tree(staging)
    replace_dir(staging, out_dir)


def write_pretrained(out_dir: str | Path, *, config_class: type, arch: ArchMixin, weights: dict[str, torch.Tensor],
                     features: dict[str, Any]) -> Path:
    """``config_class`` (an ``ArchPolicyConfig``) filled from ``arch`` and ``features`` (the camera keys and, under
    ``state``, the state's feature key: default ``observation.state``), plus
    ``weights`` under :data:`PREFIX`."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    with staged_dir(out_dir) as staging:
        inputs = {k: PolicyFeature(type=FeatureType.VISUAL, shape=(3, arch.image_size, arch.image_size))
                  for k in features["cameras"]}
        inputs[features.get("state", "observation.state")] = PolicyFeature(type=FeatureType.STATE,
                                                                            shape=(arch.state_dim,))
        action = PolicyFeature(type=FeatureType.ACTION, shape=(arch.action_dim,))
        config = config_class(**arch.to_dict(), camera_keys=list(features["cameras"]), device="cpu",
                              n_action_steps=arch.chunk_size, input_features=inputs, output_features={"action": action})
        config._save_pretrained(staging)
        # NOTE: SigLIP in the layout of transformers < 5.6, LeRobot 0.6.1's range (``siglip_names``).
        named = siglip_names.to_layout({PREFIX + k: v for k, v in weights.items()}, nested=True)
        save_file(named, str(staging / "model.safetensors"))
    return out_dir


def load_model(path: str | Path, *, arch_class: type[ArchMixin], model_class: type[torch.nn.Module]):
    """Our own loader (no LeRobot import): the bare ``model_class`` of an exported directory, strictly.

    ``config.json``'s sizes are checked (types, ranges) and the model they describe is compared, tensor by
    tensor, with ``model.safetensors``'s header before anything is allocated: a config that disagrees with the
    weights, or a truncated file, is one line naming it."""
    import torch
    from loongforge.bounded_json import read_json_object
    from loongforge.checkpoint import check_shapes
    from loongforge.checkpoint.safetensors_io import read_header
    from loongforge.errors import CheckpointError
    from safetensors.torch import load_file

    path = Path(path)
    config, weights = path / "config.json", path / "model.safetensors"
    cfg = read_json_object(config, error=CheckpointError)
    header = {k[len(PREFIX):]: tuple(v["shape"]) for k, v in read_header(weights).items() if k.startswith(PREFIX)}
    try:
        arch = arch_class().with_overrides(**{f.name: cfg[f.name] for f in arch_class.size_fields() if f.name in cfg})
        # NOTE: every layer holds a tensor: more layers than the file has tensors is a lie, and building them
        # (even on the meta device) would take as long as the lie is large
        for name, value in arch.to_dict().items():
            if type(value) is int and (value > MAX_SIZE or ("layers" in name and value > len(header))):
                raise ValueError(f"key '{name}' is {value}, more than {str(weights.name)} can hold "
                                 f"({len(header)} tensors)" if value <= MAX_SIZE else f"key '{name}' is {value}, "
                                 f"more than any size allowed ({MAX_SIZE})")
        with torch.device("meta"):  # NOTE: shapes only; nothing is allocated for a config that lies
            expected = {k: tuple(v.shape) for k, v in model_class(arch).state_dict().items()}
    except (TypeError, ValueError, AssertionError) as exc:
        raise CheckpointError(f"{config}: {(str(exc).splitlines() or [''])[0][:300]}") from None
    check_shapes(expected, siglip_names.match(header, expected.keys()),
                 where=f"{weights} (against {config.name})")
    model = model_class(arch)
    sd = {k[len(PREFIX):]: v for k, v in load_file(str(weights)).items() if k.startswith(PREFIX)}
    model.load_state_dict(siglip_names.match(sd, model.state_dict().keys()), strict=True)
    return model
