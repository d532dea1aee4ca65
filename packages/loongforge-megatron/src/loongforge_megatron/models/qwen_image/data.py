"""``data.format: synthetic`` of a Qwen-Image model: seeded samples of what a latent cache holds (a clean latent
image, the text encoder's hidden states with their mask, an Edit model's clean reference images) plus the
flow-matching noise and noise level, each drawn from a generator seeded by the sample index, so resume is exact.

Samples come from a few "prompts": prompt ``k`` has its own smooth latent image, its own text hidden states of its
own length (the rest padding, masked out), so the velocity loss can fall. With probability ``data.text_dropout``
a sample's text is the empty prompt's (one zero token unmasked) for classifier-free guidance.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from loongforge_megatron.models.flow_matching import FlowMatching

PROMPTS = 8


class SyntheticImages:
    """Deterministic samples: ``x0 [C, H, W]``, ``noise``, ``sigmas`` (0-d), ``text [L, joint_attention_dim]``,
    ``text_mask [L]`` (bool) and, with ``data.reference_images``, ``reference [n, C, H, W]``. Packed
    (``data.packed_sizes``): ``x0`` / ``noise`` / ``reference`` as packed patches, one ``grid`` row per image."""

    def __init__(self, *, arch: Any, data: Any, objective: FlowMatching, seed: int):
        self.shape = (arch.out_channels, data.height, data.width)
        self.sizes, self.patch = [tuple(s) for s in data.packed_sizes], arch.patch_size
        if self.sizes:
            self.concat_keys = ("x0", "noise", "reference", "grid", "sigmas", "text", "text_mask")
            self.host_keys = ("grid",)  # NOTE: the model reads the images' sizes on the host
        self.text_shape = (data.text_length, arch.joint_attention_dim)
        self.references = data.reference_images
        self.objective, self.seed, self.text_dropout = objective, seed, data.text_dropout

    def __len__(self) -> int:
        return 1 << 40

    def _field(self, prompt: int, salt: int, size: tuple[int, int] | None = None) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 7919 + prompt * 31 + salt + 1)
        low = torch.randn((1, self.shape[0], 4, 4), generator=g)
        return F.interpolate(low, size=size or self.shape[1:], mode="bilinear", align_corners=False)[0]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        prompt = int(torch.randint(0, PROMPTS, (), generator=g))
        shape = self.shape
        if self.sizes:
            shape = (shape[0], *self.sizes[int(torch.randint(0, len(self.sizes), (), generator=g))])
        x0 = self._field(prompt, 0, shape[1:]) + 0.1 * torch.randn(shape, generator=g)
        sample = {"x0": x0, "noise": torch.randn(shape, generator=g), "sigmas": self.objective.draw_sigma(g)}
        length, width = self.text_shape
        pg = torch.Generator().manual_seed(self.seed * 104729 + prompt * 31)
        real = 1 + int(torch.randint(0, length, (), generator=pg))
        text, mask = torch.zeros(self.text_shape), torch.zeros(length, dtype=torch.bool)
        if self.text_dropout > 0 and float(torch.rand((), generator=g)) < self.text_dropout:
            mask[0] = True
        else:
            text[:real] = torch.randn((real, width), generator=pg)
            mask[:real] = True
        sample["text"], sample["text_mask"] = text, mask
        if self.references:  # NOTE: the size of the sample's image
            sample["reference"] = torch.stack([self._field(prompt, 2 + i, shape[1:]) for i in range(self.references)])
        return self._packed(sample) if self.sizes else sample

    def _packed(self, sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One sample as the rows of a packed micro-batch: its image as packed patches, its reference images'
        patches joined, and one ``grid`` row per image (the noisy one, then the references)."""
        from loongforge_megatron.models.qwen_image.model import pack

        h, w = sample["x0"].shape[1:]
        out = {k: pack(sample[k][None], self.patch)[0] for k in ("x0", "noise")}
        if self.references:
            out["reference"] = pack(sample["reference"], self.patch).flatten(0, 1)
        out["grid"] = torch.tensor([[1, h // self.patch, w // self.patch]] * (1 + self.references))
        out["sigmas"] = sample["sigmas"].reshape(1)
        out["text"], out["text_mask"] = sample["text"][None], sample["text_mask"][None]
        return out
