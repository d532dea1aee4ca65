"""Conversation records (``data.format conversations``): the records file, each record's schema, and the image /
frame files it names, each refused in one line naming the file and the record.

NOTE: the records file is user data, read as hostile: the file itself is a regular file of bounded size and JSON of
bounded nesting; a record's roles, turns, parts and video rates are checked by type and bounded in number (a record
of thousands of turns would take minutes a step to render); an image path resolves (symlinks included) inside the
records' folder; an image's size is read from its header and bounded before it is decoded (a 100000 x 100000 PNG
is a few KiB on disk); a record with nothing to learn (no assistant turn) is refused, or skipped when the recipe
says so.
"""

from __future__ import annotations

import math
import os
import re
import stat
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from loongforge.bounded_json import parse_json, read_regular_file
from loongforge.errors import RecipeError

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
MAX_FILE_BYTES = 8 * 2**30  # the records file is read whole
MAX_TURNS = 256  # messages of one record
MAX_MEDIA = 1024  # images and video frames of one record
MAX_TEXT = 1_000_000  # characters of one record's messages
MAX_IMAGE_BYTES = 256 * 2**20  # one image / frame file
MAX_IMAGE_PIXELS = 2**26  # data.max_image_pixels' default: 8192 x 8192
MAX_ASPECT = 200  # NOTE: Qwen-VL's smart_resize refuses a longer side over 200 x the shorter


def _bad(where: str, what: str) -> RecipeError:
    return RecipeError(f"{where}: {what}", key="data.path")


def read_records(path: str | Path) -> list[Any]:
    """The records of a JSON list or JSONL file (RecipeError naming the file and line otherwise)."""
    file = Path(path)
    if not file.is_file():
        raise RecipeError(f"'{path}' is not a file of conversation records (JSON list or JSONL)", key="data.path")
    error = partial(RecipeError, key="data.path")
    data = read_regular_file(file, error=error, max_bytes=MAX_FILE_BYTES, what="records file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise RecipeError(f"{path}: not UTF-8 text; expected a JSON list or JSONL of records", key="data.path") from None
    # NOTE: allow_nan: a record's numbers (a video's fps) are checked by its schema, which names the record
    if text.lstrip().startswith("["):
        records = parse_json(text, error=error, where=str(path), allow_nan=True)
    else:
        records = [parse_json(line, error=error, where=f"{path}: line {n}", allow_nan=True)
                   for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not isinstance(records, list) or not records:
        raise RecipeError(f"{path}: no records (expected a JSON list or one JSON object per line)", key="data.path")
    return records


@dataclass
class Video:
    """A record's video: its (already sampled) frame files and the rate they were sampled at (None: the default)."""

    frames: list[str]
    fps: float | None = None


def _video(ref: Any, where: str, what: str) -> Video:
    if isinstance(ref, dict):
        fps = ref.get("fps")
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, int | float) or not math.isfinite(fps)
                                or fps <= 0):
            raise _bad(where, f"{what}: 'fps' must be a positive number (got {str(fps)[:40]})")
        ref, fps = ref.get("frames"), None if fps is None else float(fps)
    else:
        fps = None
    if not isinstance(ref, list) or not ref or not all(isinstance(f, str) for f in ref):
        raise _bad(where, f"{what}: a video is a non-empty list of frame files, or {{\"frames\": [...], \"fps\": N}}")
    return Video(frames=list(ref), fps=fps)


def _role(value: Any) -> str | None:
    return _ROLES.get(value) if isinstance(value, str) else None


def to_messages(rec: Any, where: str) -> tuple[list[dict[str, Any]], list[str], list[Video]]:
    """(processor-style messages: content lists of ``{"type": "image"}`` / ``{"type": "video"}`` / ``{"type":
    "text", ...}``, the image references and the videos, each in order) of a ShareGPT or OpenAI record."""
    if not isinstance(rec, dict):
        raise _bad(where, "is not a JSON object")
    if "messages" in rec:
        out = _openai(rec["messages"], where)
    elif "conversations" in rec:
        out = _sharegpt(rec, where)
    else:
        raise _bad(where, "has neither 'messages' (OpenAI style) nor 'conversations' (ShareGPT style)")
    messages, images, videos = out
    media = len(images) + sum(len(v.frames) for v in videos)
    if media > MAX_MEDIA:
        raise _bad(where, f"has {media} images and video frames, more than the {MAX_MEDIA} a record may have")
    text = sum(len(p.get("text", "")) for m in messages for p in m["content"])
    if text > MAX_TEXT:
        raise _bad(where, f"has {text:,} characters of text, more than the {MAX_TEXT:,} a record may have")
    return out


def supervised(messages: list[dict[str, Any]]) -> bool:
    """Whether a record has something to learn: an assistant message (its content and end-of-turn are trained)."""
    return any(m["role"] == "assistant" for m in messages)


def _turns(turns: Any, where: str, what: str, shape: str) -> list[Any]:
    if not isinstance(turns, list) or not turns:
        raise _bad(where, f"'{what}' must be a non-empty list of {shape}")
    if len(turns) > MAX_TURNS:
        raise _bad(where, f"has {len(turns)} turns in '{what}', more than the {MAX_TURNS} a record may have")
    return turns


