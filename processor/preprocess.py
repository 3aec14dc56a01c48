"""Resize decoded media to the model's grid and cut it into encoder chunks.

Resizing uses the checkpoint's own image and video processor classes, so the
uint8 pixels sent to the encoder are exactly those the HF processor would
normalise. An image is one chunk; a video is one chunk per temporal patch
(``temporal_patch_size`` frames), keyed by its decoded pixels.

NOTE: for Qwen2-VL and Qwen2.5-VL the per-frame video size never depends on the
number of frames (we pass ``cap_pixels_per_frame=False``), so a longer recording of
a clip yields the same first chunks. Qwen3-VL's video budget covers all frames
together: below it the same holds; a clip long enough to exceed it is resized
smaller as a whole, and its chunks are then new ones (never wrongly shared).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoVideoProcessor

from mmcache.processor.media_decode import DecodedVideo
from mmcache.shared.family import video_timestamps
from mmcache.shared.keys import ChunkKey, Fingerprint, chunk_key, fingerprint


@dataclass(frozen=True, slots=True)
class Chunk:
    key: ChunkKey
    pixels: torch.Tensor  # uint8 (frames, 3, H, W)


@dataclass(frozen=True, slots=True)
class MediaLayout:
    modality: str  # "image" | "video"
    grid_thw: tuple[int, int, int]  # in patches
    chunks: list[Chunk]
    seconds_per_chunk: float
    merge_size: int
    timestamps: tuple[float, ...] = ()  # video: time of each chunk (shown in Qwen3-VL prompts)

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w // (self.merge_size * self.merge_size)

    @property
    def nbytes(self) -> int:
        return sum(c.pixels.numel() for c in self.chunks)


class Preprocessor:
    def __init__(self, model_dir: str, video_fps: float, max_video_frames: int):
        self.image_proc = AutoImageProcessor.from_pretrained(model_dir)
        self.video_proc = AutoVideoProcessor.from_pretrained(model_dir)
        self.temporal_patch = self.video_proc.temporal_patch_size
        self.fingerprint: Fingerprint = fingerprint(
            "processor",
            [
                *_settings("image", self.image_proc),
                *_settings("video", self.video_proc),
                ("video_fps", video_fps),
                ("max_video_frames", max_video_frames),
            ],
        )

    def image(self, image: Image.Image, salt: str | None) -> MediaLayout:
        proc = self.image_proc
        chw = proc.process_image(image, do_convert_rgb=True)
        resized = proc.resize(
            chw[None], size=proc.size, resample=proc.resample, factor=proc.patch_size * proc.merge_size
        )
        pixels = resized.contiguous()  # (1, 3, H, W)
        grid = (1, pixels.shape[2] // proc.patch_size, pixels.shape[3] // proc.patch_size)
        chunk = Chunk(chunk_key(salt, pixels.numpy(), pixels.shape, self.fingerprint), pixels)
        return MediaLayout("image", grid, [chunk], 1.0, proc.merge_size)

    def video(self, video: DecodedVideo, salt: str | None) -> MediaLayout:
        proc = self.video_proc
        tp = self.temporal_patch
        frames = torch.from_numpy(video.frames).permute(0, 3, 1, 2)  # (T, 3, H, W)
        num_frames = frames.shape[0]
        # NOTE: resized before the padding, as the reference does (Qwen3-VL's size depends on the
        # frame count); a clip shorter than one temporal patch is padded first (it needs tp frames).
        if num_frames < tp:
            frames = torch.cat([frames, frames[-1:].expand(tp - num_frames, -1, -1, -1)])
        resized = proc.resize(
            frames[None],
            size=proc.size,
            resample=proc.resample,
            factor=proc.patch_size * proc.merge_size,
            temporal_factor=tp,
            cap_pixels_per_frame=False,
        )[0]
        if pad := -resized.shape[0] % tp:
            resized = torch.cat([resized, resized[-1:].expand(pad, -1, -1, -1)])
        resized = resized.contiguous()
        chunks = []
        for start in range(0, resized.shape[0], tp):
            pixels = resized[start : start + tp]
            chunks.append(Chunk(chunk_key(salt, pixels.numpy(), pixels.shape, self.fingerprint), pixels))
        grid = (len(chunks), resized.shape[2] // proc.patch_size, resized.shape[3] // proc.patch_size)
        times = tuple(video_timestamps(num_frames, video.fps, tp))
        return MediaLayout("video", grid, chunks, tp / video.fps, proc.merge_size, times)


def _settings(prefix: str, proc) -> list[tuple[str, object]]:
    names = (
        "patch_size",
        "merge_size",
        "temporal_patch_size",
        "image_mean",
        "image_std",
        "rescale_factor",
        "resample",
        "do_convert_rgb",
        "do_rescale",
        "do_normalize",
    )
    out = [(f"{prefix}.{n}", _plain(getattr(proc, n, None))) for n in names]
    out += [
        (f"{prefix}.min_pixels", proc.size.shortest_edge),
        (f"{prefix}.max_pixels", proc.size.longest_edge),
    ]
    return out


def _plain(value: object) -> object:
    if isinstance(value, (list, tuple, np.ndarray)):
        return tuple(float(v) for v in value)
    return value
