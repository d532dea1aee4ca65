"""Training samples: a source (LeRobotDataset v3 or synthetic) + per-sample flow noise, augmentation, collate.

A sample's ``images`` are (cameras, 3, H, W); a policy whose arch has ``frame_offsets`` (a world-action model's clip:
the current frame and later ones) gets (cameras, frames, 3, H, W), frames past the episode's end repeating its last
(LeRobot's delta-timestamp padding).

Every random draw of a sample (flow noise, flow time, image shift) comes from a generator seeded by the
sample's stream position, so a sample is identical whichever rank or micro-batch it lands in.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, Dataset

if TYPE_CHECKING:
    from loongforge_embodied.policies import PolicyArch as Arch


def frame_offsets(arch: Arch) -> tuple[int, ...]:
    """The dataset frames of a sample's images, relative to its own (``(0,)``: the frame alone)."""
    return tuple(getattr(arch, "frame_offsets", (0,)))


class SyntheticSource:
    """Deterministic random frames whose action chunk is a smooth function of the state (learnable)."""

    def __init__(self, *, arch: Arch, num_samples: int, task: str):
        self.arch, self.n, self.task = arch, num_samples, task

    def __len__(self) -> int:
        return self.n

    def stats(self) -> dict[str, torch.Tensor]:
        a = self.arch
        return {"state_mean": torch.zeros(a.state_dim), "state_std": torch.ones(a.state_dim),
                "action_mean": torch.zeros(a.action_dim), "action_std": torch.ones(a.action_dim)}

    def __getitem__(self, idx: int) -> dict[str, Any]:
        a = self.arch
        g = torch.Generator().manual_seed(idx)
        state = torch.randn(a.state_dim, generator=g)
        t = torch.arange(a.chunk_size, dtype=torch.float32)[:, None] / a.chunk_size
        base = state[torch.arange(a.action_dim) % a.state_dim]
        clip = () if frame_offsets(a) == (0,) else (len(frame_offsets(a)),)
        return {"images": torch.rand(a.num_cameras, *clip, 3, a.image_size, a.image_size, generator=g),
                "state": state, "actions": base[None] * (1 - t) + torch.tanh(base)[None] * t,
                "action_pad": torch.zeros(a.chunk_size, dtype=torch.bool), "task": self.task}


@cache
def video_backend() -> str:
    """LeRobot's video decoder: ``torchcodec`` where it loads, else ``pyav``. Probed quietly: LeRobot's own default
    logs the whole loader traceback when torchcodec is installed without FFmpeg's shared libraries."""
    try:
        importlib.import_module("torchcodec")
        return "torchcodec"
    except (ImportError, OSError, RuntimeError):
        return "pyav"


class LeRobotSource:
    """A local LeRobotDataset v3 read with delta-timestamp windows: the action chunk of each frame."""

    def __init__(self, *, root: str, repo_id: str, arch: Arch, cameras: list[str] | None,
                 state_key: str = "observation.state"):
        from lerobot.datasets.dataset_metadata import LeRobotDatasetMetadata
        from lerobot.datasets.lerobot_dataset import LeRobotDataset

        from loongforge_embodied.data.lerobot_files import (
            HINT,
            DatasetError,
            check_dataset,
            find_unreadable_parquet,
        )

        # NOTE: first, so that LeRobot never meets a missing file (it would download data.repo_id from the Hub)
        check_dataset(root, state_key=state_key)
        self.state_key, self.chunk_size, self.arch = state_key, arch.chunk_size, arch
        try:
            meta = LeRobotDatasetMetadata(repo_id, root=root)
            self.cameras = cameras or list(meta.camera_keys)
            self.meta = meta
            window = {"action": [i / meta.fps for i in range(arch.chunk_size)]}
            if frame_offsets(arch) != (0,):
                window.update({k: [o / meta.fps for o in frame_offsets(arch)] for k in self.cameras})
            self.ds = LeRobotDataset(repo_id, root=root, delta_timestamps=window, download_videos=False,
                                     video_backend=video_backend())
        except Exception as exc:  # NOTE: pyarrow / datasets / json errors of a file our checks could not see
            bad = find_unreadable_parquet(root)
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            what = bad or f"'{root}' ({type(exc).__name__}: {first})"
            raise DatasetError(f"LeRobot cannot read {what}; {HINT}") from None

    def __len__(self) -> int:
        return len(self.ds)

    def stats(self) -> dict[str, torch.Tensor]:
        s = self.meta.stats
        f = lambda k, m: torch.as_tensor(s[k][m], dtype=torch.float32).flatten()  # noqa: E731
        sk = self.state_key
        out = {"state_mean": f(sk, "mean"), "state_std": f(sk, "std").clamp_min(1e-4),
               "action_mean": f("action", "mean"), "action_std": f("action", "std").clamp_min(1e-4)}
        # NOTE: the 1st / 99th percentiles where recorded (pi05 normalises with them: LeRobot's QUANTILES mode),
        # and the min / max (GR00T N1.7 normalises with them: LeRobot's min-max mode).
        for ours, key in (("state", sk), ("action", "action")):
            out.update({f"{ours}_{q}": f(key, q) for q in ("q01", "q99", "min", "max") if q in s[key]})
        return out

    def __getitem__(self, idx: int) -> dict[str, Any]:
        item = self.ds[idx]
        return {"images": torch.stack([item[k] for k in self.cameras]), "state": item[self.state_key],
                "actions": item["action"], "action_pad": item["action_is_pad"], "task": item["task"]}


