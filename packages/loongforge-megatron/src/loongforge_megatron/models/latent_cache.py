"""What the diffusion kinds' latent caches (``loongforge data prepare`` writes them, ``data.format: latent_cache``
reads them) share: the checks on the user's media and caption files, the local model folders the encoders load
from, and the cache's index and completion marker.

Every defect in a user's file is one line naming the file, the recipe key that points at it and what is allowed
(:func:`bad`), never a traceback.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import torch
from loongforge.errors import RecipeError

MAX_IMAGE_BYTES = 64 << 20
MAX_CAPTION_BYTES = 1 << 20
INDEX, DONE = "index.json", "prepared.json"


def bad(where: Path | str, what: str, *, key: str) -> RecipeError:
    """The one-line error about ``where`` (a file or folder named by recipe key ``key``)."""
    return RecipeError(f"{where}: {what}", key=key)


def regular_file(path: Path, *, limit: int, key: str) -> None:
    """``path`` is a regular file (not a link out, a device or a folder) of at most ``limit`` bytes."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise bad(path, f"cannot be read ({exc.strerror or type(exc).__name__})", key=key) from None
    if not stat.S_ISREG(info.st_mode):
        raise bad(path, "is not a regular file", key=key)
    if info.st_size > limit:
        raise bad(path, f"is {info.st_size:,} bytes, more than the {limit:,} allowed", key=key)


def read_image(path: Path, *, key: str, what: str = "image") -> torch.Tensor:
    """An image file (any format PIL reads) as RGB ``uint8 [H, W, 3]``."""
    from PIL import Image, ImageOps

    regular_file(path, limit=MAX_IMAGE_BYTES, key=key)
    try:
        with Image.open(path) as im:
            # NOTE: upright as diffusers' load_image turns it (a camera's EXIF orientation applied)
            rgb = ImageOps.exif_transpose(im).convert("RGB")
            rgb.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        # NOTE: PIL's unreadable / truncated files, bad headers, oversized images
        detail = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise bad(path, f"is not a readable {what} ({detail})", key=key) from None
    w, h = rgb.size
    return torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(h, w, 3)


def read_caption(path: Path, *, owner: Path, key: str) -> str:
    """The UTF-8 caption in ``path`` (of the clip / image ``owner``)."""
    if not path.exists():
        raise bad(owner, f"has no caption ({path.name}: its caption, UTF-8 text)", key=key)
    regular_file(path, limit=MAX_CAPTION_BYTES, key=key)
    try:
        caption = path.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise bad(path, f"is not UTF-8 text (byte {exc.start})", key=key) from None
    if not caption or "\0" in caption:
        raise bad(path, "is empty (a caption is needed)" if not caption else "holds a NUL byte", key=key)
    return caption


def load_local(fn: Any, path: str, *, key: str, what: str) -> Any:
    """``fn(path)`` (a ``from_pretrained``) on a local folder, never the hub; a missing or wrong folder is one line."""
    if not Path(path).is_dir():
        raise RecipeError(f"{path} is not a folder ({what})", key=key)
    try:
        return fn(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        detail = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise RecipeError(f"{path}: not {what} ({detail})", key=key) from None


def quiet_loaders() -> None:
    """No progress bars from transformers / diffusers: they would break the one-line contract of a later error."""
    import diffusers.utils.logging
    import transformers

    transformers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.disable_progress_bar()


def read_index(root: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A prepared cache's completion marker and its records (``index.json``'s list under ``"records"``)."""
    if not (root / DONE).is_file():
        raise RecipeError(f"{root} is not a prepared latent cache (run loongforge data prepare with this recipe)",
                          key="data.path")
    try:
        done = json.loads((root / DONE).read_text())
        index = json.loads((root / INDEX).read_text())
        # NOTE: "clips": the name the first video caches gave the list
        records = index["records"] if "records" in index else index["clips"]
        if not isinstance(done, dict) or not isinstance(records, list) or not all(
                isinstance(r, dict) for r in records):
            raise TypeError("not an object with a list of records")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RecipeError(f"{root / INDEX}: not a latent cache index ({str(exc)[:120]})", key="data.path") from None
    return done, records


def check_widths(root: Path, done: dict[str, Any], **widths: int | None) -> None:
    """The embedding widths the cache was prepared with (``prepared.json``) are the model's (``widths``: a key of it
    -> the model's value; a cache that does not record one is not checked)."""
    for key, want in widths.items():
        have = done.get(key)
        if have is not None and have != want:
            raise RecipeError(f"{root} was prepared for another model ({key} {have}, this model's is {want}): run "
                              "loongforge data prepare --force with this recipe", key="data.path")


def write_index(root: Path, records: list[dict[str, Any]], **done: Any) -> None:
    """The index, then the completion marker (last: a cache without it is incomplete and prepared again)."""
    (root / INDEX).write_text(json.dumps({"records": records}, indent=1))
    (root / DONE).write_text(json.dumps({"records": len(records), **done}))