def _sharegpt(rec: dict, where: str) -> tuple[list[dict[str, Any]], list[str], list[Video]]:
    images = rec.get("images", [rec["image"]] if "image" in rec else [])
    if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
        raise _bad(where, "'images' must be a list of image paths")
    videos = rec.get("videos", [rec["video"]] if "video" in rec else [])
    if not isinstance(videos, list):
        raise _bad(where, "'videos' must be a list of videos (each a list of frame files)")
    if len(images) + len(videos) > MAX_MEDIA:
        raise _bad(where, f"has more than the {MAX_MEDIA} images and videos a record may have")
    videos = [_video(v, where, f"video {k + 1}") for k, v in enumerate(videos)]
    messages, used = [], {"image": 0, "video": 0}
    for i, turn in enumerate(_turns(rec["conversations"], where, "conversations", "{from, value} turns")):
        if not isinstance(turn, dict) or _role(turn.get("from")) is None or not isinstance(turn.get("value"), str):
            raise _bad(where, f"turn {i + 1} needs 'from' (one of {', '.join(_ROLES)}) and a string 'value'")
        content: list[dict[str, Any]] = []
        for piece in re.split(r"(<image>|<video>)", turn["value"]):
            if piece in ("<image>", "<video>"):
                kind = piece[1:-1]
                content.append({"type": kind})
                used[kind] += 1
            elif piece:
                content.append({"type": "text", "text": piece})
        messages.append({"role": _ROLES[turn["from"]], "content": content})
    if used["image"] != len(images):
        raise _bad(where, f"has {used['image']} '<image>' placeholders but {len(images)} images")
    if used["video"] != len(videos):
        raise _bad(where, f"has {used['video']} '<video>' placeholders but {len(videos)} videos")
    return messages, images, videos


def _openai(turns: Any, where: str) -> tuple[list[dict[str, Any]], list[str], list[Video]]:
    messages, images, videos = [], [], []
    for i, m in enumerate(_turns(turns, where, "messages", "{role, content} messages")):
        if not isinstance(m, dict) or _role(m.get("role")) is None or "content" not in m:
            raise _bad(where, f"message {i + 1} needs 'role' (one of {', '.join(_ROLES)}) and 'content'")
        content = m["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise _bad(where, f"message {i + 1}: 'content' must be a string or a list of parts")
        if len(content) > MAX_MEDIA:
            raise _bad(where, f"message {i + 1}: more than the {MAX_MEDIA} content parts a message may have")
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind in ("image", "image_url"):
                ref = part.get("image") or part.get("path") or part.get("url") or part.get("image_url")
                ref = ref.get("url") if isinstance(ref, dict) else ref
                if not isinstance(ref, str):
                    raise _bad(where, f"message {i + 1}: an image part without a path ('image' or 'image_url')")
                images.append(ref)
                parts.append({"type": "image"})
            elif kind == "video":
                ref = part.get("video", part.get("frames"))
                if isinstance(ref, list) and part.get("fps") is not None:
                    ref = {"frames": ref, "fps": part["fps"]}
                videos.append(_video(ref, where, f"message {i + 1}: video part"))
                parts.append({"type": "video"})
            else:
                raise _bad(where, f"message {i + 1}: content part {str(part)[:80]} is neither text, an image nor a "
                           "video")
        messages.append({"role": _ROLES[m["role"]], "content": parts})
    return messages, images, videos


def media_path(root: Path, ref: str, *, where: str, what: str) -> Path:
    """The file ``ref`` names, resolved (symlinks included), if it is a regular file inside the records' folder
    ``root`` and of bounded size."""
    if not ref or "\0" in ref or Path(ref).is_absolute() or ".." in Path(ref).parts:
        raise _bad(where, f"{what} '{ref[:200]}' is not a path inside the records' folder {root} (relative "
                   "paths only, no '..')")
    path = root / ref
    try:
        real = path.resolve(strict=True)
        info = os.stat(real)
    except FileNotFoundError:
        raise _bad(where, f"{what} '{path}' not found") from None
    except (OSError, RuntimeError) as exc:  # NOTE: RuntimeError: a symlink loop
        raise _bad(where, f"{what} '{path}' cannot be read ({str(exc)[:120]})") from None
    if not real.is_relative_to(root.resolve()):
        raise _bad(where, f"{what} '{path}' resolves to '{real}', outside the records' folder {root} (a symlink "
                   "out of it)")
    if not stat.S_ISREG(info.st_mode):
        raise _bad(where, f"{what} '{path}' is not a regular file")
    if info.st_size > MAX_IMAGE_BYTES:
        raise _bad(where, f"{what} '{path}' is {info.st_size:,} bytes, more than the {MAX_IMAGE_BYTES:,} allowed")
    return real


def open_image(path: Path, *, where: str, what: str, max_pixels: int) -> Any:
    """The RGB image of ``path``, its size checked from the header (at most ``max_pixels``, an aspect ratio of at
    most ``MAX_ASPECT``) before it is decoded."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            w, h = im.size
            if w < 1 or h < 1:
                raise _bad(where, f"{what} '{path}' is {w} x {h} pixels")
            if w * h > max_pixels:
                raise _bad(where, f"{what} '{path}' is {w} x {h} = {w * h:,} pixels, more than data.max_image_pixels "
                           f"{max_pixels:,}")
            if max(w, h) > MAX_ASPECT * min(w, h):
                raise _bad(where, f"{what} '{path}' is {w} x {h} pixels: an aspect ratio over {MAX_ASPECT}, which "
                           "the image processor refuses")
            return im.convert("RGB")
    except RecipeError:
        raise
    except Image.DecompressionBombError as exc:  # NOTE: PIL's own bound, checked when it opens the file
        raise _bad(where, f"{what} '{path}' is more than data.max_image_pixels {max_pixels:,} allow "
                   f"({str(exc).split(',')[0]})") from None
    except (OSError, ValueError, SyntaxError) as exc:
        # NOTE: PIL's UnidentifiedImageError and truncated files (OSError), its bomb check, bad headers
        detail = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise _bad(where, f"{what} '{path}' is unreadable ({detail})") from None
