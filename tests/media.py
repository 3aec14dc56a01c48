"""Test media: the package's generators (``mmcache.media``), and a decoder independent of mmcache."""

from __future__ import annotations

import io

import numpy as np

from mmcache.media import data_url, image_array, image_bytes, video_bytes, video_frames

__all__ = ["data_url", "decode_all_frames", "image_array", "image_bytes", "video_bytes", "video_frames"]


def decode_all_frames(data: bytes) -> list[np.ndarray]:
    """Every frame of a video, decoded independently of mmcache (for HF reference runs)."""
    import av  # only video tests need it (a GPU check runs without it)

    with av.open(io.BytesIO(data)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
