"""Qwen-VL training samples: ``data.format conversations`` (JSON / JSONL records of messages with image
references) and synthetic image-text samples.

Preprocessing is the checkpoint's own, as transformers' ``AutoProcessor`` does it: the image processor of its
``preprocessor_config.json`` (smart resize between min / max pixels, normalisation, temporal patches), the chat
template, and each image placeholder expanded to the image's merged-patch count. Labels are the tokens of each
assistant message's content and its end-of-turn token, nothing else. A sample is a dict of ``tokens`` /
``labels`` / ``loss_mask`` ``[s]``, ``position_ids`` ``[3, s]`` (multimodal RoPE) and the sample's
``pixel_values`` / ``image_grid_thw``, which a micro-batch concatenates (:attr:`CONCAT_KEYS`).

Packed (``data.pack``, the default): a sample is its record's own tokens (no padding) with ``cu_seqlens`` and its
multimodal positions starting at 0, and a micro-batch is its records back to back in one THD row
(``engine/packing.py``): no pad tokens, no attention across records, the same loss as padded rows. Under pipeline
parallelism every stage sends activations of one shape, so each record is padded to ``seq_length`` there (the
padding is the record's own, after it, and carries no loss).

Records (image and frame paths relative to the records file, inside its folder):

- ShareGPT: ``{"conversations": [{"from": "human", "value": "<image>\\nWhat is this?"}, {"from": "gpt", "value":
  "..."}], "images": ["a.png"]}`` (or ``"image": "a.png"``); each ``<image>`` takes the next image, each
  ``<video>`` the next of ``"videos"``.
- OpenAI: ``{"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text",
  "text": "What is this?"}]}, {"role": "assistant", "content": "..."}]}``; a video part is ``{"type": "video",
  "video": VIDEO}``.
- A video (``VIDEO``) is its frames, already sampled: a list of image files, or ``{"frames": [...], "fps": 2}``
  (the rate they were sampled at; default the video processor's ``fps``, else 2). The checkpoint's video processor
  turns them into temporal patches (``pixel_values_videos`` / ``video_grid_thw``) and its processor writes the
  placeholder (Qwen3-VL: a ``<t seconds>`` timestamp before each temporal patch's tokens); multimodal positions
  advance ``tokens_per_second x temporal_patch_size / fps`` a temporal patch (Qwen2.5-VL) or restart per timestamped
  frame group (Qwen3-VL), as transformers' ``get_rope_index``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import torch
from loongforge.errors import RecipeError

from loongforge_megatron.data.epochs import ShuffledEpochs
from loongforge_megatron.models.qwen_vl.records import (
    MAX_IMAGE_PIXELS,
    Video,
    _bad,
    media_path,
    open_image,
    read_records,
    supervised,
    to_messages,
)
from loongforge_megatron.models.qwen_vl.rope import mrope_positions

CONCAT_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
# NOTE: read on the host by the model (the tower's positions and windows, which token takes which embedding): the
# micro-batch leaves them there when it moves to the device, so no step reads anything back from the device
HOST_KEYS = ("image_grid_thw", "video_grid_thw", "vision_index")

# Qwen2-VL's chat template (the hub's chat_template.json), for a checkpoint directory that has none.
QWEN_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)


def image_embeddings(pixel_values, image_grid_thw, *, merge: int) -> int:
    """How many embeddings the tower makes of a micro-batch's images (merge x merge patches each)."""
    if pixel_values is None or not pixel_values.numel():
        return 0
    return int(image_grid_thw.prod(-1).sum()) // merge ** 2


