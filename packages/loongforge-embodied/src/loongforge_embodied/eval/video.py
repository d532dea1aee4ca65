"""Episode videos: H.264 mp4 through PyAV (LeRobot's video dependency)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_mp4(path: str | Path, frames: list[np.ndarray], *, fps: int) -> Path:
    """Write RGB uint8 frames (H, W, 3) to ``path`` (written to a temporary name, then renamed)."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.mp4")
    h, w = frames[0].shape[:2]
    h, w = h - h % 2, w - w % 2  # NOTE: yuv420p needs even sizes
    with av.open(str(tmp), mode="w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame[:h, :w]), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    tmp.replace(path)
    return path
