"""Processor resize + encoder normalise/patchify == the HF processor, bit for bit (both archs).

The processor sends resized uint8 pixels; the encoder turns them into ``pixel_values``
(encoder_stage.vision.VisionTower.patches). Together they must reproduce what the
checkpoint's own HF image / video processor computes from the decoded media.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor

from mmcache.encoder_stage.vision import VisionInput, VisionTower
from mmcache.processor.media_decode import DecodedVideo, DecodeLimits, decode_image, decode_video
from mmcache.processor.preprocess import Preprocessor
from mmcache.shared.checkpoint import ModelSpec
from tests.media import decode_all_frames, image_array, image_bytes, video_bytes

ARCHS = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe")
LIMITS = DecodeLimits(
    max_image_pixels=40_000_000, video_fps=2.0, max_video_frames=64, max_video_seconds=600.0
)


@dataclass
class Stack:
    path: Path
    hf: object  # the HF processor (image_processor, video_processor)
    pre: Preprocessor
    tower: VisionTower


@pytest.fixture(scope="module", params=ARCHS)
def stack(request, tiny_models) -> Stack:
    path = tiny_models[request.param]
    return Stack(
        path,
        AutoProcessor.from_pretrained(path),
        Preprocessor(str(path), video_fps=2.0, max_video_frames=64),
        VisionTower(ModelSpec.load(path), device="cpu", dtype="float32"),
    )


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def _image_cases() -> dict[str, bytes]:
    rgb = image_array(150, 110, seed=4)
    alpha = ((rgb[..., 1].astype(int) * 7) % 256).astype(np.uint8)
    return {
        "448x448": image_bytes(448, 448, seed=1),
        "300x200": image_bytes(300, 200, seed=2),
        "1000x120": image_bytes(1000, 120, seed=3),
        "57x57": image_bytes(57, 57, seed=4),
        "900x700_downscaled": image_bytes(900, 700, seed=5, fmt="JPEG"),
        "20x30_upscaled": image_bytes(20, 30, seed=6),
        "rgba_png": _encoded(Image.fromarray(np.dstack([rgb, alpha]), mode="RGBA"), "PNG"),
        "grey_jpeg": _encoded(Image.fromarray(rgb[..., 0], mode="L"), "JPEG"),
        "palette_png": _encoded(Image.fromarray(rgb).convert("P"), "PNG"),
        "cmyk_jpeg": _encoded(Image.fromarray(rgb).convert("CMYK"), "JPEG"),
    }


IMAGE_CASES = _image_cases()


def _patches(stack: Stack, layout) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """What the encoder computes from the processor's chunks (all chunks of one item)."""
    flats, grids = [], []
    for chunk in layout.chunks:
        assert chunk.pixels.dtype == torch.uint8
        flat, grid = stack.tower.patches(VisionInput(layout.modality, chunk.pixels))
        flats.append(flat)
        grids.append(grid)
    t = sum(g[0] for g in grids)
    assert all(g[1:] == grids[0][1:] for g in grids)
    return torch.cat(flats), (t, *grids[0][1:])


@pytest.mark.parametrize("name", list(IMAGE_CASES))
def test_image_pixel_values_equal_hf(stack: Stack, name: str):
    image = decode_image(IMAGE_CASES[name], LIMITS, "img")
    layout = stack.pre.image(image, salt=None)
    ref = stack.hf.image_processor(images=[image], return_tensors="pt")

    assert layout.modality == "image" and len(layout.chunks) == 1
    assert list(layout.grid_thw) == ref["image_grid_thw"][0].tolist()
    pixel_values, grid = _patches(stack, layout)
    assert list(grid) == ref["image_grid_thw"][0].tolist()
    assert pixel_values.dtype == ref["pixel_values"].dtype
    assert pixel_values.shape == ref["pixel_values"].shape
    assert (pixel_values - ref["pixel_values"]).abs().max().item() <= 1e-6
    t, h, w = layout.grid_thw
    assert layout.num_tokens == t * h * w // 4
    patch = stack.hf.image_processor.patch_size
    assert layout.chunks[0].pixels.shape == (1, 3, h * patch, w * patch)


VIDEO_CASES = {
    "4f_224x224": (4, 224, 224),
    "6f_320x180": (6, 320, 180),
    "5f_odd_frames": (5, 112, 84),
    "8f_480x270_downscaled": (8, 480, 270),
}


