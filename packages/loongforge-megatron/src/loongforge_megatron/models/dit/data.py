"""``data.format: latents`` — a DiT's training samples: clean latents (or images to encode), a class label, and the
diffusion noise and timestep, each drawn from a generator seeded by the sample index (resume is exact).

- :class:`SyntheticLatents` (no ``data.path``): per-class smooth latent patterns plus a little noise, so the
  denoising loss can fall; for tests and benchmarks.
- :class:`ImageFolderLatents` (``data.path``): an ImageNet-style folder, one sub-folder of images per class
  (classes numbered in sorted order), resized and centre-cropped as DiT does, flipped at random, scaled to
  [-1, 1]. The frozen ``AutoencoderKL`` of ``model.vae`` encodes them on the accelerator in the forward step
  (:class:`VAEEncoder`), batched; the sample's share of the VAE's posterior noise is drawn here too.

Every sample: ``labels`` is replaced by the null class (``num_classes``) with probability ``class_dropout``
(classifier-free guidance), ``timesteps`` is uniform over the 1000 DDPM steps, ``noise`` is standard normal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from loongforge.errors import RecipeError

NUM_TIMESTEPS = 1000
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")
DEFAULT_CLASS_DROPOUT = 0.1
VAE_DOWNSAMPLING = 8  # what the validation assumes; the VAE's own config is checked when it is loaded


def _generator(seed: int, idx: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + idx)


def _diffusion(g: torch.Generator, label: int, *, num_classes: int, class_dropout: float,
               latent_shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Label (maybe dropped to the null class), timestep and noise of one sample."""
    if class_dropout > 0 and float(torch.rand((), generator=g)) < class_dropout:
        label = num_classes
    return {"labels": torch.tensor(label), "timesteps": torch.randint(0, NUM_TIMESTEPS, (), generator=g),
            "noise": torch.randn(latent_shape, generator=g)}


class SyntheticLatents:
    """Deterministic latents: class ``y``'s pattern (a seeded 4x4 random field per channel, upsampled) plus 0.1 x
    noise, so each class is a learnable mode."""

    def __init__(self, *, arch: Any, seed: int, class_dropout: float = DEFAULT_CLASS_DROPOUT):
        self.shape = (arch.in_channels, arch.sample_size, arch.sample_size)
        self.num_classes, self.seed, self.class_dropout = arch.num_classes, seed, class_dropout

    def __len__(self) -> int:
        return 1 << 40

    def pattern(self, label: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 7919 + label + 1)
        low = torch.randn((1, self.shape[0], 4, 4), generator=g)
        return torch.nn.functional.interpolate(low, size=self.shape[1:], mode="bilinear", align_corners=False)[0]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        g = _generator(self.seed, idx)
        label = int(torch.randint(0, self.num_classes, (), generator=g))
        latents = self.pattern(label) + 0.1 * torch.randn(self.shape, generator=g)
        return {"latents": latents, **_diffusion(g, label, num_classes=self.num_classes,
                                                 class_dropout=self.class_dropout, latent_shape=self.shape)}


def scan_image_folder(path: str | Path, *, num_classes: int) -> tuple[list[str], list[tuple[Path, int]]]:
    """(class names, [(image, class index)]) of an ImageNet-style folder; one-line errors for a missing folder,
    no class sub-folders, a class folder without images, or more classes than the model has."""
    root = Path(path)
    if not root.is_dir():
        raise RecipeError(f"'{path}' is not a directory (an image folder: one sub-folder of images per class)",
                          key="data.path")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise RecipeError(f"'{path}' has no class sub-folders (expected one folder of images per class, "
                          "ImageNet-style)", key="data.path")
    if len(classes) > num_classes:
        raise RecipeError(f"'{path}' has {len(classes)} class folders but the model has {num_classes} classes "
                          "(model.num_classes)", key="data.path")
    images = []
    for label, name in enumerate(classes):
        found = sorted(f for f in (root / name).rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file())
        if not found:
            raise RecipeError(f"class folder '{root / name}' holds no images ({', '.join(IMAGE_SUFFIXES)})",
                              key="data.path")
        images += [(f, label) for f in found]
    return classes, images