class InMemorySource:
    """A :class:`LeRobotSource` decoded into memory once: the same items (uint8 frames kept, scaled on access the
    way LeRobot's ``ToTensor`` scales them; the action window clamped to the episode and padded as LeRobot pads).

    Read straight from the parquet files with pyarrow: one PNG decode per frame at start, after which an item is
    an index (a LeRobot item is a query over the episode's rows and an image decode, per sample and epoch)."""

    def __init__(self, source: LeRobotSource):
        import io

        import numpy as np
        import pyarrow.parquet as pq
        from loongforge.errors import RecipeError
        from PIL import Image

        self.source, self.cameras, self.state_key = source, source.cameras, source.state_key
        meta = source.meta
        videos = [k for k in self.cameras if meta.features[k]["dtype"] == "video"]
        if videos:
            raise RecipeError(f"data.in_memory decodes images stored in the parquet files; {', '.join(videos)} "
                              f"of '{meta.root}' are videos", key="data.in_memory")
        cols = [*self.cameras, self.state_key, "action", "episode_index", "index", "task_index"]
        table = pq.read_table(sorted(Path(meta.root).glob("data/*/*.parquet")), columns=cols)
        order = np.argsort(np.asarray(table.column("index")), kind="stable")
        table = table.take(order)
        n = table.num_rows

        def decode(cell: dict) -> np.ndarray:
            return np.asarray(Image.open(io.BytesIO(cell["bytes"])).convert("RGB"))

        self.images = torch.from_numpy(np.stack([np.stack([decode(c) for c in table.column(k).to_pylist()])
                                                 for k in self.cameras], axis=1)).permute(0, 1, 4, 2, 3).contiguous()
        self.state = torch.as_tensor(np.stack(table.column(self.state_key).to_numpy(zero_copy_only=False)),
                                     dtype=torch.float32)
        self.actions = torch.as_tensor(np.stack(table.column("action").to_numpy(zero_copy_only=False)),
                                       dtype=torch.float32)
        episode = torch.tensor(np.asarray(table.column("episode_index")))
        # first / last row of each row's episode (rows are in index order, episodes contiguous)
        starts = torch.ones(n, dtype=torch.bool)
        starts[1:] = episode[1:] != episode[:-1]
        first = torch.cummax(torch.where(starts, torch.arange(n), 0), 0).values
        ends = torch.ones(n, dtype=torch.bool)
        ends[:-1] = starts[1:]
        last = torch.flip(torch.cummin(torch.flip(torch.where(ends, torch.arange(n), n), [0]), 0).values, [0])
        self.first, self.last = first, last
        tasks = meta.tasks  # NOTE: LeRobot v3: a frame indexed by the task string, column task_index
        by_index = {int(i): str(t) for t, i in zip(tasks.index, tasks["task_index"], strict=True)}
        self.tasks = [by_index[int(i)] for i in np.asarray(table.column("task_index"))]
        self.chunk = source.chunk_size
        self.offsets = frame_offsets(source.arch)

    def __len__(self) -> int:
        return len(self.state)

    def stats(self) -> dict[str, torch.Tensor]:
        return self.source.stats()

    def __getitem__(self, idx: int) -> dict[str, Any]:
        want = torch.arange(idx, idx + self.chunk)
        rows = want.clamp(max=int(self.last[idx]))
        if self.offsets == (0,):
            images = self.images[idx]
        else:
            images = self.images[(idx + torch.tensor(self.offsets)).clamp(max=int(self.last[idx]))].transpose(0, 1)
        return {"images": images.float().div(255.0), "state": self.state[idx],
                "actions": self.actions[rows], "action_pad": want > self.last[idx], "task": self.tasks[idx]}


