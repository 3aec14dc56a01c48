"""The checkpoint presets have the dimensions they name, for every family (built on the meta
device: no weights are drawn)."""

from __future__ import annotations

import pytest
import torch

from mmcache.tiny_families import build_processor, model_class, model_config
from mmcache.tiny_model import TINY_MODEL_ARCHS
from mmcache.tiny_presets import PRESETS, check_preset


def _params(arch: str, size: str) -> tuple[object, int]:
    config = model_config(arch, build_processor(arch).tokenizer, size)
    with torch.device("meta"):
        model = model_class(arch)(config)
    return config, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch", TINY_MODEL_ARCHS)
def test_mid_has_qwen2_0_5b_text_shape_and_an_8_block_640_wide_tower(arch: str) -> None:
    config, params = _params(arch, "mid")
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.num_hidden_layers) == (896, 24)
    assert (text.num_attention_heads, text.num_key_value_heads) == (14, 2)
    assert text.intermediate_size == 4864
    assert vision.depth == 8
    assert getattr(vision, "embed_dim", None) == 640 or vision.hidden_size == 640
    assert sum(text.rope_parameters["mrope_section"]) == 32  # half of the 64-wide heads
    if arch == "qwen3-vl-moe":
        assert text.num_experts * text.moe_intermediate_size == 4864  # the dense MLP's weights, split
    assert 380e6 < params < 440e6, params


@pytest.mark.parametrize("arch", TINY_MODEL_ARCHS)
def test_2b_has_the_real_2b_dimensions(arch: str) -> None:
    config, params = _params(arch, "2b")
    text = config.text_config
    want = (2048, 28, 16, 8) if arch.startswith("qwen3") else (1536, 28, 12, 2)
    assert (
        text.hidden_size,
        text.num_hidden_layers,
        text.num_attention_heads,
        text.num_key_value_heads,
    ) == want
    assert config.dtype == torch.bfloat16 or config.dtype == "bfloat16"
    # The real models have ~2 B parameters; a 151 k-token embedding is ~0.23-0.31 B of that, the tiny
    # tokenizer's vocabulary keeps it small here.
    assert 1.3e9 < params < 3.5e9, params


def test_tiny_is_the_default_and_small() -> None:
    assert PRESETS[0] == "tiny"
    _, params = _params("qwen2-vl", "tiny")
    assert params < 2e6
    with pytest.raises(ValueError, match="unknown preset"):
        check_preset("huge")
