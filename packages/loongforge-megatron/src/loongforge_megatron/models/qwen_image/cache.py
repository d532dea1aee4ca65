"""Qwen-Image's latent cache: ``loongforge data prepare`` encodes images with captions once, training reads them
many times.

Input (``data.images``): a folder of images (``*.png`` / ``*.jpg`` / ``*.jpeg`` / ``*.webp``, any size that is a
multiple of 16 pixels), each with its caption beside it in a UTF-8 text file of the same name::

    images/cat.png cat.txt dog.jpg dog.txt ...

Output (``data.path``): ``records/<image>.safetensors`` holding ``x0`` (the image's latent ``[C, H / 8, W / 8]``:
the posterior mode of the diffusers ``AutoencoderKLQwenImage`` in ``data.autoencoder``, normalised by its
``latents_mean`` / ``latents_std`` as Qwen-Image's pipelines do) and ``text`` (the caption's embeddings ``[tokens,
dim]`` exactly as ``QwenImagePipeline.encode_prompt`` makes them with the Qwen2.5-VL text encoder and tokenizer in
``data.text_encoder``: the pipeline's prompt template, its leading tokens dropped); ``empty_prompt.safetensors``
(the embeddings of the empty prompt, which text dropout trains with); ``index.json``; ``prepared.json`` last, as the
completion marker. Bad input stops with one line naming the file and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from loongforge.errors import RecipeError

from loongforge_megatron.models import latent_cache as lc

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
EMPTY = "empty_prompt.safetensors"
KEY = "data.images"


def read_image(path: Path, *, multiple: int) -> tuple[torch.Tensor, str]:
    """An image ``[3, H, W]`` in [-1, 1] and its caption (``<stem>.txt`` beside it); H and W must be multiples of
    ``multiple``."""
    pixels = lc.read_image(path, key=KEY)
    h, w = pixels.shape[:2]
    if w % multiple or h % multiple:
        raise lc.bad(path, f"is {w} x {h} pixels; width and height must be multiples of {multiple}", key=KEY)
    caption = lc.read_caption(path.with_suffix(".txt"), owner=path, key=KEY)
    return pixels.permute(2, 0, 1).float() / 127.5 - 1.0, caption


class Encoders:
    """The autoencoder of ``data.autoencoder`` and the prompt encoder of ``data.text_encoder`` (a diffusers
    ``QwenImagePipeline`` holding the Qwen2.5-VL text encoder and its tokenizer), loaded once."""

    def __init__(self, *, autoencoder: str, text_encoder: str):
        import transformers
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline

        lc.quiet_loaders()
        self.autoencoder = lc.load_local(AutoencoderKLQwenImage.from_pretrained, autoencoder, key="data.autoencoder",
                                         what="a diffusers AutoencoderKLQwenImage folder").eval()
        cfg = self.autoencoder.config
        self.mean = torch.tensor(cfg.latents_mean).view(-1, 1, 1)
        self.std = torch.tensor(cfg.latents_std).view(-1, 1, 1)
        self.spatial = 2 ** len(cfg.temperal_downsample)
        config = lc.load_local(transformers.AutoConfig.from_pretrained, text_encoder, key="data.text_encoder",
                               what="a transformers Qwen2.5-VL folder")
        if config.model_type != transformers.Qwen2_5_VLConfig.model_type:
            raise RecipeError(f"{text_encoder}: a {config.model_type!r} model; Qwen-Image's text encoder is a "
                              "Qwen2.5-VL model", key="data.text_encoder")
        model = lc.load_local(transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained, text_encoder,
                              key="data.text_encoder", what="a Qwen2.5-VL model's weights").eval()
        tokenizer = lc.load_local(transformers.AutoTokenizer.from_pretrained, text_encoder, key="data.text_encoder",
                                  what="a folder with the Qwen2.5-VL tokenizer")
        # NOTE: the pipeline's own prompt encoding (template, dropped prefix, masking); it runs no transformer here
        self.pipeline = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=self.autoencoder,
                                          text_encoder=model, tokenizer=tokenizer, transformer=None)

    @torch.no_grad()
    def encode_image(self, image: torch.Tensor) -> torch.Tensor:
        """``[3, H, W]`` in [-1, 1] -> the normalised latent ``[C, H / 8, W / 8]`` (one frame of the video VAE)."""
        z = self.autoencoder.encode(image[None, :, None]).latent_dist.mode()[0, :, 0]
        return (z - self.mean) / self.std

    @torch.no_grad()
    def decode_image(self, x0: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`encode_image` (through the decoder): ``[3, H, W]``."""
        return self.autoencoder.decode((x0 * self.std + self.mean)[None, :, None]).sample[0, :, 0]

    @torch.no_grad()
    def encode_text(self, caption: str) -> torch.Tensor:
        """``[tokens, dim]``: the pipeline's prompt embeddings of ``caption`` (no padding)."""
        embeds, mask = self.pipeline.encode_prompt(caption, device=torch.device("cpu"))
        return embeds[0] if mask is None else embeds[0][mask[0].bool()]