class FlowSamples(Dataset):
    """Indexed by ``(position, index)`` from :class:`GlobalBatchSampler`; adds per-sample noise and time."""

    def __init__(self, source, *, arch: Arch, seed: int, image_shift: int = 0):
        self.source, self.arch, self.seed, self.shift = source, arch, seed, image_shift

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: tuple[int, int]) -> dict[str, Any]:
        position, index = key
        item = dict(self.source[index])
        g = torch.Generator().manual_seed(self.seed * 7_919 + position)
        item["noise"] = torch.randn(self.arch.chunk_size, self.arch.action_dim, generator=g)
        # NOTE: pi0's flow time is Beta(1.5, 1) scaled into [0.001, 1]; Beta(a, 1) has the closed-form inverse
        # CDF u^(1/a), so the draw can use our seeded generator.
        item["time"] = torch.rand((), generator=g).pow(1.0 / 1.5) * 0.999 + 0.001
        if getattr(self.arch, "flow_time", "beta") == "uniform":  # NOTE: a policy whose law is uniform in [0, 1)
            item["time"] = torch.rand((), generator=g) * (1 - 1e-5)
        if self.shift:
            item["images"] = random_shift(item["images"], pad=self.shift, generator=g)
        return item


def random_shift(images: torch.Tensor, *, pad: int, generator: torch.Generator) -> torch.Tensor:
    """Random-shift augmentation (pad by replication, crop back), one shift per sample."""
    c, h, w = images.shape[-3:]
    padded = torch.nn.functional.pad(images.flatten(0, -4), (pad, pad, pad, pad), mode="replicate")
    dx, dy = (int(v) for v in torch.randint(0, 2 * pad + 1, (2,), generator=generator))
    return padded[..., dy:dy + h, dx:dx + w].reshape(images.shape)


def collate(items: list[dict[str, Any]], *, prepare: Callable, arch: Arch,
            stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    raw = {k: torch.stack([it[k] for it in items]) for k in items[0] if k != "task"}
    raw["time"] = raw["time"].reshape(-1)
    raw["task"] = [it["task"] for it in items]
    return prepare(raw, arch=arch, stats=stats)  # the policy's ``prepare_batch``


@dataclass
class DataBundle:
    source: Any
    stats: dict[str, torch.Tensor]
    loader: DataLoader


def build_loader(source, *, arch: Arch, prepare: Callable, sampler, seed: int, num_workers: int, pin_memory: bool,
                 image_shift: int = 0, stats: dict[str, torch.Tensor] | None = None) -> DataBundle:
    """A DataLoader over ``sampler``'s micro-batches; workers decode and collate in the background."""
    stats = stats or source.stats()
    ds = FlowSamples(source, arch=arch, seed=seed, image_shift=image_shift)
    kw: dict[str, Any] = {"num_workers": num_workers, "pin_memory": pin_memory,
                          "collate_fn": partial(collate, prepare=prepare, arch=arch, stats=stats)}
    if num_workers:
        kw.update(prefetch_factor=4, persistent_workers=True)
    return DataBundle(source, stats, DataLoader(ds, batch_sampler=sampler, **kw))
