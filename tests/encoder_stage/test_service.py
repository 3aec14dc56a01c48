"""Encoder service settings that depend on where the tower runs."""

from __future__ import annotations

import torch

from mmcache.encoder_stage.service import EncoderService, default_batch_tokens
from mmcache.encoder_stage.vision import VisionTower
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.config import EncoderConfig


def test_batch_budget_is_small_on_cpu_unless_set(tiny_model):
    tower = VisionTower(ModelSpec.load(tiny_model), device="cpu")
    auto = EncoderService(EncoderConfig(model=str(tiny_model)), tower)
    assert auto.batcher.max_tokens == default_batch_tokens(torch.device("cpu")) == 2048
    assert default_batch_tokens(torch.device("cuda", 0)) == 4096
    chosen = EncoderService(EncoderConfig(model=str(tiny_model), max_batch_tokens=8192), tower)
    assert chosen.batcher.max_tokens == 8192
