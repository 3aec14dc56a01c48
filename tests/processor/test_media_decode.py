"""Safe media decoding: limits from headers before pixels, clean 400s, fps-based video sampling."""

from __future__ import annotations

import io
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from mmcache.processor.errors import APIError
from mmcache.processor.media_decode import DecodeLimits, decode_image, decode_video
from tests.media import decode_all_frames, image_array, image_bytes, video_bytes

LIMITS = DecodeLimits(
    max_image_pixels=40_000_000, video_fps=2.0, max_video_frames=64, max_video_seconds=600.0
)


def limits(**changes) -> DecodeLimits:
    values = {
        "max_image_pixels": LIMITS.max_image_pixels,
        "video_fps": LIMITS.video_fps,
        "max_video_frames": LIMITS.max_video_frames,
        "max_video_seconds": LIMITS.max_video_seconds,
    }
    return DecodeLimits(**{**values, **changes})


def png_bomb(width: int, height: int) -> bytes:
    """A valid PNG header for a huge RGB image, with a tiny (and far too short) pixel stream."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 1024))
        + chunk(b"IEND", b"")
    )


def api_error(fn, *args) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    assert info.value.status == 400
    return info.value


# --- images ------------------------------------------------------------------------------


def test_decode_image_returns_the_pixels():
    data = image_bytes(120, 80, seed=3)
    image = decode_image(data, LIMITS, "messages[0].content[0]")
    assert image.size == (120, 80)
    assert np.array_equal(np.asarray(image.convert("RGB")), image_array(120, 80, seed=3))


def test_huge_dimension_png_is_refused_before_decoding():
    data = png_bomb(100_000, 100_000)  # 10^10 pixels: 30 GB if it were decoded
    start = time.perf_counter()
    err = api_error(decode_image, data, LIMITS, "messages[0].content[1]")
    assert time.perf_counter() - start < 0.5
    assert err.code == "image_too_large"
    assert err.param == "messages[0].content[1]"
    assert "100000x100000" in err.message


def test_pixel_limit_is_inclusive_and_configurable():
    data = image_bytes(100, 50)
    assert decode_image(data, limits(max_image_pixels=5000), "x").size == (100, 50)
    assert api_error(decode_image, data, limits(max_image_pixels=4999), "x").code == "image_too_large"


@pytest.mark.parametrize(
    "data",
    [b"", b"not an image at all" * 10, b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, b"GIF89a\x00"],
    ids=["empty", "text", "png_signature_only", "gif_header_only"],
)
def test_garbage_is_invalid_image(data):
    err = api_error(decode_image, data, LIMITS, "messages[2].content[0]")
    assert err.code == "invalid_image"
    assert err.param == "messages[2].content[0]"


@pytest.mark.parametrize("fmt, keep", [("PNG", 0.5), ("JPEG", 0.3)])
def test_truncated_image_is_invalid_image(fmt, keep):
    data = image_bytes(256, 256, fmt=fmt)
    err = api_error(decode_image, data[: int(len(data) * keep)], LIMITS, "img")
    assert err.code == "invalid_image"


def test_aspect_ratio_over_200_is_refused():
    err = api_error(decode_image, image_bytes(402, 2), LIMITS, "img")
    assert err.code == "invalid_image"
    assert "aspect" in err.message
    assert decode_image(image_bytes(400, 2), LIMITS, "img").size == (400, 2)  # exactly 200:1 is fine
    assert api_error(decode_image, image_bytes(2, 500), LIMITS, "img").code == "invalid_image"


def test_aspect_ratio_is_checked_from_the_header():
    data = png_bomb(60_000, 10)  # 600 000 pixels: under the pixel limit, 6000:1
    err = api_error(decode_image, data, LIMITS, "img")
    assert err.code == "invalid_image" and "aspect" in err.message


def test_other_formats_decode():
    arr = image_array(64, 48, seed=1)
    for fmt in ("JPEG", "WEBP", "BMP", "GIF"):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format=fmt)
        assert decode_image(buf.getvalue(), LIMITS, "img").size == (64, 48)


# --- videos ------------------------------------------------------------------------------


def frame_indices(sampled: np.ndarray, all_frames: list[np.ndarray]) -> list[int]:
    """Which source frame each sampled frame is (the test frames are all distinct)."""
    out = []
    for frame in sampled:
        matches = [i for i, f in enumerate(all_frames) if np.array_equal(f, frame)]
        assert len(matches) == 1
        out.append(matches[0])
    return out


def test_4fps_clip_sampled_at_2fps_keeps_every_other_frame():
    data = video_bytes(num_frames=10, width=64, height=64, fps=4)
    video = decode_video(data, LIMITS, "v")
    assert video.fps == 2.0
    assert video.frames.dtype == np.uint8 and video.frames.shape == (5, 64, 64, 3)
    assert frame_indices(video.frames, decode_all_frames(data)) == [0, 2, 4, 6, 8]


def test_2fps_clip_sampled_at_2fps_keeps_every_frame():
    data = video_bytes(num_frames=8, width=64, height=48, fps=2)
    video = decode_video(data, LIMITS, "v")
    assert video.fps == 2.0
    assert video.frames.shape == (8, 48, 64, 3)
    assert frame_indices(video.frames, decode_all_frames(data)) == list(range(8))


def test_1fps_clip_sampled_at_2fps_keeps_every_frame_at_its_own_rate():
    data = video_bytes(num_frames=5, width=64, height=64, fps=1)
    video = decode_video(data, LIMITS, "v")
    assert video.fps == 1.0
    assert frame_indices(video.frames, decode_all_frames(data)) == [0, 1, 2, 3, 4]


def test_6fps_clip_sampled_at_2fps_keeps_every_third_frame():
    data = video_bytes(num_frames=12, width=32, height=32, fps=6)
    video = decode_video(data, LIMITS, "v")
    assert frame_indices(video.frames, decode_all_frames(data)) == [0, 3, 6, 9]


def test_max_frames_caps_the_sample():
    data = video_bytes(num_frames=10, width=64, height=64, fps=2)
    video = decode_video(data, limits(max_video_frames=3), "v")
    assert frame_indices(video.frames, decode_all_frames(data)) == [0, 1, 2]
    video = decode_video(data, limits(max_video_frames=4, video_fps=1.0), "v")
    assert video.fps == 1.0
    assert frame_indices(video.frames, decode_all_frames(data)) == [0, 2, 4, 6]


def test_first_frames_of_a_longer_recording_decode_identically():
    short = decode_video(video_bytes(num_frames=4, width=64, height=64), LIMITS, "v").frames
    long = decode_video(video_bytes(num_frames=10, width=64, height=64), LIMITS, "v").frames
    assert np.array_equal(long[:4], short)


@pytest.mark.parametrize(
    "data",
    [b"", b"garbage" * 200, b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 100],
    ids=["empty", "text", "mp4_box_only"],
)
def test_garbage_is_invalid_video(data):
    err = api_error(decode_video, data, LIMITS, "messages[0].content[2]")
    assert err.code == "invalid_video"
    assert err.param == "messages[0].content[2]"


def test_truncated_video_is_invalid_or_shorter():
    data = video_bytes(num_frames=8, width=64, height=64)
    try:
        video = decode_video(data[: len(data) // 3], LIMITS, "v")
    except APIError as err:
        assert err.status == 400 and err.code == "invalid_video"
    else:
        assert 1 <= len(video.frames) <= 8


def test_video_longer_than_the_limit_is_refused():
    data = video_bytes(num_frames=10, width=64, height=64, fps=2)  # 5 seconds
    err = api_error(decode_video, data, limits(max_video_seconds=2.0), "v")
    assert err.code == "video_too_long"
    assert decode_video(data, limits(max_video_seconds=5.0), "v").frames.shape[0] == 10


def test_video_frame_size_is_limited_like_an_image():
    data = video_bytes(num_frames=2, width=64, height=64)
    err = api_error(decode_video, data, limits(max_image_pixels=64 * 64 - 1), "v")
    assert err.code == "image_too_large"


def test_an_undecodable_image_is_named_without_an_object_repr():
    with pytest.raises(APIError) as info:
        decode_image(b"not an image" * 10, LIMITS, "messages[0].content[0]")
    assert info.value.message.startswith("messages[0].content[0]: cannot decode image")
    assert "object at 0x" not in info.value.message and "BytesIO" not in info.value.message
