"""Wan's latent cache: ``loongforge data prepare`` encodes clips of frames once, training reads them many times.

Input (``data.frames``): one folder per clip, its frames as ``*.png`` (in name order, all one size, ``1 + 4k``
of them for a temporal compression of 4) and its ``caption.txt``; or a video file per clip, ``<clip>.mp4`` (any
codec FFmpeg decodes, through PyAV; also ``.mov`` / ``.mkv`` / ``.webm`` / ``.avi``; its first ``1 + 4k``
frames, the most there are up to 1,025) with its caption beside it in ``<clip>.txt``::

    frames/clip_a/000.png 001.png ... caption.txt
    frames/clip_b.mp4 clip_b.txt

Output (``data.path``): ``clips/<clip>.safetensors`` holding ``x0`` (the clip's latent video ``[C, F, H, W]``:
the autoencoder's posterior mode, normalised by its per-channel mean / std as Wan's pipelines do) and ``text``
(the text encoder's hidden states of the caption ``[data.text_length, dim]``, zero after the prompt's tokens, as
Wan's pipelines pad them); ``index.json`` lists the clips; ``prepared.json`` last, as the completion marker.
Bad input stops with one line naming the clip / file and what is allowed.

An image-to-video model (more input than output channels) also gets each clip's ``condition``
``[temporal + C, F, H, W]``: the first-frame mask and the latent of the first frame followed by black frames, as
diffusers' ``WanImageToVideoPipeline.prepare_latents`` builds them; one with image tokens (``model.image_dim``,
Wan2.1 I2V) also gets ``image`` ``[tokens, image_dim]``: the penultimate hidden states of ``data.image_encoder``
(a ``CLIPVisionModel``) on the first frame, as the pipeline's ``encode_image``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from loongforge.errors import RecipeError

from loongforge_megatron.models import latent_cache as lc

MAX_VIDEO_BYTES = 4 << 30
MAX_VIDEO_FRAMES = 1 + 4 * 256  # NOTE: the frames read of a longer video (cut it into clips to use the rest)
VIDEO_SUFFIXES = (".mp4", ".mov", ".mkv", ".webm", ".avi")
KEY = "data.frames"


def _bad(where: Path | str, what: str) -> RecipeError:
    return lc.bad(where, what, key=KEY)


def read_clip(folder: Path, *, temporal: int, multiple: int) -> tuple[torch.Tensor, str]:
    """A clip folder's frames ``[3, F, H, W]`` in [-1, 1] and its caption; ``temporal``: F must be 1 + k *
    temporal; ``multiple``: H and W must be multiples of it."""

    names = sorted(p.name for p in folder.iterdir() if p.suffix.lower() == ".png")
    if not names:
        raise _bad(folder, "holds no frames (*.png)")
    if (len(names) - 1) % temporal:
        raise _bad(folder, f"holds {len(names)} frames; a clip has 1 + {temporal} k frames (1, {1 + temporal}, "
                   f"{1 + 2 * temporal}, ...)")
    frames = []
    for name in names:
        path = folder / name
        pixels = lc.read_image(path, key=KEY, what="PNG")
        h, w = pixels.shape[:2]
        if not frames and (w % multiple or h % multiple):
            raise _bad(path, f"is {w} x {h} pixels; width and height must be multiples of {multiple}")
        if frames and pixels.shape != frames[0].shape:
            raise _bad(path, f"is {w} x {h} pixels, the clip's first frame {frames[0].shape[1]} x "
                       f"{frames[0].shape[0]} (a clip's frames are one size)")
        frames.append(pixels)
    caption = lc.read_caption(folder / "caption.txt", owner=folder, key=KEY)
    video = torch.stack(frames).permute(3, 0, 1, 2).float() / 127.5 - 1.0
    return video, caption


def read_video(path: Path, *, temporal: int, multiple: int) -> tuple[torch.Tensor, str]:
    """A video file's first ``1 + k * temporal`` frames (the most it has, up to :data:`MAX_VIDEO_FRAMES`)
    ``[3, F, H, W]`` in [-1, 1], decoded by PyAV, and its caption (``<stem>.txt`` beside it); H and W must be
    multiples of ``multiple``."""
    import av

    lc.regular_file(path, limit=MAX_VIDEO_BYTES, key=KEY)
    frames = []
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise _bad(path, "holds no video stream")
            for frame in container.decode(container.streams.video[0]):
                pixels = torch.from_numpy(frame.to_ndarray(format="rgb24"))
                h, w = pixels.shape[:2]
                if not frames and (w % multiple or h % multiple):
                    raise _bad(path, f"is {w} x {h} pixels; width and height must be multiples of {multiple}")
                if frames and pixels.shape != frames[0].shape:
                    raise _bad(path, f"changes size at frame {len(frames)} ({w} x {h}, the first frame "
                               f"{frames[0].shape[1]} x {frames[0].shape[0]})")
                frames.append(pixels)
                if len(frames) == MAX_VIDEO_FRAMES:
                    break
    except RecipeError:
        raise
    except (av.FFmpegError, OSError, ValueError) as exc:  # NOTE: unreadable containers, corrupt streams
        detail = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise _bad(path, f"is not a readable video ({detail})") from None
    if not frames:
        raise _bad(path, "holds no frames")
    frames = frames[:1 + (len(frames) - 1) // temporal * temporal]
    caption = lc.read_caption(path.with_suffix(".txt"), owner=path, key=KEY)
    video = torch.stack(frames).permute(3, 0, 1, 2).float() / 127.5 - 1.0
    return video, caption


class Encoders:
    """The autoencoder, the text encoder (with its tokenizer) and the image encoder (with its image processor) of
    ``data.autoencoder`` / ``data.text_encoder`` / ``data.image_encoder``, loaded once."""

    def __init__(self, *, autoencoder: str, text_encoder: str, text_length: int, image_encoder: str | None = None):
        import transformers
        from diffusers import AutoencoderKLWan

        lc.quiet_loaders()

        self.autoencoder = lc.load_local(AutoencoderKLWan.from_pretrained, autoencoder, key="data.autoencoder",
                                 what="a diffusers AutoencoderKLWan folder")
        cfg = self.autoencoder.config
        # NOTE: the config's per-channel statistics of the latent space (diffusers' Wan pipelines normalise with them)
        stats = {k.rsplit("_", 1)[1]: v for k, v in cfg.items() if k.endswith(("_mean", "_std"))}
        shape = (-1, 1, 1, 1)
        self.mean = torch.tensor(stats["mean"]).view(shape)
        self.std = torch.tensor(stats["std"]).view(shape)
        self.temporal, self.spatial = int(cfg.scale_factor_temporal), int(cfg.scale_factor_spatial)
        config = lc.load_local(transformers.AutoConfig.from_pretrained, text_encoder, key="data.text_encoder",
                       what="a transformers UMT5 / T5 encoder folder")
        classes = {"umt5": transformers.UMT5EncoderModel, "t5": transformers.T5EncoderModel}
        if config.model_type not in classes:
            raise RecipeError(f"{text_encoder}: a {config.model_type!r} model; the text encoder is a UMT5 or T5 "
                              "encoder", key="data.text_encoder")
        self.text_encoder = lc.load_local(classes[config.model_type].from_pretrained, text_encoder, key="data.text_encoder",
                                  what="a UMT5 / T5 encoder's weights")
        self.tokenizer = lc.load_local(transformers.AutoTokenizer.from_pretrained, text_encoder, key="data.text_encoder",
                               what="a folder with the text encoder's tokenizer")
        self.image_encoder = self.image_processor = None
        if image_encoder is not None:
            config = lc.load_local(transformers.AutoConfig.from_pretrained, image_encoder, key="data.image_encoder",
                           what="a transformers CLIPVisionModel folder")
            if config.model_type not in ("clip_vision_model", "clip"):
                raise RecipeError(f"{image_encoder}: a {config.model_type!r} model; the image encoder is a CLIPVisionModel "
                                  "vision model", key="data.image_encoder")
            self.image_encoder = lc.load_local(transformers.CLIPVisionModel.from_pretrained, image_encoder,
                                       key="data.image_encoder", what="a CLIPVisionModel's weights").eval()
            self.image_processor = lc.load_local(transformers.CLIPImageProcessor.from_pretrained, image_encoder,
                                         key="data.image_encoder", what="a folder with the CLIPImageProcessor")
        self.autoencoder.eval()
        self.text_encoder.eval()
        self.text_length = text_length

    @torch.no_grad()
    def encode_video(self, video: torch.Tensor) -> torch.Tensor:
        """``[3, F, H, W]`` in [-1, 1] -> the normalised latent video ``[C, F', H', W']``."""
        z = self.autoencoder.encode(video[None]).latent_dist.mode()[0]
        return (z - self.mean) / self.std

    @torch.no_grad()
    def encode_condition(self, video: torch.Tensor) -> torch.Tensor:
        """An image-to-video model's condition of ``video`` ``[3, F, H, W]``: the first-frame mask ``[temporal, F',
        H', W']`` (one where the first frame is given) and the normalised latent of the first frame followed by
        black frames ``[C, F', H', W']``, concatenated on the channels."""
        first = torch.cat([video[:, :1], torch.zeros_like(video[:, 1:])], dim=1)
        latent = self.encode_video(first)
        _, frames, h, w = latent.shape
        mask = torch.zeros(self.temporal, frames, h, w)
        mask[:, 0] = 1.0  # NOTE: the first latent frame holds the first video frame, repeated temporal times
        return torch.cat([mask, latent], dim=0)

    @torch.no_grad()
    def encode_image(self, video: torch.Tensor) -> torch.Tensor:
        """``[tokens, dim]``: the image encoder's penultimate hidden states of ``video``'s first frame."""
        from PIL import Image

        pixels = ((video[:, 0] + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0)
        inputs = self.image_processor(images=Image.fromarray(pixels.numpy()), return_tensors="pt")
        return self.image_encoder(**inputs, output_hidden_states=True).hidden_states[-2][0]

    @torch.no_grad()
    def decode_video(self, x0: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`encode_video` (through the decoder): ``[3, F, H, W]``."""
        return self.autoencoder.decode((x0 * self.std + self.mean)[None]).sample[0]

    @torch.no_grad()
    def encode_text(self, caption: str) -> torch.Tensor:
        """``[text_length, dim]``: the encoder's hidden states of the caption's tokens, zeros after them."""
        tok = self.tokenizer([caption], padding="max_length", max_length=self.text_length, truncation=True,
                             add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        hidden = self.text_encoder(tok.input_ids, tok.attention_mask).last_hidden_state[0]
        n = int(tok.attention_mask.sum())
        out = torch.zeros_like(hidden)
        out[:n] = hidden[:n]
        return out


def prepare(recipe: Any, *, force: bool = False) -> Path:
    """Encode ``data.frames``' clips into the cache at ``data.path`` (a no-op when complete, unless ``force``)."""
    from safetensors.torch import save_file

    data = recipe.data
    for key in ("path", "frames", "autoencoder", "text_encoder"):
        if not getattr(data, key):
            raise RecipeError(f"data prepare of a Wan latent cache needs data.{key}", key=f"data.{key}")
    out, root = Path(data.path), Path(data.frames)
    if (out / lc.DONE).is_file() and not force:
        return out
    if not root.is_dir():
        raise RecipeError(f"{root} is not a folder (one sub-folder of frames per clip)", key="data.frames")
    clips = sorted(p for p in root.iterdir() if p.is_dir() or p.suffix.lower() in VIDEO_SUFFIXES)
    if not clips:
        raise _bad(root, "holds no clips (a sub-folder of *.png frames and caption.txt, or <clip>.mp4 and "
                   "<clip>.txt, per clip)")
    names = [p.stem if p.is_file() else p.name for p in clips]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})[0]
        raise _bad(root, f"holds clip {twice!r} twice (a folder and a video, or two videos)")
    arch = recipe.model.arch()
    if data.image_encoder and arch.image_dim is None:
        raise RecipeError("this model has no image-encoder tokens (model.image_dim); remove data.image_encoder",
                          key="data.image_encoder")
    if arch.image_dim is not None and not data.image_encoder:
        raise RecipeError("data prepare for a model with image tokens (model.image_dim) needs data.image_encoder",
                          key="data.image_encoder")
    enc = Encoders(autoencoder=data.autoencoder, text_encoder=data.text_encoder, text_length=data.text_length,
                   image_encoder=data.image_encoder if arch.image_dim is not None else None)
    condition = arch.in_channels - arch.out_channels
    if condition and condition != enc.temporal + arch.out_channels:
        raise RecipeError(f"the model's {condition} condition channels (in_channels - out_channels) are not the "
                          f"first-frame mask ({enc.temporal}) + the autoencoder's latent ({arch.out_channels})",
                          key="data.autoencoder")
    multiple = enc.spatial * max(arch.patch_size[1:])
    (out / "clips").mkdir(parents=True, exist_ok=True)
    (out / lc.DONE).unlink(missing_ok=True)
    records = []
    for folder, name in zip(clips, names, strict=True):
        read = read_clip if folder.is_dir() else read_video
        video, caption = read(folder, temporal=enc.temporal, multiple=multiple)
        x0 = enc.encode_video(video)
        if x0.shape[0] != arch.out_channels:
            raise RecipeError(f"{data.autoencoder}: {x0.shape[0]} latent channels, the model's out_channels are "
                              f"{arch.out_channels}", key="data.autoencoder")
        text = enc.encode_text(caption)
        if text.shape[-1] != arch.text_dim:
            raise RecipeError(f"{data.text_encoder}: {text.shape[-1]}-wide hidden states, the model's text_dim is "
                              f"{arch.text_dim}", key="data.text_encoder")
        tensors = {"x0": x0, "text": text}
        if condition:
            tensors["condition"] = enc.encode_condition(video)
        if enc.image_encoder is not None:
            tensors["image"] = image = enc.encode_image(video)
            if image.shape[-1] != arch.image_dim:
                raise RecipeError(f"{data.image_encoder}: {image.shape[-1]}-wide hidden states, the model's image_dim "
                                  f"is {arch.image_dim}", key="data.image_encoder")
        file = f"clips/{name}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, out / file)
        records.append({"clip": name, "file": file, "shape": list(x0.shape), "caption": caption})
    lc.write_index(out, records, text_length=data.text_length, condition=condition,
                   image=enc.image_encoder is not None, text_dim=arch.text_dim, image_dim=arch.image_dim)
    return out


class LatentCache:
    """``data.format: latent_cache``: the prepared clips as packed samples (videos may differ in size): ``x0`` from
    the cache, noise and noise level drawn per sample index (resume is exact), the text dropped to zeros with
    probability ``data.text_dropout`` (an image-to-video model's condition and image tokens kept)."""

    host_keys = ("grid",)

    def __init__(self, *, path: str, arch: Any, data: Any, objective: Any, seed: int, parts: int):
        root = Path(path)
        done, records = lc.read_index(root)
        try:
            shapes = [tuple(int(n) for n in r["shape"]) for r in records]
            files = [root / str(r["file"]) for r in records]
        except (ValueError, KeyError, TypeError) as exc:
            raise RecipeError(f"{root / lc.INDEX}: not a latent cache index ({str(exc)[:120]})",
                              key="data.path") from None
        lc.check_widths(root, done, text_dim=arch.text_dim, image_dim=arch.image_dim)
        self.keys = {"condition": arch.in_channels - arch.out_channels, "image": arch.image_dim is not None}
        for key, wanted in self.keys.items():
            if done.get(key, 0 if key == "condition" else False) != wanted:
                what = {"condition": f"{wanted or 'no'} condition channels",
                        "image": "image tokens" if wanted else "no image tokens"}[key]
                raise RecipeError(f"{root} was prepared for another model (this one takes {what}): run loongforge "
                                  "data prepare --force with this recipe", key="data.path")
        self.first_frame_clean = data.first_frame_clean
        self.concat_keys = ("x0", "noise", "grid", "sigmas", "text",
                            *(k for k in ("condition", "image") if self.keys[k]),
                            *(("first_clean",) if self.first_frame_clean else ()))
        for file, shape in zip(files, shapes, strict=True):
            if len(shape) != 4 or shape[0] != arch.out_channels:
                raise RecipeError(f"{file}: a latent video of shape {list(shape)}; the model takes "
                                  f"[{arch.out_channels}, frames, height, width]", key="data.path")
            if any(n % p for n, p in zip(shape[1:], arch.patch_size, strict=True)):
                raise RecipeError(f"{file}: latent frames x height x width {list(shape[1:])} do not split into "
                                  f"patches of {list(arch.patch_size)}", key="data.path")
            per_frame = arch.tokens(arch.patch_size[0], *shape[2:])
            if per_frame % parts:
                raise RecipeError(f"{file}: {per_frame} video tokens per latent frame do not split over the "
                                  f"{parts} ranks of the token split (cp, x tp with sequence parallelism)",
                                  key="data.path")
        self.files, self.patch, self.objective, self.seed = files, arch.patch_size, objective, seed
        self.text_dropout = data.text_dropout

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        from loongforge_megatron.models.wan.data import as_packed, draw_first_clean

        try:
            stored = load_file(self.files[idx])
            x0, text = stored["x0"].float(), stored["text"].float()
            extra = {k: stored[k].float() for k in ("condition", "image") if self.keys[k]}
        except (OSError, KeyError, RuntimeError) as exc:
            raise RecipeError(f"{self.files[idx]}: unreadable ({str(exc).splitlines()[0][:120]})",
                              key="data.path") from None
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        sample = {"x0": x0, "noise": torch.randn(x0.shape, generator=g), "sigmas": self.objective.draw_sigma(g)}
        if self.text_dropout > 0 and float(torch.rand((), generator=g)) < self.text_dropout:
            text = torch.zeros_like(text)
        sample["text"] = text
        sample.update(extra)
        if self.first_frame_clean:
            sample["first_clean"] = draw_first_clean(g, self.first_frame_clean)
        return as_packed(sample, self.patch)
