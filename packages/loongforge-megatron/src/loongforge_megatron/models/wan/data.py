"""``data.format: synthetic`` of a Wan model: seeded samples of what a latent cache holds (clean latent video,
text-encoder embeddings, image-encoder tokens) plus the flow-matching noise and noise level, each drawn from a
generator seeded by the sample index, so resume is exact.

Samples come from a few "prompts": prompt ``k`` has its own smooth latent video (a seeded 4 x 4 x 4 field per
channel, upsampled), its own text embeddings and image tokens, so the velocity loss can fall. With probability
``data.text_dropout`` a sample's text is the empty prompt's (zeros) for classifier-free guidance; the image tokens
of an I2V model are kept. A model with more input than output channels (I2V) gets ``condition`` channels that
stand in for the mask and the encoded first frame.

With ``data.packed_frames`` each sample draws its frame count from that list and comes as patch tokens (the
layout of :func:`~loongforge_megatron.models.wan.model.patchify`) with its patch ``grid``: a micro-batch joins its
samples' tokens into one packed sequence (``concat_keys``) that the model attends sample by sample.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from loongforge_megatron.models.flow_matching import FlowMatching

PROMPTS = 8


class SyntheticVideo:
    """Deterministic Wan samples: ``x0 [C, F, H, W]``, ``noise``, ``sigmas`` (0-d), ``text [L, text_dim]``, and
    ``image [tokens, image_dim]`` / ``condition [in - out, F, H, W]`` where the model takes them. Packed
    (``data.packed_frames``): ``x0`` / ``noise`` / ``condition`` as ``[tokens, patch values]``, ``grid [1, 3]``,
    ``sigmas [1]``, ``text [1, L, text_dim]``, ``image [1, tokens, image_dim]``, joined over a micro-batch."""

    def __init__(self, *, arch: Any, data: Any, objective: FlowMatching, seed: int):
        self.shape = (arch.out_channels, data.latent_frames, data.latent_height, data.latent_width)
        self.packed_frames, self.patch = tuple(data.packed_frames), arch.patch_size
        if self.packed_frames:
            self.concat_keys = ("x0", "noise", "condition", "grid", "sigmas", "text", "image", "first_clean")
            self.host_keys = ("grid",)  # NOTE: the model reads the sample boundaries on the host
        self.cond_channels = arch.in_channels - arch.out_channels
        self.text_shape = (data.text_length, arch.text_dim)
        self.image_shape = (data.image_tokens, arch.image_dim) if arch.image_dim is not None else None
        self.objective, self.seed, self.text_dropout = objective, seed, data.text_dropout
        self.first_frame_clean = data.first_frame_clean

    def __len__(self) -> int:
        return 1 << 40

    def _field(self, prompt: int, salt: int, channels: int, size: tuple[int, int, int]) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 7919 + prompt * 31 + salt + 1)
        low = torch.randn((1, channels, 4, 4, 4), generator=g)
        return F.interpolate(low, size=size, mode="trilinear", align_corners=False)[0]

    def _prompt(self, prompt: int, salt: int, shape: tuple[int, int]) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 104729 + prompt * 31 + salt)
        return torch.randn(shape, generator=g)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        prompt = int(torch.randint(0, PROMPTS, (), generator=g))
        shape = self.shape
        if self.packed_frames:
            frames = self.packed_frames[int(torch.randint(0, len(self.packed_frames), (), generator=g))]
            shape = (shape[0], frames, *shape[2:])
        x0 = self._field(prompt, 0, shape[0], shape[1:]) + 0.1 * torch.randn(shape, generator=g)
        sample = {"x0": x0, "noise": torch.randn(shape, generator=g), "sigmas": self.objective.draw_sigma(g)}
        text = self._prompt(prompt, 1, self.text_shape)
        if self.text_dropout > 0 and float(torch.rand((), generator=g)) < self.text_dropout:
            text = torch.zeros_like(text)
        sample["text"] = text
        if self.image_shape is not None:
            sample["image"] = self._prompt(prompt, 2, self.image_shape)
        if self.cond_channels > 0:
            sample["condition"] = self._field(prompt, 3, self.cond_channels, shape[1:])
        if self.first_frame_clean:
            sample["first_clean"] = draw_first_clean(g, self.first_frame_clean)
        return as_packed(sample, self.patch) if self.packed_frames else sample


def draw_first_clean(g: torch.Generator, p: float) -> torch.Tensor:
    """Whether a sample trains image-to-video with its first latent frame clean (``data.first_frame_clean``)."""
    return torch.tensor(float(torch.rand((), generator=g)) < p)


def as_packed(sample: dict[str, torch.Tensor], patch: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    """One sample as the rows of a packed micro-batch: its videos as patch tokens, its patch ``grid [1, 3]``, one
    row of per-sample values (``sigmas [1]``, ``text [1, L, dim]``, ``image [1, tokens, dim]``)."""
    from loongforge_megatron.models.wan.model import patchify

    grid = [n // p for n, p in zip(sample["x0"].shape[1:], patch, strict=True)]
    out = {k: patchify(sample[k][None], patch)[0] for k in ("x0", "noise", "condition") if k in sample}
    out["grid"] = torch.tensor([grid])
    out["sigmas"] = sample["sigmas"].reshape(1)
    out.update({k: sample[k][None] for k in ("text", "image") if k in sample})
    if "first_clean" in sample:
        out["first_clean"] = sample["first_clean"].reshape(1)
    return out
