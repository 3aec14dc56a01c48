"""Deterministic media made on the spot with pillow and av, for tests and benchmarks (no files
shipped, nothing downloaded)."""

from __future__ import annotations

import base64
import io
from fractions import Fraction

import numpy as np
from PIL import Image


def image_array(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A smooth gradient plus seeded noise: resizing changes it, and seeds differ visibly."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    noise = rng.integers(0, 64, size=(height, width, 3))
    return ((base + noise) % 256).astype(np.uint8)


def image_bytes(width: int = 448, height: int = 448, seed: int = 0, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image_array(width, height, seed)).save(buf, format=fmt)
    return buf.getvalue()


def video_frames(num_frames: int, width: int = 224, height: int = 224, seed: int = 0) -> list[np.ndarray]:
    """Frames of one clip: frame i of a longer clip equals frame i of a shorter one (same seed)."""
    return [image_array(width, height, seed * 1000 + i) for i in range(num_frames)]


def video_bytes(
    num_frames: int = 8, width: int = 224, height: int = 224, fps: int = 2, seed: int = 0
) -> bytes:
    """An intra-only MPEG-4 clip: every frame decodes on its own, so the first frames of a longer
    recording of the same clip decode to exactly the same pixels."""
    import av  # NOTE: imported here: only video needs it, and it is a large library

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.gop_size = 1
        stream.codec_context.time_base = Fraction(1, fps)
        stream.options = {"qscale": "2"}
        for i, arr in enumerate(video_frames(num_frames, width, height, seed)):
            frame = av.VideoFrame.from_ndarray(arr, format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