def prepare(recipe: Any, *, force: bool = False) -> Path:
    """Encode ``data.images`` into the cache at ``data.path`` (a no-op when complete, unless ``force``)."""
    from safetensors.torch import save_file

    data = recipe.data
    for key in ("path", "images", "autoencoder", "text_encoder"):
        if not getattr(data, key):
            raise RecipeError(f"data prepare of a Qwen-Image latent cache needs data.{key}", key=f"data.{key}")
    out, root = Path(data.path), Path(data.images)
    if (out / lc.DONE).is_file() and not force:
        return out
    if not root.is_dir():
        raise RecipeError(f"{root} is not a folder (images with a <image>.txt caption each)", key=KEY)
    images = sorted(p for p in root.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise lc.bad(root, f"holds no images ({' / '.join(IMAGE_SUFFIXES)}, each with a <image>.txt caption)",
                     key=KEY)
    names = [p.stem for p in images]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})[0]
        raise lc.bad(root, f"holds image {twice!r} twice (two files of one name: one caption file for both)", key=KEY)
    arch = recipe.model.arch()
    enc = Encoders(autoencoder=data.autoencoder, text_encoder=data.text_encoder)
    multiple = enc.spatial * arch.patch_size
    (out / "records").mkdir(parents=True, exist_ok=True)
    (out / lc.DONE).unlink(missing_ok=True)

    def text_of(caption: str) -> torch.Tensor:
        text = enc.encode_text(caption)
        if not text.shape[0]:
            raise RecipeError(f"{data.text_encoder}: the prompt {caption[:40]!r} encodes to no tokens after the "
                              "pipeline's template prefix (a tokenizer that is not Qwen2.5-VL's?)",
                              key="data.text_encoder")
        if text.shape[-1] != arch.joint_attention_dim:
            raise RecipeError(f"{data.text_encoder}: {text.shape[-1]}-wide hidden states, the model's "
                              f"joint_attention_dim is {arch.joint_attention_dim}", key="data.text_encoder")
        return text.contiguous()

    records = []
    for path, name in zip(images, names, strict=True):
        image, caption = read_image(path, multiple=multiple)
        x0 = enc.encode_image(image)
        if x0.shape[0] != arch.out_channels:
            raise RecipeError(f"{data.autoencoder}: {x0.shape[0]} latent channels, the model's out_channels are "
                              f"{arch.out_channels}", key="data.autoencoder")
        file = f"records/{name}.safetensors"
        save_file({"x0": x0.contiguous(), "text": text_of(caption)}, out / file)
        records.append({"image": path.name, "file": file, "shape": list(x0.shape), "caption": caption})
    save_file({"text": text_of("")}, out / EMPTY)
    lc.write_index(out, records, text_dim=arch.joint_attention_dim)
    return out


class LatentImages:
    """``data.format: latent_cache``: the prepared images as packed samples (sizes may differ): ``x0`` from the
    cache, noise and noise level drawn per sample index (resume is exact), the text padded (or cut) to
    ``data.text_length`` with its mask, replaced by the empty prompt's with probability ``data.text_dropout``."""

    host_keys = ("grid",)
    concat_keys = ("x0", "noise", "grid", "sigmas", "text", "text_mask")

    def __init__(self, *, path: str, arch: Any, data: Any, objective: Any, seed: int, parts: int,
                 rope_positions: int):
        root = Path(path)
        done, records = lc.read_index(root)
        lc.check_widths(root, done, text_dim=arch.joint_attention_dim)
        try:
            shapes = [tuple(int(n) for n in r["shape"]) for r in records]
            self.files = [root / str(r["file"]) for r in records]
        except (ValueError, KeyError, TypeError) as exc:
            raise RecipeError(f"{root / lc.INDEX}: not a latent cache index ({str(exc)[:120]})",
                              key="data.path") from None
        p = arch.patch_size
        for file, shape in zip(self.files, shapes, strict=True):
            if len(shape) != 3 or shape[0] != arch.out_channels:
                raise RecipeError(f"{file}: a latent image of shape {list(shape)}; the model takes "
                                  f"[{arch.out_channels}, height, width]", key="data.path")
            if shape[1] % p or shape[2] % p:
                raise RecipeError(f"{file}: latent height x width {list(shape[1:])} do not split into patches of "
                                  f"{p}", key="data.path")
            if max(shape[1:]) // p // 2 + data.text_length > rope_positions:
                raise RecipeError(f"{file}: latent height x width {list(shape[1:])} and {data.text_length} text "
                                  f"tokens exceed the model's {rope_positions} RoPE positions", key="data.path")
            if arch.tokens(*shape[1:]) % parts:
                raise RecipeError(f"{file}: {arch.tokens(*shape[1:])} image tokens do not split over the {parts} "
                                  "ranks of the token split (cp, x tp with sequence parallelism)", key="data.path")
        self.max_tokens = max((arch.tokens(*s[1:]) for s in shapes), default=0)
        self.empty = self._load(root / EMPTY)["text"]
        self.patch, self.objective, self.seed = p, objective, seed
        self.text_length, self.text_dropout = data.text_length, data.text_dropout

    def __len__(self) -> int:
        return len(self.files)

    @staticmethod
    def _load(file: Path) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        try:
            return {k: v.float() for k, v in load_file(file).items()}
        except (OSError, RuntimeError) as exc:
            raise RecipeError(f"{file}: unreadable ({str(exc).splitlines()[0][:120]})", key="data.path") from None

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        from loongforge_megatron.models.qwen_image.model import pack

        stored = self._load(self.files[idx])
        if "x0" not in stored or "text" not in stored:
            raise RecipeError(f"{self.files[idx]}: not a cached image (x0 and text)", key="data.path")
        x0, text = stored["x0"], stored["text"]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        noise, sigmas = torch.randn(x0.shape, generator=g), self.objective.draw_sigma(g)
        if self.text_dropout > 0 and float(torch.rand((), generator=g)) < self.text_dropout:
            text = self.empty
        n = min(text.shape[0], self.text_length)
        padded = torch.zeros(self.text_length, text.shape[-1])
        padded[:n] = text[:n]
        mask = torch.arange(self.text_length) < n
        h, w = x0.shape[1:]
        return {"x0": pack(x0[None], self.patch)[0], "noise": pack(noise[None], self.patch)[0],
                "grid": torch.tensor([[1, h // self.patch, w // self.patch]]), "sigmas": sigmas.reshape(1),
                "text": padded[None], "text_mask": mask[None]}