def center_crop(image: Any, size: int) -> Any:
    """DiT's (ADM's) preprocessing: box-downsample while the short side is >= 2x ``size``, bicubic-resize the short
    side to ``size``, centre-crop ``size`` x ``size``."""
    from PIL import Image

    while min(image.size) >= 2 * size:
        image = image.resize(tuple(x // 2 for x in image.size), resample=Image.BOX)
    scale = size / min(image.size)
    image = image.resize(tuple(round(x * scale) for x in image.size), resample=Image.BICUBIC)
    left, top = (image.size[0] - size) // 2, (image.size[1] - size) // 2
    return image.crop((left, top, left + size, top + size))


class ImageFolderLatents:
    """Images of an ImageNet-style folder for a DiT, visited in a seeded order reshuffled every epoch."""

    def __init__(self, path: str, *, arch: Any, image_size: int, latent_downsampling: int, seed: int,
                 class_dropout: float = DEFAULT_CLASS_DROPOUT):
        self.classes, self.images = scan_image_folder(path, num_classes=arch.num_classes)
        self.image_size, self.seed, self.class_dropout = image_size, seed, class_dropout
        self.num_classes = arch.num_classes
        side = image_size // latent_downsampling
        self.latent_shape = (arch.in_channels, side, side)
        self._epoch: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        return 1 << 40  # NOTE: epochs follow one another; the order is reshuffled in each

    def _image(self, idx: int) -> int:
        epoch, i = divmod(idx, len(self.images))
        if self._epoch is None or self._epoch[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch = (epoch, torch.randperm(len(self.images), generator=g).tolist())
        return self._epoch[1][i]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        import numpy as np
        from PIL import Image, UnidentifiedImageError

        path, label = self.images[self._image(idx)]
        g = _generator(self.seed, idx)
        try:
            with Image.open(path) as im:
                image = center_crop(im.convert("RGB"), self.image_size)
        except (UnidentifiedImageError, OSError) as exc:
            raise RecipeError(f"cannot read image '{path}': {exc}".splitlines()[0], key="data.path") from None
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1.0
        if float(torch.rand((), generator=g)) < 0.5:
            pixels = pixels.flip(-1)
        out = _diffusion(g, label, num_classes=self.num_classes, class_dropout=self.class_dropout,
                         latent_shape=self.latent_shape)
        return {"pixels": pixels, "vae_noise": torch.randn(self.latent_shape, generator=g), **out}


class VAEEncoder:
    """A frozen diffusers ``AutoencoderKL`` turning a batch's ``pixels`` into scaled latents on the accelerator:
    ``(mean + std * vae_noise - shift_factor) * scaling_factor`` (a posterior sample, with the sample's noise)."""

    def __init__(self, path: str, *, device: torch.device):
        from diffusers import AutoencoderKL

        self.vae = AutoencoderKL.from_pretrained(path, torch_dtype=torch.float32).to(device).eval().requires_grad_(False)
        cfg = self.vae.config
        self.scaling_factor = cfg.scaling_factor
        self.shift_factor = getattr(cfg, "shift_factor", None) or 0.0
        self.latent_channels = cfg.latent_channels
        self.downsampling = 2 ** (len(cfg.block_out_channels) - 1)

    @torch.no_grad()
    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        posterior = self.vae.encode(batch["pixels"].float()).latent_dist
        return (posterior.mean + posterior.std * batch["vae_noise"] - self.shift_factor) * self.scaling_factor


def check_vae_dir(path: str) -> None:
    """One-line errors for a ``model.vae`` that is not a diffusers AutoencoderKL folder."""
    root = Path(path)
    config = root / "config.json"
    if not config.is_file():
        hint = f"; its VAE is '{root / 'vae'}'" if (root / "vae" / "config.json").is_file() else ""
        raise RecipeError(f"'{path}' is not a diffusers AutoencoderKL folder (no config.json){hint}", key="model.vae")
    try:
        cls = json.loads(config.read_text()).get("_class_name")
    except json.JSONDecodeError as exc:
        raise RecipeError(f"{config}: invalid JSON ({exc})", key="model.vae") from None
    if cls != "AutoencoderKL":
        raise RecipeError(f"'{path}' holds a {cls}, not an AutoencoderKL", key="model.vae")
    if not any(root.glob("*.safetensors")) and not any(root.glob("*.bin")):
        raise RecipeError(f"'{path}' has no weights (*.safetensors)", key="model.vae")


def build_latents(recipe: Any, *, arch: Any, device: torch.device) -> tuple[Any, VAEEncoder | None]:
    """(dataset, VAE encoder or None) of a DiT recipe; checks the VAE against the model and the image size."""
    data = recipe.data
    dropout = DEFAULT_CLASS_DROPOUT if data.class_dropout is None else data.class_dropout
    if not data.path:
        return SyntheticLatents(arch=arch, seed=recipe.train.seed, class_dropout=dropout), None
    check_vae_dir(recipe.model.vae)
    dataset = ImageFolderLatents(data.path, arch=arch, image_size=image_size(recipe, arch),
                                 latent_downsampling=VAE_DOWNSAMPLING, seed=recipe.train.seed, class_dropout=dropout)
    encoder = VAEEncoder(recipe.model.vae, device=device)
    if encoder.latent_channels != arch.in_channels:
        raise RecipeError(f"the VAE's {encoder.latent_channels} latent channels do not match the model's "
                          f"in_channels {arch.in_channels}", key="model.vae")
    if encoder.downsampling != VAE_DOWNSAMPLING:
        raise RecipeError(f"the VAE downsamples {encoder.downsampling}x; DiT recipes assume "
                          f"{VAE_DOWNSAMPLING}x (image side = 8 x model.sample_size)", key="model.vae")
    return dataset, encoder


def image_size(recipe: Any, arch: Any) -> int:
    """``data.image_size``, default 8 x the model's latent side."""
    return recipe.data.image_size or VAE_DOWNSAMPLING * arch.sample_size
