"""Qwen3-VL's deepstack feature sets travel with the merged embedding as one tensor per chunk:
cached together (their bytes counted), a token range of every set sent as one zero-copy frame."""

from __future__ import annotations

import io

import torch
from PIL import Image

from mmcache.encoder_stage.embedding_cache import EmbeddingCache
from mmcache.encoder_stage.vision import VisionInput, VisionTower
from mmcache.processor.preprocess import Preprocessor
from mmcache.shared import wire
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.messages import FetchReply
from tests.media import image_bytes


def test_feature_sets_are_cached_together_and_sent_without_a_copy(tiny_models):
    path = tiny_models["qwen3-vl"]
    spec = ModelSpec.load(path)
    assert spec.feature_sets == 4  # merged, then deepstack layers 0, 1, 2
    tower = VisionTower(spec, device="cpu", dtype="float32")
    layout = Preprocessor(str(path), 2.0, 64).image(Image.open(io.BytesIO(image_bytes(448, 448))), None)
    (rows,) = tower.encode([VisionInput("image", layout.chunks[0].pixels)])
    hidden = spec.text_config["hidden_size"]
    assert rows.shape == (196, 4, hidden) and rows.is_contiguous()
    assert len({bytes(rows[:, i].numpy()) for i in range(4)}) == 4  # four different sets

    cache = EmbeddingCache(capacity_bytes=1 << 30)
    key = b"k" * 16
    cache.put(key, rows, handoff=False)
    assert cache.nbytes == 196 * 4 * hidden * 4  # every set's float32 rows are accounted

    tail = cache.read(key)[150:]  # a partial hit's remaining rows, of every set
    frames = wire.encode(FetchReply(tail))
    (frame,) = frames[2:]
    assert frame.__array_interface__["data"][0] == tail.data_ptr() == rows[150].data_ptr()  # a view
    reply, _ = wire.decode(frames)
    assert torch.equal(reply.rows, rows[150:])
    cache.done(key, release_handoff=False)