def vision_rows(input_ids: torch.Tensor, image_token: int, video_token: int | None, *, images: int,
                videos: int | None = None) -> torch.Tensor:
    """``[b, s]``: each image placeholder token's row of the tower's output (the images' embeddings follow the
    placeholders row after row, the order the images were collated in), each video placeholder token's row after
    the ``images`` image embeddings, -1 for other tokens; ``videos``: the video embeddings there are, when known."""
    index = torch.full(input_ids.shape, -1, dtype=torch.long, device=input_ids.device)
    mask = input_ids == image_token
    if int(mask.sum()) != images:
        raise ValueError(f"{int(mask.sum())} image placeholder tokens but {images} image embeddings")
    index[mask] = torch.arange(images, device=input_ids.device)
    if video_token is not None:
        video = input_ids == video_token
        count = int(video.sum())
        if videos is not None and count != videos:
            raise ValueError(f"{count} video placeholder tokens but {videos} video embeddings")
        index[video] = images + torch.arange(count, device=input_ids.device)
    return index


def with_vision_index(batch: dict[str, Any], *, image_token: int, video_token: int | None,
                      merge: int) -> dict[str, Any]:
    """A collated micro-batch (on the host) with its ``vision_index`` (:func:`vision_rows`), when it holds images
    or videos."""
    images = image_embeddings(batch.get("pixel_values"), batch.get("image_grid_thw"), merge=merge)
    videos = image_embeddings(batch.get("pixel_values_videos"), batch.get("video_grid_thw"), merge=merge)
    if images or videos:
        batch["vision_index"] = vision_rows(batch["tokens"], image_token, video_token, images=images, videos=videos)
    return batch


class VisionBatches:
    """How a Qwen-VL dataset's micro-batches are made (``BatchSchedule``'s dataset hooks): the patches joined, the
    vision index made on the host, the grids and the index left there. Needs ``image_token``, ``video_token`` and
    ``merge``."""

    concat_keys, host_keys = CONCAT_KEYS, HOST_KEYS

    def finish_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        return with_vision_index(batch, image_token=self.image_token, video_token=self.video_token, merge=self.merge)


def load_processor(model_dir: str | Path | None):
    """The checkpoint directory's ``AutoProcessor`` (its tokenizer, image processor and chat template)."""
    from transformers import AutoProcessor

    if not model_dir or not any((Path(model_dir) / f).is_file() for f in ("preprocessor_config.json",
                                                                          "processor_config.json")):
        raise RecipeError(f"data.format conversations preprocesses images as the checkpoint's "
                          f"preprocessor_config.json says; '{model_dir}' has none (set model.hf or data.tokenizer "
                          "to the model's directory)", key="data.tokenizer")
    processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    if not getattr(processor, "chat_template", None):
        processor.chat_template = getattr(processor.tokenizer, "chat_template", None) or QWEN_VL_CHAT_TEMPLATE
    return processor


