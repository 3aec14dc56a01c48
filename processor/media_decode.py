"""Decode media bytes safely: images with pillow, videos with av (fps-based sampling from t=0).

Sizes are checked from headers *before* pixels are decoded, so a decompression
bomb costs a header parse, not gigabytes.
"""

from __future__ import annotations

import io
import re
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image

from mmcache.processor.errors import bad_request

# NOTE: we enforce our own pixel limit before decoding; pillow's warning would only be noise.
Image.MAX_IMAGE_PIXELS = None


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    max_image_pixels: int
    video_fps: float
    max_video_frames: int
    max_video_seconds: float


@dataclass(frozen=True, slots=True)
class DecodedVideo:
    frames: np.ndarray  # (T, H, W, 3) uint8, T >= 1
    fps: float  # sampling rate the frames represent


def decode_image(data: bytes, limits: DecodeLimits, where: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
    except Exception as exc:  # pillow raises many types for garbage input
        raise bad_request(f"{where}: cannot decode image ({_reason(exc)})", "invalid_image", where) from exc
    width, height = image.size
    _check_pixels(width, height, limits, where, "image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image.load()
    except Exception as exc:
        raise bad_request(f"{where}: cannot decode image ({_reason(exc)})", "invalid_image", where) from exc
    return image


def decode_video(data: bytes, limits: DecodeLimits, where: str) -> DecodedVideo:
    import av  # NOTE: imported on the first video: images, text and the other stages never need it

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise bad_request(f"{where}: no video stream in the file", "invalid_video", where)
            stream = container.streams.video[0]
            _check_pixels(
                stream.codec_context.width, stream.codec_context.height, limits, where, "video frame"
            )
            duration = _duration(container, stream)
            if duration is not None and duration > limits.max_video_seconds:
                raise bad_request(
                    f"{where}: video lasts {duration:.1f}s, the limit is {limits.max_video_seconds:g}s",
                    "video_too_long",
                    where,
                )
            # NOTE: a source slower than the sampling rate gives every frame, at its own rate.
            rate = float(stream.average_rate or 0) or limits.video_fps
            fps = min(limits.video_fps, rate)
            frames = _sample(container, stream, fps, rate, limits, where)
    except av.FFmpegError as exc:
        raise bad_request(f"{where}: cannot decode video ({_reason(exc)})", "invalid_video", where) from exc
    if not frames:
        raise bad_request(f"{where}: the video has no decodable frames", "invalid_video", where)
    return DecodedVideo(np.stack(frames), fps)


def _sample(container, stream, fps: float, rate: float, limits: DecodeLimits, where: str) -> list[np.ndarray]:
    """The first frame at or after each k / fps seconds (k = 0, 1, ...), up to the frame cap."""
    frames: list[np.ndarray] = []
    step = 1.0 / fps
    first: float | None = None
    size: tuple[int, int] | None = None
    for index, frame in enumerate(container.decode(stream)):
        t = frame.time if frame.time is not None else index / rate
        first = t if first is None else first
        if t - first > limits.max_video_seconds:
            raise bad_request(
                f"{where}: video is longer than {limits.max_video_seconds:g}s", "video_too_long", where
            )
        # NOTE: the small tolerance absorbs pts rounding so a 2 fps clip sampled at 2 fps keeps every frame.
        if t - first + 1e-4 < len(frames) * step:
            continue
        if size is None:
            size = (frame.width, frame.height)
        elif (frame.width, frame.height) != size:
            frame = frame.reformat(width=size[0], height=size[1])
        frames.append(frame.to_ndarray(format="rgb24"))
        if len(frames) >= limits.max_video_frames:
            break
    return frames


def _duration(container, stream) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        import av  # already loaded by decode_video

        return container.duration / av.time_base
    return None


def _check_pixels(width: int, height: int, limits: DecodeLimits, where: str, what: str) -> None:
    if width <= 0 or height <= 0:
        raise bad_request(f"{where}: {what} has no pixels", "invalid_image", where)
    if width * height > limits.max_image_pixels:
        raise bad_request(
            f"{where}: {what} is {width}x{height} = {width * height} pixels; "
            f"the limit is {limits.max_image_pixels}",
            "image_too_large",
            where,
        )
    if max(width, height) / min(width, height) > 200:
        raise bad_request(
            f"{where}: {what} aspect ratio {width}x{height} exceeds 200:1", "invalid_image", where
        )


# Decoders name the in-memory file they read ("cannot identify image file <_io.BytesIO object at 0x…>"):
# that repr means nothing to a client.
_OBJECT_REPR = re.compile(r"\s*<[\w.]+ object at 0x[0-9a-fA-F]+>")


def _reason(exc: Exception) -> str:
    text = _OBJECT_REPR.sub("", str(exc)).strip() or type(exc).__name__
    return text[:200]