@pytest.mark.parametrize("name", list(VIDEO_CASES))
def test_video_pixel_values_equal_hf(stack: Stack, name: str):
    n, width, height = VIDEO_CASES[name]
    video = decode_video(video_bytes(num_frames=n, width=width, height=height, fps=2), LIMITS, "v")
    assert video.frames.shape[0] == n  # a 2 fps clip at 2 fps: every frame
    layout = stack.pre.video(video, salt=None)
    ref = stack.hf.video_processor(videos=[video.frames], do_sample_frames=False, return_tensors="pt")

    assert layout.modality == "video"
    assert len(layout.chunks) == (n + 1) // 2  # one chunk per temporal patch of 2 frames
    assert list(layout.grid_thw) == ref["video_grid_thw"][0].tolist()
    pixel_values, grid = _patches(stack, layout)
    assert list(grid) == ref["video_grid_thw"][0].tolist()
    assert pixel_values.shape == ref["pixel_values_videos"].shape
    assert (pixel_values - ref["pixel_values_videos"]).abs().max().item() <= 1e-6
    assert layout.seconds_per_chunk == 2 / video.fps
    # each chunk's time: the mean of its first and last frame's, the padded last chunk its last frame's
    assert layout.timestamps == tuple(
        (2 * i + min(2 * i + 1, n - 1)) / 2 / video.fps for i in range(len(layout.chunks))
    )
    for chunk in layout.chunks:
        assert chunk.pixels.shape[:2] == (2, 3)


def test_video_from_independent_decoder_equals_hf(stack: Stack):
    """Same check with frames decoded outside mmcache (the HF reference's own view of the clip)."""
    frames = np.stack(decode_all_frames(video_bytes(num_frames=4, width=224, height=224)))
    layout = stack.pre.video(DecodedVideo(frames, 2.0), salt=None)
    ref = stack.hf.video_processor(videos=[frames], do_sample_frames=False, return_tensors="pt")
    pixel_values, grid = _patches(stack, layout)
    side = 224 // stack.hf.video_processor.patch_size  # 16 patches of 14 pixels, 14 of 16 (Qwen3-VL)
    assert list(grid) == ref["video_grid_thw"][0].tolist() == [2, side, side]
    assert (pixel_values - ref["pixel_values_videos"]).abs().max().item() <= 1e-6


# --- chunk identity -------------------------------------------------------------------------


def test_image_chunk_key_follows_pixels_and_salt(stack: Stack):
    a = decode_image(image_bytes(300, 200, seed=1), LIMITS, "img")
    b = decode_image(image_bytes(300, 200, seed=2), LIMITS, "img")
    key = stack.pre.image(a, None).chunks[0].key
    assert stack.pre.image(a, None).chunks[0].key == key
    assert stack.pre.image(b, None).chunks[0].key != key
    assert stack.pre.image(a, "tenant").chunks[0].key != key
    # the same pixels re-encoded losslessly in another container are the same chunk
    bmp = _encoded(Image.open(io.BytesIO(image_bytes(300, 200, seed=1))), "BMP")
    assert stack.pre.image(decode_image(bmp, LIMITS, "img"), None).chunks[0].key == key


def test_longer_recording_shares_leading_chunks(stack: Stack):
    short = decode_video(video_bytes(num_frames=4), LIMITS, "v")
    long = decode_video(video_bytes(num_frames=8), LIMITS, "v")
    short_keys = [c.key for c in stack.pre.video(short, None).chunks]
    long_keys = [c.key for c in stack.pre.video(long, None).chunks]
    assert len(short_keys) == 2 and len(long_keys) == 4
    assert long_keys[:2] == short_keys
    assert len(set(long_keys)) == 4
    other_seed = decode_video(video_bytes(num_frames=4, seed=9), LIMITS, "v")
    assert not set(short_keys) & {c.key for c in stack.pre.video(other_seed, None).chunks}


def test_fingerprint_covers_preprocessing_settings(stack: Stack):
    same = Preprocessor(str(stack.path), video_fps=2.0, max_video_frames=64)
    assert same.fingerprint == stack.pre.fingerprint
    assert Preprocessor(str(stack.path), video_fps=1.0, max_video_frames=64).fingerprint != same.fingerprint
    assert Preprocessor(str(stack.path), video_fps=2.0, max_video_frames=32).fingerprint != same.fingerprint
