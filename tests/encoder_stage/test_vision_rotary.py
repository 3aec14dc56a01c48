"""The vision tower's rotary embedding through the compiled kernel: transformers' bits, only inside
our tower's forward."""

from __future__ import annotations

import importlib

import pytest
import torch

from mmcache.encoder_stage import tower_kernels, vision_rotary
from mmcache.encoder_stage.vision import VisionInput, VisionTower
from mmcache.shared import cpu_kernels
from mmcache.shared.checkpoint import ModelSpec
from mmcache.tiny_model import TINY_MODEL_ARCHS


def _module(path) -> object:
    return importlib.import_module(ModelSpec.load(path).family.vision_class.split(":")[0])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("arch", TINY_MODEL_ARCHS)
def test_embeddings_with_the_kernel_equal_transformers_bit_for_bit(
    tiny_models, arch: str, dtype: str
) -> None:
    tower = VisionTower(ModelSpec.load(tiny_models[arch]), device="cpu", dtype=dtype)
    assert tower.kernels is not None  # a C compiler is installed (scripts/setup)
    # the attention alike in both runs (its own kernel: test_vision_attention.py)
    tower.model.config._attn_implementation = "sdpa"
    pixels = torch.randint(
        0, 256, (1, 3, 224, 448), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
    )
    chunk = VisionInput("image", pixels)
    calls = []
    module = _module(tiny_models[arch])
    wrapped = getattr(module, vision_rotary.NAME)

    def counting(*args):
        calls.append(vision_rotary._fits(*args))
        return wrapped(*args)

    setattr(module, vision_rotary.NAME, counting)
    try:
        ours = tower.encode([chunk])[0]
    finally:
        setattr(module, vision_rotary.NAME, wrapped)
    assert calls and all(calls)  # every block's call took the kernel's path
    lib, tower.kernels = tower.kernels, None
    eager = tower.encode([chunk])[0]
    tower.kernels = lib
    assert torch.equal(ours, eager)


def test_the_wrapper_is_the_reference_outside_our_forward_and_the_kernel_inside(tiny_models) -> None:
    VisionTower(ModelSpec.load(tiny_models["qwen2-vl"]), device="cpu", dtype="bfloat16")  # installs it
    module = _module(tiny_models["qwen2-vl"])
    wrapped = getattr(module, vision_rotary.NAME)
    original = wrapped.mmcache_original
    gen = torch.Generator().manual_seed(4)
    rows, heads, dim = 37, 4, 40
    q, k, _ = torch.randn(rows, 3, heads, dim, generator=gen).to(torch.bfloat16).permute(1, 0, 2, 3).unbind(0)
    angles = torch.randn(rows, dim // 2, generator=gen)
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    expected = original(q, k, cos, sin)
    lib = cpu_kernels.kernels()
    assert lib is not None
    with tower_kernels.active(lib):
        inside = wrapped(q, k, cos, sin)
        float_q = wrapped(q.float(), k.float(), cos, sin)
        half_q = wrapped(q.half(), k.half(), cos, sin)  # not a type the kernel takes: the reference
    for got, want in zip(inside, expected, strict=True):
        assert torch.equal(got, want)
    for args, got in (((q.float(), k.float()), float_q), ((q.half(), k.half()), half_q)):
        assert all(torch.equal(a, b) for a, b in zip(got, original(*args, cos, sin), strict=True))
    assert tower_kernels.current() is None  # the block restored the reference for everyone else