class Conversations(VisionBatches):
    """The records of ``path`` as Qwen-VL samples of ``seq_length`` tokens (rows padded; a longer record is cut
    after its last image, or refused when an image does not fit). Records are visited in a seeded order, a new
    one every epoch, a function of the sample index (resume is exact)."""

    def __init__(self, path: str, *, processor: Any, arch: Any, seq_length: int, seed: int, pack: bool = False,
                 fill: bool = False, multiple_of: int = 1, max_image_pixels: int = MAX_IMAGE_PIXELS,
                 skip_unsupervised: bool = False):
        self.file = Path(path)
        self.records = read_records(path)
        self.max_image_pixels = max_image_pixels
        if skip_unsupervised:
            # NOTE: the records are checked here, not as they are read: a bad one fails before the first step
            keep = [r for n, r in enumerate(self.records)
                    if supervised(to_messages(r, f"{self.file}: record {n + 1}")[0])]
            if not keep:
                raise RecipeError(f"{self.file}: none of its {len(self.records)} records has an assistant turn to "
                                  "train on", key="data.path")
            if len(keep) < len(self.records):
                print(f"[data] {self.file}: {len(self.records) - len(keep)} of {len(self.records)} records have no "
                      "assistant turn and are skipped (data.skip_unsupervised)", file=sys.stderr)
            self.records = keep
        self.processor, self.tok = processor, processor.tokenizer
        v = arch.vision
        self.image_token, self.merge = v["image_token_id"], v["vision_config"].get("spatial_merge_size", 2)
        self.video_token = v.get("video_token_id")
        self.pad_text = getattr(processor, "image_token", "<|image_pad|>")
        if self.tok.convert_tokens_to_ids(self.pad_text) != self.image_token:
            raise RecipeError(f"the tokenizer maps the image placeholder '{self.pad_text}' to id "
                              f"{self.tok.convert_tokens_to_ids(self.pad_text)}, the model's image_token_id is "
                              f"{self.image_token}", key="data.tokenizer")
        self.video_text = getattr(processor, "video_token", "<|video_pad|>")
        # NOTE: Qwen3-VL's processor writes each temporal patch of a video as its own timestamped group, and its
        # get_rope_index gives each group the positions of a one-frame image
        # NOTE: Qwen3-VL's processors (towers with deepstack_visual_indexes, possibly none) write timestamped frames
        self.frame_groups = "deepstack_visual_indexes" in v["vision_config"]
        self.tokens_per_second = float(v["vision_config"].get("tokens_per_second", 2))
        eot = "<|im_end|>"
        self.end_of_turn = eot if self.tok.convert_tokens_to_ids(eot) not in (None, self.tok.unk_token_id) else (
            self.tok.eos_token)
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        self.seq_length, self.seed, self.pack, self.fill = seq_length, seed, pack, fill
        if seq_length % multiple_of:
            raise RecipeError(f"data.seq_length {seq_length} must be a multiple of {multiple_of} (2 x parallel.cp "
                              "under context parallelism, times parallel.tp under sequence parallelism)",
                              key="data.seq_length")
        self.multiple_of = multiple_of
        self._record = ShuffledEpochs(len(self.records), seed)

    def __len__(self) -> int:
        return 1 << 40  # NOTE: epochs follow one another; the record order is reshuffled in each

    def _render(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        """(the chat-templated text, the character spans to train on: each assistant message's content and its
        end-of-turn token)."""
        def render(msgs, gen):
            return self.processor.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

        try:
            text = render(messages, False)
            spans = []
            for i, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                before, through = render(messages[:i], True), render(messages[: i + 1], False)
                if not (text.startswith(through) and through.startswith(before)):
                    raise ValueError("the chat template does not render a conversation turn by turn")
                turn = through[len(before):]
                cut = turn.rfind(self.end_of_turn) if self.end_of_turn else -1
                end = len(before) + (cut + len(self.end_of_turn) if cut >= 0 else len(turn.rstrip()))
                spans.append((len(before), end))
        except Exception as exc:  # noqa: BLE001 - a template error (jinja raises its own types)
            raise _bad(where, f"the chat template failed ({str(exc).splitlines()[0][:160]})") from None
        return text, spans

    def _load(self, refs: list[str], where: str, what: str = "image") -> list[Any]:
        """The RGB images of ``refs`` (paths inside the records' folder; :func:`records.media_path`)."""
        root = self.file.parent
        return [open_image(media_path(root, ref, where=where, what=what), where=where, what=what,
                           max_pixels=self.max_image_pixels) for ref in refs]

    def _images(self, refs: list[str], where: str) -> dict[str, torch.Tensor]:
        pil = self._load(refs, where)
        if not pil:
            return {"pixel_values": torch.zeros(0, self._patch_width()), "image_grid_thw": torch.zeros(0, 3,
                                                                                                   dtype=torch.long)}
        out = self.processor.image_processor(images=pil, return_tensors="pt")
        return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"].long()}

    def _videos(self, videos: list[Video], where: str) -> tuple[dict[str, torch.Tensor], list[str], list[float]]:
        """(the video processor's ``pixel_values_videos`` / ``video_grid_thw``, each video's placeholder text as
        the processor writes it, each video's seconds per temporal patch)."""
        if not videos:
            return ({"pixel_values_videos": torch.zeros(0, self._patch_width()),
                     "video_grid_thw": torch.zeros(0, 3, dtype=torch.long)}, [], [])
        from transformers.video_utils import VideoMetadata

        vp = getattr(self.processor, "video_processor", None)
        if vp is None:
            raise _bad(where, "has a video but the checkpoint's processor has no video processor "
                       "(video_preprocessor_config.json)")
        clips, meta = [], []
        for k, video in enumerate(videos):
            if len(video.frames) < vp.temporal_patch_size:
                raise _bad(where, f"video {k + 1} has {len(video.frames)} frame(s); the model takes at least its "
                           f"temporal patch, {vp.temporal_patch_size} frames")
            frames = self._load(video.frames, where, what=f"video {k + 1} frame")
            if len({f.size for f in frames}) > 1:
                raise _bad(where, f"video {k + 1}: frames of different sizes {sorted({f.size for f in frames})}")
            fps = video.fps or float(getattr(vp, "fps", None) or 2.0)
            clips.append(frames)
            meta.append(VideoMetadata(total_num_frames=len(frames), fps=fps, frames_indices=list(range(len(frames)))))
        out = vp(videos=clips, video_metadata=meta, do_sample_frames=False, return_metadata=True, return_tensors="pt")
        out = {**out, "video_metadata": out.get("video_metadata", meta)}
        texts = [self.processor.replace_video_token(out, k) for k in range(len(clips))]
        seconds = [vp.temporal_patch_size / m.fps for m in meta]
        return ({"pixel_values_videos": out["pixel_values_videos"].float(),
                 "video_grid_thw": out["video_grid_thw"].long()}, texts, seconds)

    def _patch_width(self) -> int:
        ip = self.processor.image_processor
        return 3 * ip.temporal_patch_size * ip.patch_size ** 2

    def encode(self, n: int) -> dict[str, Any]:
        """Record ``n`` (0-based): token ids, 0/1 label mask, pixel values and grids (not cut or padded)."""
        where = f"{self.file}: record {n + 1}"
        messages, refs, videos = to_messages(self.records[n], where)
        if not supervised(messages):
            raise _bad(where, "has no assistant turn, so nothing to train on (set data.skip_unsupervised true to "
                       "skip such records)")
        text, spans = self._render(messages, where)
        images = self._images(refs, where)
        clips, video_texts, seconds = self._videos(videos, where)
        video_texts = iter(video_texts)
        counts = (images["image_grid_thw"].prod(-1) // self.merge ** 2).tolist()
        found = re.findall(f"{re.escape(self.pad_text)}|{re.escape(self.video_text)}", text)
        for what, token, have in (("image", self.pad_text, len(counts)), ("video", self.video_text, len(videos))):
            if found.count(token) != have:
                raise _bad(where, f"the chat template wrote {found.count(token)} {what} placeholders for {have} "
                           f"{what}s")
        # NOTE: each placeholder expanded as the processor does (an image: its merged-patch count of placeholder
        # tokens; a video: the processor's text for it), moving the spans along; the grids in placeholder order
        # give the multimodal positions
        image_texts = iter(self.pad_text * c for c in counts)
        image_grids, video_grids = iter(images["image_grid_thw"].tolist()), iter(clips["video_grid_thw"].tolist())
        video_seconds = iter(seconds)
        pieces, moves, grids, scales, last, shift = [], [], [], [], 0, 0
        for m in re.finditer(f"{re.escape(self.pad_text)}|{re.escape(self.video_text)}", text):
            video = m.group() == self.video_text
            rep = next(video_texts) if video else next(image_texts)
            pieces += [text[last:m.start()], rep]
            shift += len(rep) - (m.end() - m.start())
            moves.append((m.end(), shift))
            last = m.end()
            if not video:
                grids.append(next(image_grids))
                continue
            t, h, w = next(video_grids)
            step = next(video_seconds) * self.tokens_per_second
            if self.frame_groups:
                grids += [[1, h, w]] * t
                scales += [1.0] * t
            else:
                grids.append([t, h, w])
                scales.append(step)
        pieces.append(text[last:])
        full = "".join(pieces)

        def moved(c: int) -> int:
            return c + max((sh for end, sh in moves if end <= c), default=0)

        spans = [(moved(a), moved(b)) for a, b in spans]
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
        n_video = int(clips["video_grid_thw"].prod(-1).sum()) // self.merge ** 2
        for what, token, want in (("image", self.image_token, sum(counts)), ("video", self.video_token, n_video)):
            if want and ids.count(token) != want:
                raise _bad(where, f"{ids.count(token)} {what} tokens after tokenization for {want} {what} "
                           "embeddings (the tokenizer splits the placeholder)")
        return {"ids": ids, "mask": mask, **images, **clips, "rope_grids": grids, "time_scale": scales}

    def cost_features(self, idx: int) -> tuple[float, float, float]:
        """(Σl², Σl, image patches) of sample ``idx`` for ``data.balance``: its tokens and patches estimated from
        the record's text and its images' sizes (headers: no pixel is decoded), once per record. A packed record is
        attended alone; an unpacked one is a padded row of ``seq_length``."""
        n = self._record(idx)
        costs = self.__dict__.setdefault("_costs", {})
        if n not in costs:
            from PIL import Image

            where = f"{self.file}: record {n + 1}"
            messages, refs, videos = to_messages(self.records[n], where)
            text, _ = self._render(messages, where)
            ip, patches = self.processor.image_processor, 0
            for k, ref in enumerate([*refs, *(f for v in videos for f in v.frames)]):
                try:
                    with Image.open(self.file.parent / ref) as im:
                        w, h = im.size
                except (OSError, ValueError) as exc:
                    raise _bad(where, f"image '{ref}' is unreadable ({str(exc).splitlines()[0][:120]})") from None
                # NOTE: a video's frames are merged temporal_patch_size at a time
                per = ip.get_number_of_image_patches(h, w, {})
                patches += per if k < len(refs) else per // ip.temporal_patch_size
            placeholders = text.count(self.pad_text) + text.count(self.video_text)
            tokens = len(self.tok(text, add_special_tokens=False)["input_ids"]) - placeholders + patches // self.merge ** 2
            length = min(tokens, self.seq_length) if self.pack else self.seq_length
            costs[n] = (float(length * length), float(length), float(patches))
        return costs[n]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        n = self._record(idx)
        rec = self.encode(n)
        row = sample(rec["ids"], rec["mask"], pixel_values=rec["pixel_values"], grid_thw=rec["image_grid_thw"],
                     seq_length=self.seq_length, pad=self.pad, image_token=self.image_token,
                     video_token=self.video_token, merge=self.merge, where=f"{self.file}: record {n + 1}",
                     pack=self.pack, fill=self.fill, multiple_of=self.multiple_of, rope_grids=rec["rope_grids"],
                     time_scale=rec["time_scale"])
        return {**row, "pixel_values_videos": rec["pixel_values_videos"], "video_grid_thw": rec["video_grid_thw"]}


def sample(ids: list[int], mask: list[int], *, pixel_values: torch.Tensor, grid_thw: torch.Tensor, seq_length: int,
           pad: int, image_token: int, video_token: int | None, merge: int, where: str, pack: bool = False,
           fill: bool = True, multiple_of: int = 1, rope_grids: list[list[int]] | None = None,
           time_scale: list[float] = ()) -> dict[str, torch.Tensor]:
    """One row of ``seq_length`` tokens: GPT-shifted labels, the 0/1 loss mask, multimodal positions. ``pack``: the
    row also carries ``cu_seqlens`` / ``num_tokens`` and, unless ``fill``, is only as long as the record, padded to
    a multiple of ``multiple_of``. ``rope_grids`` / ``time_scale``: the grid of every image / video placeholder run
    in order and each video run's positions a frame (default: the images' grids)."""
    positions = mrope_positions(ids, grids=grid_thw.tolist() if rope_grids is None else rope_grids,
                                image_token=image_token, video_token=video_token, merge=merge, time_scale=time_scale)
    n = seq_length
    if len(ids) > n + 1:
        if image_token in ids[n:] or (video_token is not None and video_token in ids[n:]):
            raise _bad(where, f"an image's tokens end after data.seq_length {n} (the record has {len(ids)} tokens "
                       "with its images and videos expanded); raise seq_length or use smaller images (max_pixels) "
                       "or fewer frames")
        ids, mask, positions = ids[: n + 1], mask[: n + 1], positions[:, : n + 1]
    real = len(ids) - 1
    if pack and not fill:
        n = -(-real // multiple_of) * multiple_of
    extra = n + 1 - len(ids)
    last = int(positions.max()) + 1 if positions.numel() else 0
    positions = torch.cat([positions, torch.arange(last, last + extra).expand(3, -1)], dim=1)
    ids, mask = ids + [pad] * extra, mask + [0] * extra
    row = {"tokens": torch.tensor(ids[:n]), "labels": torch.tensor(ids[1:]),
           "loss_mask": torch.tensor(mask[1:], dtype=torch.float), "position_ids": positions[:, :n].long(),
           "pixel_values": pixel_values, "image_grid_thw": grid_thw}
    if pack:
        row["cu_seqlens"] = torch.tensor([0, n], dtype=torch.int32)
        row["num_tokens"] = torch.tensor(real)
    return row


class SyntheticImageText(VisionBatches):
    """Deterministic samples: ``[<|vision_start|>, image tokens, <|vision_end|>, caption]`` where the caption is a
    function of the image's colours (so the loss can fall); one ``side`` x ``side`` image per sample."""

    def __init__(self, *, arch: Any, seq_length: int, seed: int, side: int | None = None):
        v = arch.vision
        vc = v["vision_config"]
        self.patch, self.temporal = vc.get("patch_size", 14), vc.get("temporal_patch_size", 2)
        self.merge = vc.get("spatial_merge_size", 2)
        self.side = side or self.patch * self.merge * 2
        self.image_token, self.video_token = v["image_token_id"], v.get("video_token_id")
        self.start, self.end = v.get("vision_start_token_id"), v.get("vision_end_token_id")
        self.vocab = min(arch.vocab_size, min(t for t in (self.image_token, self.start, self.end) if t is not None))
        self.seq_length, self.seed = seq_length, seed
        g = self.side // self.patch
        if self.side % (self.patch * self.merge):
            raise RecipeError(f"data.image_size {self.side} must be a multiple of patch_size x spatial_merge_size = "
                              f"{self.patch * self.merge}", key="data.image_size")
        self.grid = torch.tensor([[1, g, g]])
        if (g // self.merge) ** 2 + 3 >= seq_length:
            raise ValueError(f"data.seq_length {seq_length} leaves no room for text after {(g // self.merge) ** 2} "
                             "image tokens")

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        g = self.side // self.patch
        levels = torch.randint(0, 4, (3,), generator=gen).float()
        patches = levels.view(1, 3, 1, 1, 1).expand(g * g, 3, self.temporal, self.patch, self.patch) / 3.0
        patches = patches + 0.05 * torch.randn(patches.shape, generator=gen)
        n_img = (g // self.merge) ** 2
        words = (levels.long() + 4 * torch.arange(3)) % max(self.vocab - 2, 1) + 1
        text_len = self.seq_length + 1 - n_img - 2
        caption = words.repeat(-(-text_len // 3))[:text_len].tolist()
        ids = [self.start] + [self.image_token] * n_img + [self.end] + caption
        mask = [0] * (n_img + 2) + [1] * len(caption)
        return sample(ids, mask, pixel_values=patches.reshape(g * g, -1), grid_thw=self.grid,
                      seq_length=self.seq_length, pad=0, image_token=self.image_token, video_token=self.video_token,
                      merge=self.merge, where="synthetic")
